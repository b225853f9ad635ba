"""Weight-only quantization: matrices stored in int8 (or int4), activations kept in float.

A decode step multiplies one row vector by every weight matrix, so its time is
mostly the bytes of the weights streamed from memory. Store each matrix in int8
and those bytes halve (from bf16) or quarter (from fp32); a fused kernel turns the
integers back into floats as it reads them. (Where no fast kernel fits, `Int8Linear`
converts the whole matrix to floats first: correct, but no faster.)

int8, symmetric, one scale per output channel (column of kvlib's ``(in, out)``
weight)::

    s = max|w| / 127        q = round(w / s) in [-127, 127]        ŵ = q * s,  |w - ŵ| <= s / 2

int4, asymmetric, one scale and minimum per group of ``group_size`` inputs::

    s = (max - min) / 15    q = round((w - min) / s) in [0, 15]    ŵ = q * s + min

torch's CPU kernels want nn.Linear's ``(out, in)`` layout, so that is how the
integers are stored. ``quantize_weights(model)`` swaps a model's `Linear` layers
for `Int8Linear` (or `Int4Linear`) in place; ``stored_bytes(model)`` counts what
it then stores. (The KV cache's quantizers are in `kvlib.quant`.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .model import Linear, Transformer
from .prepack import PackedLinear

MODES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
# Measured here (1 thread, torch 2.13 CPU, 576 x 1536): the fused int8 kernel beats
# "convert to float, then multiply" for bf16 rows, a few at a time (1 row 0.075 vs
# 0.38 ms, 8 rows 0.23 vs 0.35 ms), and loses for fp32 or fp16 rows (1 row 0.75 vs
# 0.40 ms for fp32, much worse for more rows). "auto" uses it there: decode steps of a bf16 model.
KERNEL_DTYPES = (torch.bfloat16,)
KERNEL_MAX_ROWS = 8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of a kvlib weight ``w`` ``(in, out)``.

    Returns ``w_int8`` ``(out, in)`` int8 and ``scales`` ``(out,)`` in ``w``'s dtype:
    the layout of ``torch.ops.aten._weight_int8pack_mm``. An all-zero channel gets
    scale 1 (its codes are all 0, so it dequantizes to exact zeros).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor (in, out), got {getattr(w, 'shape', type(w).__name__)}")
    wt = w.detach().t().float()  # (out, in)
    amax = wt.abs().amax(dim=1)  # (out,)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(w.dtype)  # rounded as stored
    q = torch.round(wt / scales.float()[:, None]).clamp(-127, 127)  # (out, in)
    return q.to(torch.int8).contiguous(), scales


def dequantize_int8(w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float weight ``(in, out)`` (kvlib's layout) that ``w_int8`` ``(out, in)`` and ``scales`` stand for."""
    return (w_int8.to(scales.dtype) * scales[:, None]).t()


