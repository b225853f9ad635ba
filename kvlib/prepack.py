"""Prepacked weights: a bf16 matrix reordered once into the layout the CPU's kernel reads.

On a CPU with AMX or AVX512-BF16, PyTorch multiplies bf16 matrices with oneDNN's
``brg_matmul``. Its inner loop does not read an ordinary row-major matrix: it wants the
weight cut into tiles, with pairs of neighbouring input rows interleaved (oneDNN names
the layout ``AB16b64a2b``), because the bf16 dot-product instructions consume two bf16
numbers per 32-bit lane. Hand it a plain ``(in, out)`` or ``(out, in)`` tensor, as
``x @ W`` does, and it reformats the weight inside every call. For a prefill chunk that
copy hides behind the arithmetic; for a decode step, one row times the matrix, the copy
*is* the work, so bf16 ends up no faster than fp32 despite half the bytes.

``ONEDNN_VERBOSE=1`` shows it: a plain bf16 ``x @ W`` runs ``brg_matmul ... wei:bf16::
blocked:ab`` (or ``ba``), the packed one ``inner_product ... wei:bf16::blocked:AB16b64a2b``
after a single ``reorder`` at load time. `prepack_weights` does that reorder once per
matrix, with PyTorch's own ops (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, what inductor's freezing pass and Intel's extension use), and
swaps each `Linear` for a `PackedLinear` that calls the kernel on the packed copy.

The packed bytes are the same count as the plain ones: it is a permutation, not a
compression. It cannot be read back cheaply, so a tied lm_head keeps its plain matrix
as well, for the embedding's rows (`PackedLinear.embedding_rows`).

*fp32.* oneDNN packs fp32 weights the same way, for its fp32 kernel; vLLM's CPU backend runs
its fp32 projections so (``create_onednn_mm`` in vLLM's ``dispatch_cpu_unquantized_gemm``).
`prepack_weights` packs an fp32 model too, and ``load_smollm2(prepack=True)`` loads one packed,
but only when asked: results then move from the plain model's by rounding, and whether it is
faster depends on the CPU's BLAS against its oneDNN at the step's number of rows (`python -m
kvbench` measures it on the Engine's requests).

*The default.* ``kvlib.load_smollm2(dtype=torch.bfloat16)`` packs the model it makes
wherever `available` says the CPU's oneDNN has a bf16 path (`use_prepack` decides), since
plain bf16 decodes slower than fp32 there. ``prepack=False``, or ``KVLIB_PREPACK=0`` in the
environment, gives the plain layout; `unpack_weights` turns a packed model back. Where
there is no bf16 path, asking for bf16 on the CPU warns (`SlowBF16Warning`): fp32 is faster.

A packed model behaves as a plain one for what does not touch the layout: its
``state_dict`` holds the plain ``(in, out)`` weights (and loads them, repacking),
``copy.deepcopy`` repacks a copy, ``.to()`` that keeps bf16 on the CPU is a no-op, and
`kvlib.wquant.quantize_weights` quantizes its matrices. What needs the plain layout
refuses, naming the way back: ``.to()`` another dtype or device, and
``set_batch_invariant`` (packed kernels are not batch-invariant).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from .model import Linear, Transformer
from .validate import positive_int

#: The environment variable that turns the default packing off: ``KVLIB_PREPACK=0``.
ENV = "KVLIB_PREPACK"
_UNPACK_HINT = ("call kvlib.prepack.unpack_weights(model) first, or load it with "
                "kvlib.load_smollm2(..., prepack=False) (or KVLIB_PREPACK=0)")


#: what `PackedLinear` packs, and the batch size each layout is reordered for (oneDNN's hint:
#: bf16 for one row, a decode step; fp32 for 32 rows, as vLLM's CPU backend packs its fp32 weights)
PACKABLE = {torch.bfloat16: 1, torch.float32: 32}


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether weights of ``dtype`` can be packed here: a PyTorch build with oneDNN and its
    packed-linear ops and, for bf16, a CPU whose oneDNN runs bf16 (AVX512 or AVX-NE-CONVERT
    and up; an AVX2-only CPU, or ``DNNL_MAX_CPU_ISA=AVX2``, has no bf16 path to pack for)."""
    ops = torch.ops.mkldnn
    built = (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
             and hasattr(ops, "_linear_pointwise"))
    if dtype == torch.float32 or not built:
        return built and dtype in PACKABLE
    return dtype == torch.bfloat16 and hasattr(ops, "_is_mkldnn_bf16_supported") and bool(ops._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A bf16 or fp32 `Linear` whose weight is stored in oneDNN's packed layout (CPU only).

    ``PackedLinear(weight)`` takes kvlib's ``(in, out)`` weight and reorders it once.
    ``forward(x)`` multiplies ``(..., in)`` rows of the same dtype by it, ``(..., out)``, for
    any number of rows (the layout does not depend on the batch). ``keep_rows=True`` also
    keeps the plain matrix, so that a tied embedding can read single rows.
    """

    def __init__(self, weight: torch.Tensor, keep_rows: bool = False) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D tensor (in, out), got {getattr(weight, 'shape', type(weight).__name__)}")
        if weight.dtype not in PACKABLE or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs bf16 or fp32 weights on the CPU, got {weight.dtype} on {weight.device}")
        if not available(weight.dtype):
            raise RuntimeError(f"{weight.dtype} weights cannot be packed here: this PyTorch build has no oneDNN "
                               "packed-linear ops (torch.ops.mkldnn), or this CPU's oneDNN has no bf16 path "
                               "(kvlib.prepack.available())")
        K, N = weight.shape
        w = weight.detach()
        self.dtype = w.dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), PACKABLE[w.dtype])  # (out, in), permuted
        self.register_buffer("packed", packed)
        self.register_buffer("rows", w.t().contiguous() if keep_rows else None)  # (out, in) = (vocab, d)
        self.in_features, self.out_features = K, N

    @classmethod
    def from_linear(cls, linear: Linear, keep_rows: bool = False) -> "PackedLinear":
        return cls(linear.weight, keep_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu":
            raise ValueError(f"this PackedLinear multiplies {self.dtype} rows on the CPU, got {x.dtype} on {x.device}")
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a tied embedding: ``(...)`` ids -> ``(..., in)``, from the plain copy."""
        if self.rows is None:
            raise RuntimeError("this PackedLinear was built without keep_rows=True: its rows are packed")
        return self.rows[tokens]

    def plain_weight(self) -> torch.Tensor:
        """The weight in kvlib's plain ``(in, out)`` layout: oneDNN reorders it back exactly."""
        rows = self.rows if self.rows is not None else self.packed.to_dense()  # (out, in)
        return rows.t().contiguous()  # (in, out)

    def unpacked(self) -> Linear:
        """A plain kvlib `Linear` with this layer's weight (a copy)."""
        linear = Linear(self.in_features, self.out_features)
        linear.weight = nn.Parameter(self.plain_weight(), requires_grad=False)
        return linear

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        # the packed tensor is opaque (no storage to copy): pack the copy afresh
        copy = PackedLinear(self.plain_weight(), keep_rows=self.rows is not None)
        copy.train(self.training)
        return copy

    def check_apply(self, fn) -> None:
        """Raise unless ``fn`` (what ``.to``/``.float``/``.cuda`` apply to every tensor) keeps the dtype
        on the CPU. `kvlib.Transformer` asks every layer before it moves any, so a refusal changes nothing."""
        probe = fn(torch.zeros(1, dtype=self.dtype))
        if probe.dtype != self.dtype or probe.device.type != "cpu":
            raise ValueError(f"this model's {self.dtype} matrices are prepacked for the CPU (kvlib.prepack) and "
                             f"cannot move to {probe.dtype} on {probe.device}; {_UNPACK_HINT}")

    def _apply(self, fn, recurse: bool = True):
        # nn.Module.to/.float/.cuda: a no-op where the dtype stays on the CPU; otherwise refuse
        self.check_apply(fn)
        return self

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.plain_weight()  # (in, out), as a plain Linear saves it

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        if tuple(w.shape) != (self.in_features, self.out_features):
            error_msgs.append(f"{key}: expected (in, out) = {(self.in_features, self.out_features)}, "
                              f"got {tuple(w.shape)}")
            return
        w = w.detach().to(self.dtype).t().contiguous()  # (out, in)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACKABLE[self.dtype])
        if self.rows is not None:
            self.rows = w

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed {str(self.dtype)[6:]}{', plain rows kept' if self.rows is not None else ''}")


def prepack_weights(model: Transformer) -> Transformer:
    """Replace, in place, every `Linear` of a bf16 or fp32 CPU model by a `PackedLinear`; return it.

    Outputs equal the plain model's up to rounding (another kernel sums in another order), so
    an fp32 model packed is close to the plain one but not equal to the bit. fp32 is not packed
    by default: it is what vLLM's CPU backend does with its fp32 weights (oneDNN's matmul on a
    weight reordered once at load), and `python -m kvbench` measures what it gives kvlib's
    Engine; a plain ``x @ W`` goes to the BLAS library instead, whose small-batch kernels are
    faster on some CPUs and slower on others. A tied lm_head keeps its plain rows for the
    embedding, so the model then stores the vocabulary matrix twice (`kvlib.wquant.stored_bytes`
    counts both).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"prepack_weights needs a kvlib Transformer, got {type(model).__name__}")
    if model.dtype not in PACKABLE or model.device.type != "cpu":
        raise ValueError(f"prepack_weights packs bf16 or fp32 models on the CPU, got {model.dtype} on "
                         f"{model.device}; load one with kvlib.load_smollm2(dtype=torch.bfloat16) or the default fp32")
    if model.batch_invariant:
        raise ValueError("this model is batch-invariant (set_batch_invariant); packed kernels are not")
    swaps = []  # (parent module, attribute name, new module); all built before any is swapped
    with torch.no_grad():
        for parent in model.layers.modules():
            for name, child in parent.named_children():
                if isinstance(child, Linear):
                    swaps.append((parent, name, PackedLinear.from_linear(child)))
        if isinstance(model.lm_head, Linear):
            tied = model.tok_emb is None
            swaps.append((model, "lm_head", PackedLinear.from_linear(model.lm_head, keep_rows=tied)))
    for parent, name, module in swaps:
        setattr(parent, name, module)
    return model


def unpack_weights(model: Transformer) -> Transformer:
    """The inverse of `prepack_weights`: every `PackedLinear` back to a plain `Linear`, in
    place; return the model. A model with nothing packed is returned as it is."""
    if not isinstance(model, Transformer):
        raise TypeError(f"unpack_weights needs a kvlib Transformer, got {type(model).__name__}")
    swaps = [(parent, name, child.unpacked()) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, PackedLinear)]
    for parent, name, module in swaps:
        setattr(parent, name, module)
    return model


def is_packed(model: Transformer) -> bool:
    """Whether any of ``model``'s matrices is prepacked (`PackedLinear`)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


class SlowBF16Warning(UserWarning):
    """bf16 was asked for on a CPU whose oneDNN has no bf16 path: fp32 is faster there."""


def use_prepack(prepack: bool | None, dtype: torch.dtype, device: torch.device | str | None) -> bool:
    """Whether a model loaded in ``dtype`` on ``device`` is to be packed (`load_smollm2`'s rule).

    ``prepack=None`` (the default) packs a bf16 CPU model where `available`, unless
    ``KVLIB_PREPACK=0`` is set, and never an fp32 one; ``False`` never packs; ``True`` packs
    (fp32 too) or raises where it cannot. Asking for bf16 on a CPU with no bf16 path warns (`SlowBF16Warning`).
    """
    if prepack is not None and not isinstance(prepack, bool):
        raise TypeError(f"prepack must be True, False or None, got {prepack!r}")
    env = os.environ.get(ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (the plain layout) or 1 (pack where possible), got {env!r}")
    dev = torch.device(device if device is not None else "cpu")
    bf16_cpu = dtype == torch.bfloat16 and dev.type == "cpu"
    ok = bf16_cpu and available()
    if bf16_cpu and not ok:
        warnings.warn(
            "bf16 on this CPU is several times slower than fp32, not faster: its oneDNN has no bf16 path "
            "(no AVX512-BF16 or AMX, or DNNL_MAX_CPU_ISA/ATEN_CPU_CAPABILITY keeps it off), so every bf16 "
            "product is emulated, widening to fp32 and rounding back, and a decode step that reads half the "
            "bytes still takes longer. Load with dtype=torch.float32 for speed; the model stays bf16, as asked.", SlowBF16Warning, stacklevel=3)
    if prepack is True and dtype == torch.float32 and dev.type == "cpu" and available(torch.float32):
        return True  # fp32 packs only when asked (see prepack_weights)
    if prepack is True and not ok:
        why = (f"it packs bf16 or fp32 models on the CPU, got {dtype} on {dev}" if not bf16_cpu else
               "this CPU's oneDNN has no bf16 path to pack for (kvlib.prepack.available() is False)")
        raise ValueError(f"prepack=True cannot be honoured: {why}; pass prepack=None or False")
    if prepack is None:
        return ok and env != "0"
    return prepack


@dataclass(frozen=True)
class OneDNNCall:
    """One line of oneDNN's verbose log: a primitive it ran, as `onednn_trace` parses it.

    ``who``: ``"pack"`` (building the `PackedLinear`), ``"plain"`` (``x @ W``) or
    ``"packed"``; ``primitive``: ``"reorder"``, ``"matmul"``, ``"inner_product"``;
    ``kernel``: oneDNN's implementation (``brg_matmul:avx10_1_512_amx`` is AMX brgemm);
    ``weights``: the weight's (for a reorder, the output's) memory layout, ``ab`` row-major,
    ``AB16b64a2b`` packed; ``ms``: its time as oneDNN logged it.
    """

    who: str
    primitive: str
    kernel: str
    weights: str
    ms: float


_TRACE = """
import torch
from kvlib.prepack import PackedLinear
w = torch.randn({d_in}, {d_out}).to(torch.bfloat16)  # (in, out)
x = torch.randn(1, {d_in}).to(torch.bfloat16)  # one decode row
print("=== pack", flush=True)
layer = PackedLinear(w)
for _ in range({calls}):
    print("=== plain", flush=True)
    x @ w
    print("=== packed", flush=True)
    layer(x)
print("=== end", flush=True)
"""


def onednn_trace(d_in: int = 576, d_out: int = 1536, calls: int = 3) -> list[OneDNNCall]:
    """What oneDNN runs for one bf16 row times a ``(d_in, d_out)`` matrix, plain and packed.

    Runs a fresh Python with ``ONEDNN_VERBOSE=1`` (oneDNN prints its log from C, to the
    process's own stdout), which packs the matrix once, then calls ``x @ W`` and the
    `PackedLinear` in turn, ``calls`` times each. Returns the primitives it logged, in
    order; an empty list where bf16 weights cannot be packed here (`available`). Where
    the plain calls log nothing, ``x @ W`` does not go through oneDNN on this CPU.
    """
    for name, v in (("d_in", d_in), ("d_out", d_out), ("calls", calls)):
        positive_int(name, v)
    if not available():
        return []
    script = _TRACE.format(d_in=d_in, d_out=d_out, calls=calls)
    out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ONEDNN_VERBOSE="1"),
                         capture_output=True, text=True, check=True).stdout
    who, found = None, []
    for line in out.splitlines():
        if line.startswith("=== "):
            who = line[4:]
            continue
        f = line.split(",")
        if who in ("pack", "plain", "packed") and f[:4] == ["onednn_verbose", "v1", "primitive", "exec"]:
            descs = f[8].split()  # "src:bf16::blocked:ab::f0 wei:bf16::blocked:AB16b64a2b::f0 ..."
            key = "dst:" if f[5] == "reorder" else "wei:"
            layout = next(d for d in descs if d.startswith(key)).split(":")[4]
            found.append(OneDNNCall(who, f[5], f[6], layout, float(f[-1])))
    return found
