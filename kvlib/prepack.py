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
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from .model import Linear, Transformer
from .validate import positive_int


def available() -> bool:
    """Whether bf16 weights can be packed here: a PyTorch build with oneDNN and its
    packed-linear ops, on a CPU whose oneDNN runs bf16 (AVX512 or AVX-NE-CONVERT and up;
    an AVX2-only CPU, or ``DNNL_MAX_CPU_ISA=AVX2``, has no bf16 path to pack for)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_is_mkldnn_bf16_supported")
            and bool(ops._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """A bf16 `Linear` whose weight is stored in oneDNN's packed layout (CPU only).

    ``PackedLinear(weight)`` takes kvlib's ``(in, out)`` bf16 weight and reorders it once.
    ``forward(x)`` multiplies ``(..., in)`` bf16 rows by it, ``(..., out)``, for any number
    of rows (the layout does not depend on the batch). ``keep_rows=True`` also keeps the
    plain matrix, so that a tied embedding can read single rows.
    """

    def __init__(self, weight: torch.Tensor, keep_rows: bool = False) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D tensor (in, out), got {getattr(weight, 'shape', type(weight).__name__)}")
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs bf16 weights on the CPU, got {weight.dtype} on {weight.device}")
        if not available():
            raise RuntimeError("bf16 weights cannot be packed here: this PyTorch build has no oneDNN packed-linear "
                               "ops (torch.ops.mkldnn), or this CPU's oneDNN has no bf16 path (kvlib.prepack.available())")
        K, N = weight.shape
        w = weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 1)  # (out, in), permuted inside
        self.register_buffer("packed", packed)
        self.register_buffer("rows", w.t().contiguous() if keep_rows else None)  # (out, in) = (vocab, d)
        self.in_features, self.out_features = K, N

    @classmethod
    def from_linear(cls, linear: Linear, keep_rows: bool = False) -> "PackedLinear":
        return cls(linear.weight, keep_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"PackedLinear multiplies bf16 rows on the CPU, got {x.dtype} on {x.device}")
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a tied embedding: ``(...)`` ids -> ``(..., in)``, from the plain copy."""
        if self.rows is None:
            raise RuntimeError("this PackedLinear was built without keep_rows=True: its rows are packed")
        return self.rows[tokens]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed bf16{', plain rows kept' if self.rows is not None else ''}")


def prepack_weights(model: Transformer) -> Transformer:
    """Replace, in place, every `Linear` of a bf16 CPU model by a `PackedLinear`; return it.

    Outputs equal the plain model's up to bf16 rounding (another kernel sums in another
    order). A tied lm_head keeps its plain rows for the embedding, so the model then
    stores the vocabulary matrix twice (`kvlib.wquant.stored_bytes` counts both).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"prepack_weights needs a kvlib Transformer, got {type(model).__name__}")
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        raise ValueError(f"prepack_weights packs bf16 models on the CPU, got {model.dtype} on {model.device}; "
                         "load one with kvlib.load_smollm2(dtype=torch.bfloat16)")
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
