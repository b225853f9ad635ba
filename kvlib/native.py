"""What the hardware is, asked rather than timed: `fast_dtype` (the dtype a device
multiplies fastest, and the limits it obeys) and `last_level_cache_bytes`.

Decisions from the hardware's features and the environment, never from a timing, so
they are the same on every run. `kvlib.hardware` re-exports them, where the chapters
call them.
"""

from __future__ import annotations

import os

import torch

_FORCED = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# oneDNN's ISA caps (DNNL_MAX_CPU_ISA) that leave out every bf16 dot-product instruction
_ISA_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


def fast_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The dtype this device multiplies matrices fastest in: bf16 where it has bf16 matrix
    instructions, fp32 elsewhere.

    Intel AMX and AVX512-BF16 CPUs, and CUDA GPUs from Ampere on, multiply bf16 natively
    (on this book's build machine, about twice as fast as fp32 for a prefill chunk). On
    other CPUs PyTorch emulates bf16 and it is *slower* than fp32, so asking is cheaper
    than guessing. A decision from the hardware's features, not a timing: it is the same
    on every run. Whether bf16 also *decodes* faster is another matter (a matrix-vector
    product is bound by memory, and not every CPU has a fast bf16 kernel for it):
    chapter 11 measures that rather than assuming it.

    On a CPU the answer also follows the limits PyTorch's kernels obey, so that it agrees
    with what they will do:

    * ``KVLIB_FAST_DTYPE=fp32`` (or ``bf16``) in the environment decides outright, for a
      test, a CI job, or a reader who wants the other;
    * ``DNNL_MAX_CPU_ISA`` below ``AVX512_CORE_BF16`` (``AVX2``, say) or
      ``ATEN_CPU_CAPABILITY`` of ``default``/``avx2`` keeps oneDNN and ATen off the bf16
      instructions, so the answer is fp32 whatever ``torch.cpu``'s probes (which see the
      hardware itself) report. This is how CI runs the book as a CPU without AMX would.
    """
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if dev.type != "cpu":
        raise ValueError(f"fast_dtype() knows CPUs and CUDA GPUs, got device {dev}")
    forced = os.environ.get("KVLIB_FAST_DTYPE", "").strip().lower()
    if forced:
        if forced not in _FORCED:
            raise ValueError(f"KVLIB_FAST_DTYPE must be one of {sorted(_FORCED)}, got {forced!r}")
        return _FORCED[forced]
    isa = os.environ.get("DNNL_MAX_CPU_ISA", "").strip().upper()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if isa in _ISA_WITHOUT_BF16 or aten in ("default", "avx2"):
        return torch.float32
    # private probes (torch.cpu has no public one); absent in an older torch, they count as "no"
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    native = any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return torch.bfloat16 if native else torch.float32


_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of CPU 0's largest-level cache, in bytes, as the OS reports it; None
    where it does not (only Linux exposes ``root``, one ``index*`` directory per cache).

    A matrix smaller than this can stay in the cache from one step to the next, so a
    "memory bandwidth" measured on it may be partly the cache's. Server CPUs' last-level
    caches reach hundreds of MB, as large as a small model's weights.
    """
    best = None  # (level, bytes)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for name in entries:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(root, name, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, name, "size")) as f:
                size = f.read().strip()
            n = int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1:] in _SIZE_UNITS else int(size)
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, n)
    return None if best is None else best[1]
