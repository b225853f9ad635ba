"""What a step costs in time: a roofline model of a forward step, and the machines it runs on.

A step must read every weight once and every cached key and value once, and it
must do its FLOPs. Neither can go faster than the hardware allows, so::

    step time  >=  max(bytes / mem_bandwidth,  FLOPs / peak_flops)        (the roofline)

`step_time` refines that bound the way the step really runs, one kernel after
another, each on its own roof, plus the fixed cost of launching them::

    overhead(rows)                          Python, launches, norms: measured
    + matmul FLOPs / attainable(rows)       rows = batch * new_tokens share each weight
    + max(KV bytes / attention bandwidth, attention FLOPs / peak)

A spec-sheet `Hardware` preset knows only its bandwidth and peaks, so its matmul
roof is the ideal ``min(peak, rows * 2 / dtype_bytes * bandwidth)``; `measure`
profiles the machine you run on, and records what its kernels actually attain.
Bandwidths are bytes/s and peaks FLOP/s, in the spec sheets' decimal units; memory is bytes,
and an HBM GPU's "80 GB" is binary: 80 GiB, 80 * 2**30 = 85.9e9 bytes (see `HARDWARE`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from . import cost, memory
from .attention import attend
from .cache import StaticCache
from .config import ModelConfig
from .generate import decode_step
from .model import Linear, Transformer
from .native import fast_dtype, last_level_cache_bytes  # noqa: F401  (re-exported here)
from .timing import fastest_of, graphed
from .validate import int_at_least, positive_int

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU) as the roofline sees it.

    ``overhead`` and ``overhead_per_row`` (seconds per step, and per token row in it),
    ``matmul_rows`` (rows -> FLOP/s a weight matmul attains) and
    ``attention_rows`` (batch -> bytes/s attention attains reading the cache) are filled
    by `measure`; a spec-sheet preset leaves them empty and gets the ideal roofs.
    """

    name: str
    mem_bandwidth: float
    peak_flops: Mapping[str, float]
    memory: float
    source: str
    overhead: float = 0.0
    overhead_per_row: float = 0.0
    matmul_rows: Mapping[int, float] = field(default_factory=dict)
    attention_rows: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("mem_bandwidth", "memory"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"Hardware.{name} must be a positive number, got {v!r}")
        if not self.peak_flops:
            raise ValueError(f"Hardware {self.name!r} needs at least one peak_flops entry")
        for dt, v in self.peak_flops.items():
            memory.dtype_bytes(dt)  # a known dtype name
            if not v > 0:
                raise ValueError(f"Hardware {self.name!r}: peak_flops[{dt!r}] must be positive, got {v!r}")
        if not self.source:
            raise ValueError(f"Hardware {self.name!r} needs a source for its numbers")
        for v in (self.overhead, self.overhead_per_row, *self.matmul_rows.values(), *self.attention_rows.values()):
            if v < 0:
                raise ValueError(f"Hardware {self.name!r}: measured values must be >= 0, got {v!r}")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s at ``dtype``; ``ValueError`` if this hardware lists none for it."""
        memory.dtype_bytes(dtype)
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no peak for {dtype!r}; it lists {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def ridge(self, dtype: str) -> float:
        """The intensity (FLOPs per byte) where the two roofs meet: below it, memory sets the pace."""
        return self.peak(dtype) / self.mem_bandwidth

    def attainable(self, intensity: float, dtype: str) -> float:
        """FLOP/s the roofline allows a kernel of ``intensity`` FLOPs per byte."""
        if not intensity > 0:
            raise ValueError(f"intensity must be positive, got {intensity!r}")
        return min(self.peak(dtype), intensity * self.mem_bandwidth)

    def matmul_flops(self, rows: int, dtype: str) -> float:
        """FLOP/s of a weight matmul with ``rows`` rows sharing each weight.

        Measured points are interpolated in log(rows); past the last one the rate
        stays there. With none measured, the ideal roof at intensity ``2 rows / width``.
        """
        positive_int("rows", rows)
        if not self.matmul_rows:
            return self.attainable(2 * rows / memory.dtype_bytes(dtype), dtype)
        self.peak(dtype)
        return _interpolate(self.matmul_rows, rows)

    def attention_bandwidth(self, batch: int) -> float:
        """Bytes/s attention attains reading ``batch`` sequences' caches: measured
        (interpolated like `matmul_flops`), else the memory bandwidth."""
        positive_int("batch", batch)
        return _interpolate(self.attention_rows, batch) if self.attention_rows else self.mem_bandwidth


def _interpolate(points: Mapping[int, float], x: int) -> float:
    """Linear in log(x) between measured points; scaled with x below the first, flat past the last."""
    pts = sorted(points.items())
    if x <= pts[0][0]:
        return pts[0][1] * x / pts[0][0]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return pts[-1][1]


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time (seconds), by part; ``bound`` is the bare roofline."""

    overhead: float
    matmul: float
    attention: float
    bound: float
    bytes: int
    flops: int
    ridge: float

    @property
    def total(self) -> float:
        return self.overhead + self.matmul + self.attention

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the whole step."""
        return self.flops / self.bytes

    @property
    def memory_bound(self) -> bool:
        """True when bytes, not FLOPs, set the bare roofline (intensity below the ridge)."""
        return self.intensity < self.ridge


def step_time(config: ModelConfig, hw: Hardware, batch: int = 1, context: int = 0, new_tokens: int = 1,
              dtype: str = memory.DEFAULT_DTYPE, kv_dtype: str | float | None = None) -> StepTime:
    """Predicted seconds of one forward step on ``hw``: ``batch`` sequences with
    ``context`` tokens cached, each adding ``new_tokens`` (a decode step is 1; a
    prefill of T tokens is ``context=0, new_tokens=T``), weights at ``dtype`` and the
    cache at ``kv_dtype`` (default ``dtype``). Attention runs at ``dtype``'s peak.

    Example

    >>> cfg, h100 = kvlib.PRESETS["llama-3-8b"], kvlib.hardware.HARDWARE["h100"]
    >>> decode = kvlib.hardware.step_time(cfg, h100, batch=1, context=1024)
    >>> decode.memory_bound, round(decode.total * 1e3, 1)  # milliseconds: reading 15 GB of weights
    (True, 4.5)
    >>> kvlib.hardware.step_time(cfg, h100, context=0, new_tokens=4096).memory_bound  # a long prefill
    False
    """
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a Hardware, got {type(hw).__name__}")
    peak = hw.peak(dtype)
    b = cost.step_bytes(config, batch, context, new_tokens, dtype, kv_dtype)
    f = cost.step_flops(config, batch, context, new_tokens)
    kv = b["kv_read"] + b["kv_write"]
    attn_bw = min(hw.attention_bandwidth(batch), hw.mem_bandwidth)
    matmul = max(f["matmul"] / hw.matmul_flops(batch * new_tokens, dtype), b["weights"] / hw.mem_bandwidth)
    return StepTime(
        overhead=hw.overhead + hw.overhead_per_row * batch * new_tokens,
        matmul=matmul,
        attention=max(kv / attn_bw, f["attention"] / peak),
        bound=max(b["total"] / hw.mem_bandwidth, f["total"] / peak),
        bytes=b["total"],
        flops=f["total"],
        ridge=hw.ridge(dtype),
    )


# -- spec sheets --------------------------------------------------------------------------------
# Dense peaks (NVIDIA also quotes "with sparsity" figures, twice these); bandwidths in the sheets'
# decimal units. HBM capacities are binary (an H100's "80 GB" is 80 GiB, 85.9e9 bytes); the T4's,
# L4's, RTX 4090's and M2's GDDR and LPDDR figures are the sheets' GB read as decimal bytes.
_T = 1e12
_GiB = 2**30
HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(
        "NVIDIA H200 SXM", 4.8e12, {"fp32": 67 * _T, "fp16": 989.4 * _T, "bf16": 989.4 * _T,
                                    "fp8": 1978.9 * _T, "int8": 1978.9 * _T}, 141 * _GiB,
        "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (dense)"),
    "h100": Hardware(
        "NVIDIA H100 SXM", 3.35e12, {"fp32": 67 * _T, "fp16": 989.4 * _T, "bf16": 989.4 * _T,
                                     "fp8": 1978.9 * _T, "int8": 1978.9 * _T}, 80 * _GiB,
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense)"),
    "a100": Hardware(
        "NVIDIA A100 80GB SXM", 2.039e12, {"fp32": 19.5 * _T, "fp16": 312 * _T, "bf16": 312 * _T,
                                           "int8": 624 * _T}, 80 * _GiB,
        "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense)"),
    "l4": Hardware(
        "NVIDIA L4", 300e9, {"fp32": 30.3 * _T, "fp16": 121 * _T, "bf16": 121 * _T, "fp8": 242.5 * _T,
                             "int8": 242.5 * _T}, 24e9,
        "NVIDIA L4 Tensor Core GPU datasheet (dense: half the sparsity figures)"),
    "t4": Hardware(
        "NVIDIA T4 (Colab's free GPU)", 320e9, {"fp32": 8.1 * _T, "fp16": 65 * _T, "int8": 130 * _T}, 16e9,
        "NVIDIA T4 Tensor Core GPU datasheet (mixed-precision FP16/FP32 peak)"),
    "rtx4090": Hardware(
        "NVIDIA GeForce RTX 4090", 1008e9, {"fp32": 82.6 * _T, "fp16": 165.2 * _T, "bf16": 165.2 * _T},
        24e9,
        "NVIDIA Ada Lovelace architecture whitepaper, appendix A (FP16 tensor with FP32 accumulate, dense)"),
    "m2": Hardware(
        "Apple M2 (GPU)", 100e9, {"fp32": 3.6 * _T}, 24e9,
        "Apple newsroom, 'Apple unveils M2', June 2022 (100 GB/s unified memory, 3.6 TFLOPS GPU, up to 24 GB)"),
}


# -- what a tuned decode loop attains of a spec sheet ----------------------------------------------
# One measured reference, not a law: the benchmark table of gpt-fast's README (PyTorch team, 2023,
# https://github.com/pytorch-labs/gpt-fast), Llama-2-7B at batch 1 with a 5-token prompt, compiled
# with torch.compile, on an A100-80GB power-limited to 330 W. Weights' dtype -> (tokens/s, bytes/s
# of weights read). Over HARDWARE["a100"].mem_bandwidth that is 69% of the spec in 16 bits, 52% with
# int8 weights and 42% with int4 weights (groups of 32): dequantizing costs the kernels time.
GPT_FAST_A100: dict[str, tuple[float, float]] = {
    "bf16": (104.9, 1397.31e9),
    "int8": (155.58, 1069.20e9),
    "int4": (196.80, 862.69e9),
}


# -- measuring the machine you are on -------------------------------------------------------------
def _matrices(config: ModelConfig | None, nbytes: int, dtype: torch.dtype, device: torch.device) -> list:
    """Matrices totalling at least ``nbytes``, in kvlib's ``(in, out)`` layout.

    With a config: its blocks' four matrices, as many blocks as ``nbytes`` needs (up
    to all ``n_layer``), and its lm_head, so the mix of shapes is the model's own.
    Without: copies of a generic ``(1024, 4096)`` and ``(4096, 1024)`` pair.
    """
    width = torch.empty((), dtype=dtype).element_size()
    if config is None:
        block, head, most = [(1024, 4096), (4096, 1024)], [], None
    else:
        d, ff = config.d_model, config.d_ff
        qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        block, head = [(d, qkv), (config.n_head * config.head_dim, d), (d, 2 * ff), (ff, d)], [(d, config.vocab_size)]
        most = config.n_layer
    per_block = sum(i * o for i, o in block) * width
    rest = nbytes - sum(i * o for i, o in head) * width
    blocks = max(1, -(-rest // per_block))
    if most is not None:
        blocks = min(blocks, most)
    return [torch.full(s, 0.01, dtype=dtype, device=device) for s in block * blocks + head]


def _sweep(mats: list[torch.Tensor], rows: int) -> Callable[[], list]:
    """A function multiplying ``rows`` rows into each matrix of ``mats`` in turn (kvlib's ``x @ W``)."""
    xs = {w.shape[0]: torch.full((rows, w.shape[0]), 0.01, dtype=w.dtype, device=w.device) for w in mats}
    return lambda: [xs[w.shape[0]] @ w for w in mats]  # each (rows, in) @ (in, out)


def _step_timer(config: ModelConfig, batch: int, dtype: torch.dtype, device: torch.device,
                best: Callable) -> tuple[float, Transformer]:
    """Fastest decode step (seconds) of a model of ``config`` with constant weights, 16 tokens cached."""
    model = Transformer(config, device="meta", dtype=dtype).to_empty(device=device).eval()
    for p in model.parameters():
        p.detach().fill_(0.01)  # the time does not depend on the values, and random init is slow
    cache = StaticCache.for_model(config, batch, 17, dtype=dtype, device=device)
    cache.lengths = [16] * config.n_layer  # zeros: the numbers do not change the time
    tok = torch.zeros(batch, dtype=torch.long, device=device)
    return best(lambda: (decode_step(model, tok, cache), cache.crop(16))), model


def _overhead(config: ModelConfig, batches: tuple[int, int], dtype: torch.dtype, device: torch.device,
              best: Callable, nbytes: int) -> tuple[float, float]:
    """The time a decode step spends outside its matmuls: ``(fixed, per token row)`` seconds.

    Both come from models of ``config``'s depth, head counts and width. The per-row part
    is the slope between two batch sizes with every matrix tiny (head_dim 2, d_ff 8,
    vocab 64). The fixed part is measured *in place*: with MLP matrices big enough to
    stream from memory (up to ``nbytes``), a step minus those same matmuls timed alone
    (the intercept of step time against the bytes it streams). Between big matrices the
    small ops (norms, adds, launches) find their data evicted from the caches, and on
    CPUs we measured that doubled their cost against the all-tiny model.
    """
    tiny = config.replace(head_dim=2, d_ff=8, vocab_size=64, tie_embeddings=True)
    times = [_step_timer(tiny, b, dtype, device, best)[0] for b in batches]
    per_row = max(0.0, (times[1] - times[0]) / (batches[1] - batches[0]))
    width = torch.empty((), dtype=dtype).element_size()
    d_ff = max(8, min(config.d_ff, nbytes // (3 * config.d_model * config.n_layer * width)))
    t_step, model = _step_timer(tiny.replace(d_ff=d_ff), 1, dtype, device, best)
    t_mm = best(_sweep([m.weight for m in model.modules() if isinstance(m, Linear)], 1))
    return max(0.0, t_step - t_mm - per_row), per_row


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@torch.no_grad()
def measure(config: ModelConfig | None, dtype: str, device: str | torch.device | None = None, *,
            rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32), nbytes: int = 512 * 2**20,
            repeats: int = 3) -> Hardware:
    """Profile the machine running this: a `Hardware` whose numbers are measured, not quoted.

    * ``mem_bandwidth``: bytes/s of one vector times matrices totalling ``nbytes``
      (more than a CPU's last-level cache or a GPU's L2, 50 MB on an H100: they stream from memory);
    * ``matmul_rows``: FLOP/s of the same matrices times ``rows`` rows each;
    * ``peak_flops[dtype]``: a 2048-square matrix product (8192-square on a GPU);
    * with a ``config``: the matrices are its own (`_matrices`); ``attention_rows`` is
      kvlib's attention reading caches of its head shape at each batch in ``rows``; and
      ``overhead`` (plus ``overhead_per_row``) is what a step of its depth and width
      spends outside its matmuls (see `_overhead`).

    On a GPU the timers read CUDA events (`kvlib.timing.fastest_of`), and the matrix and
    attention sweeps replay from a CUDA graph (`kvlib.timing.graphed`): eagerly, a small
    matrix's launch takes longer than its bytes, and the sweep would measure launches.

    ``dtype`` (required: what runs fast differs by machine, ``"fp32"`` on most CPUs) is
    the width of the numbers timed. Takes a few seconds and ``nbytes`` (twice, briefly) of memory.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"measure() runs torch dtypes {sorted(TORCH_DTYPES)}, got {dtype!r}")
    for r in rows:
        positive_int("rows", r)
    int_at_least("nbytes", nbytes, 2**20)
    positive_int("repeats", repeats)
    if config is not None:
        memory.check_config(config)
    dev = torch.device(device if device is not None else "cpu")
    tdt, width = TORCH_DTYPES[dtype], memory.dtype_bytes(dtype)
    best = fastest_of(dev, repeats)  # CUDA: timed with CUDA events (kvlib.timing)
    mats = _matrices(config, nbytes, tdt, dev)
    # Past 32 rows a matmul reuses each weight so often that it is compute-bound wherever
    # the weights sit, so a quarter of the matrices is enough and four times quicker.
    curve = {}
    for m in sorted(set(rows) | {1}):
        used = mats if m <= 32 else mats[: max(1, len(mats) // 4)]
        curve[m] = 2 * m * sum(w.numel() for w in used) / best(graphed(_sweep(used, m), dev))  # GPU: one launch
    bandwidth = curve[1] * width / 2  # one row: 2 FLOPs per weight read, so bytes/s = FLOP/s * width / 2
    del mats
    n = 2048 if dev.type == "cpu" else 8192  # a GPU does 2048 squared in microseconds: launch-bound
    a = torch.full((n, n), 0.01, dtype=tdt, device=dev)
    peak = 2 * n**3 / best(lambda: a @ a)
    del a
    overhead = per_row = 0.0
    attn = {}
    if config is not None:
        H, Hkv, D, L = config.n_head, config.n_kv_head, config.head_dim, config.n_layer
        buf = torch.full((nbytes // width,), 0.01, dtype=tdt, device=dev)  # one allocation, viewed per batch
        for b in sorted(set(rows)):
            S = min(max(1, nbytes // (2 * L * b * Hkv * D * width)), config.max_seq_len)  # caches total nbytes
            kv = buf[: 2 * L * b * Hkv * S * D].view(2 * L, b, Hkv, S, D)  # every layer's K and V
            q = torch.full((b, H, 1, D), 0.01, dtype=tdt, device=dev)
            attn[b] = kv.nbytes / best(graphed(lambda: [attend(q, kv[2 * i], kv[2 * i + 1], None) for i in range(L)], dev))
        del buf
        overhead, per_row = _overhead(config, (1, max(rows)), tdt, dev, best, nbytes)
    if dev.type == "cuda":
        name = f"{torch.cuda.get_device_name(dev)} (measured)"
    else:
        threads = torch.get_num_threads()
        name = f"this CPU, {threads} thread{'s' if threads != 1 else ''} (measured)"
    return Hardware(
        name=name, mem_bandwidth=bandwidth, peak_flops={dtype: max(peak, *curve.values())},
        memory=_memory_bytes(dev), source=f"kvlib.hardware.measure() on {time.strftime('%Y-%m-%d')}",
        overhead=overhead, overhead_per_row=per_row, matmul_rows=curve, attention_rows=attn,
    )


def fastest(*profiles: Hardware) -> Hardware:
    """One profile from several `measure` runs of the same machine, each number at its best.

    Noise on a shared machine only ever makes a measurement slower, so the best of
    profiles taken at different times (chapter 5 takes them in turns with the timings
    they must predict) is the closest to what the machine can do: the highest
    bandwidths and FLOP rates, the lowest overheads.
    """
    if not profiles or not all(isinstance(p, Hardware) for p in profiles):
        raise TypeError(f"fastest() takes Hardware profiles, got {[type(p).__name__ for p in profiles]}")
    first = profiles[0]
    for p in profiles[1:]:
        if (set(p.peak_flops), set(p.matmul_rows), set(p.attention_rows)) != (
                set(first.peak_flops), set(first.matmul_rows), set(first.attention_rows)):
            raise ValueError("fastest() needs profiles measured alike (same dtypes, rows and batches)")

    def top(attr: str) -> dict:
        return {k: max(getattr(p, attr)[k] for p in profiles) for k in getattr(first, attr)}

    return replace(
        first,
        mem_bandwidth=max(p.mem_bandwidth for p in profiles),
        peak_flops=top("peak_flops"),
        overhead=min(p.overhead for p in profiles),
        overhead_per_row=min(p.overhead_per_row for p in profiles),
        matmul_rows=top("matmul_rows"),
        attention_rows=top("attention_rows"),
        source=f"{first.source}, best of {len(profiles)} profiles",
    )