def quantize_int4(w: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of a kvlib weight ``w`` ``(in, out)``, one (scale, zero) per ``group_size`` inputs.

    Returns codes ``q`` ``(out, in)`` uint8 in ``[0, 15]`` (one per byte: `Int4Linear`
    packs them) and ``scales_and_zeros`` ``(in / group_size, out, 2)`` in ``w``'s dtype,
    the layout torch's int4 kernel reads. It writes ``ŵ = (q - 8) * s + zero`` with
    ``zero = min + 8 s``, which is ``q * s + min``.
    """
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor (in, out), got {getattr(w, 'shape', type(w).__name__)}")
    K, N = w.shape
    if K % group_size:
        raise ValueError(f"in_features={K} of weight {tuple(w.shape)} is not a multiple of group_size={group_size}")
    wg = w.detach().t().float().reshape(N, K // group_size, group_size)  # (out, groups, group_size)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)  # (out, groups, 1)
    s = ((hi - lo) / 15).clamp(min=1e-6).to(w.dtype)  # a constant group still gets a usable scale
    zero = (lo + 8 * s.float()).to(w.dtype)
    q = torch.round((wg - lo) / s.float()).clamp(0, 15).to(torch.uint8).reshape(N, K)  # (out, in)
    scales_and_zeros = torch.cat([s, zero], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float weight ``(in, out)`` that `quantize_int4`'s outputs stand for."""
    N, K = q.shape
    s, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # each (out, groups)
    w = (q.float().reshape(N, K // group_size, group_size) - 8) * s[..., None] + zero[..., None]
    return w.reshape(N, K).t().to(scales_and_zeros.dtype)  # (in, out)


class Int8Linear(nn.Module):
    """A `Linear` whose weight is stored as int8 codes ``(out, in)`` and scales ``(out,)``.

    ``impl`` picks the multiply: ``"kernel"`` (torch's fused CPU int8 kernel),
    ``"dequantize"`` (convert the codes to x's dtype, multiply, scale the outputs:
    one scale per output column, so it can come after the matmul), or ``"auto"``
    (the kernel where it is fast, see ``KERNEL_DTYPES``; else dequantize).
    """

    def __init__(self, w_int8: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or scales.shape != w_int8.shape[:1]:
            raise ValueError(f"need int8 codes (out, in) and scales (out,), got {w_int8.dtype} "
                             f"{tuple(w_int8.shape)} and {tuple(scales.shape)}")
        self.register_buffer("w_int8", w_int8)  # (out, in) int8
        self.register_buffer("scales", scales)  # (out,) float
        self.impl = "auto"

    @property
    def in_features(self) -> int:
        return self.w_int8.shape[1]

    @property
    def out_features(self) -> int:
        return self.w_int8.shape[0]

    @classmethod
    def from_linear(cls, linear: Linear) -> "Int8Linear":
        return cls(*quantize_int8(linear.weight))

    def _use_kernel(self, x2: torch.Tensor) -> bool:
        if self.impl not in ("auto", "kernel", "dequantize"):
            raise ValueError(f"Int8Linear.impl must be 'auto', 'kernel' or 'dequantize', got {self.impl!r}")
        if self.impl != "auto":
            return self.impl == "kernel"
        return (
            x2.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            and x2.dtype in KERNEL_DTYPES and x2.shape[0] <= KERNEL_MAX_ROWS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, K = self.w_int8.shape
        x2 = x.reshape(-1, K)  # (M, in): every leading dim is a row
        scales = self.scales.to(x.dtype)  # a no-op unless the model changed dtype
        if self._use_kernel(x2):
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.w_int8, scales)  # (M, out)
        else:
            y = (x2 @ self.w_int8.t().to(x.dtype)) * scales  # (M, out)
        return y.view(*x.shape[:-1], N)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight ``(in, out)``, kvlib's layout (a full-size copy)."""
        return dequantize_int8(self.w_int8, self.scales.to(dtype or self.scales.dtype))

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of the tied embedding: ``(...)`` ids -> ``(..., in)``, dequantizing only those rows.

        Output channel ``t`` of the lm_head is token ``t``'s embedding, and it has its own scale.
        """
        return self.w_int8[tokens].to(self.scales.dtype) * self.scales[tokens][..., None]

    def extra_repr(self) -> str:
        N, K = self.w_int8.shape
        return f"in_features={K}, out_features={N}, w_int8=({N}, {K}) int8, scales=({N},) {self.scales.dtype}"


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q`` ``(out, in)`` uint8 in ``[0, 15]`` packed for torch's CPU int4 kernel, two a byte.

    Newer torch (2.13 here) has CPU forms of the ops (``*_for_cpu``) that take the codes one
    per int32; torch 2.5, kvlib's floor, has only the shared ops, which on a CPU take them
    already paired (high nibble first) and tiled 2 x 16 inputs at a time (``innerKTiles=2``).
    """
    aten = torch.ops.aten
    if hasattr(aten, "_convert_weight_to_int4pack_for_cpu"):
        return aten._convert_weight_to_int4pack_for_cpu(q.int().cpu(), 1)  # (out, in / 2) uint8
    q = q.cpu()
    return aten._convert_weight_to_int4pack(q[:, ::2] << 4 | q[:, 1::2], 2)  # (out / 8, in / 32, 32, 1) int32


def _int4_mm(x2: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """``x2 @ ŵ`` by torch's CPU int4 kernel: ``(M, in)`` rows, weights packed by `_pack_int4`."""
    aten = torch.ops.aten
    mm = getattr(aten, "_weight_int4pack_mm_for_cpu", None) or aten._weight_int4pack_mm  # torch 2.5: the shared op
    return mm(x2, packed, group_size, sz)  # (M, out)


class Int4Linear(nn.Module):
    """A `Linear` stored in 4 bits: torch's CPU int4 kernel layout, two codes a byte.

    The packed layout is the kernel's own (it changes with the CPU's instruction set),
    so the codes cannot be read back cheaply: every multiply goes through the kernel,
    on the CPU only. It is fast for a few bf16 rows (a decode step) and slow for
    fp32 activations or long prompts on the CPUs we measured.
    """

    def __init__(self, weight: torch.Tensor, group_size: int = 64) -> None:
        super().__init__()
        q, scales_and_zeros = quantize_int4(weight, group_size)  # checks the in_features
        K, N = weight.shape
        if N % 16:
            raise ValueError(f"out_features={N} of weight {tuple(weight.shape)} is not a multiple of 16 (int4 packing)")
        packed = _pack_int4(q)  # N * K / 2 bytes, in the kernel's own layout
        self.register_buffer("packed", packed.to(weight.device))
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (in / group_size, out, 2)
        self.in_features, self.out_features, self.group_size = K, N, group_size

    @classmethod
    def from_linear(cls, linear: Linear, group_size: int = 64) -> "Int4Linear":
        return cls(linear.weight.detach(), group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(f"Int4Linear runs on the CPU only (torch's CPU int4 kernel), got x on {x.device}")
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, in)
        sz = self.scales_and_zeros.to(x.dtype)
        y = _int4_mm(x2, self.packed, self.group_size, sz)  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def quantize_weights(
    model: Transformer, mode: str = "int8", *, group_size: int = 64, include_lm_head: bool = True
) -> Transformer:
    """Replace, in place, every `Linear` in the decoder blocks (and the lm_head) by a quantized one.

    ``mode`` is ``"int8"`` (per output channel) or ``"int4"`` (``group_size`` inputs
    per scale; int8 ignores it). Norms and an untied embedding table stay in float: a
    step reads only a few embedding rows. With tied embeddings the lm_head matrix is also the embedding
    table, which must hand out single rows (`Int8Linear.embedding_rows`), so in int4
    mode a tied lm_head is stored in int8. All layers are quantized before any is
    swapped, so a shape the int4 kernel cannot pack leaves the model untouched. A
    prepacked bf16 model's matrices (`kvlib.prepack`, the default of
    ``load_smollm2(dtype=torch.bfloat16)`` on a CPU with AMX) are unpacked and quantized.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"quantize_weights needs a kvlib Transformer, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def convert(linear: Linear | PackedLinear, int4: bool) -> nn.Module:
        if isinstance(linear, PackedLinear):
            linear = linear.unpacked()  # the plain (in, out) weight, reordered back exactly
        return Int4Linear.from_linear(linear, group_size) if int4 else Int8Linear.from_linear(linear)

    swaps = []  # (parent module, attribute name, new module)
    with torch.no_grad():
        for parent in model.layers.modules():
            for name, child in parent.named_children():
                if isinstance(child, (Linear, PackedLinear)):
                    swaps.append((parent, name, convert(child, mode == "int4")))
        if include_lm_head and isinstance(model.lm_head, (Linear, PackedLinear)):
            int4_head = mode == "int4" and not model.config.tie_embeddings
            swaps.append((model, "lm_head", convert(model.lm_head, int4_head)))
    for parent, name, module in swaps:
        setattr(parent, name, module)
    return model


def stored_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer as stored (int8 codes, scales, norms...), shared ones once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"stored_bytes needs an nn.Module, got {type(model).__name__}")
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        try:
            key = t.data_ptr()
        except RuntimeError:  # an opaque oneDNN tensor (`kvlib.prepack`): no storage to share
            key = ("opaque", id(t))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
