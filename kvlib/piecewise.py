"""A compiled step, piecewise: ``torch.compile`` of everything between two cache calls.

vLLM compiles its model with the attention left out of the graph: each layer's attention
is an opaque call (it reads the paged cache through block tables, with a plan that
changes every step), and the pieces between two attention calls (norm, projections, RoPE,
residual, MLP) are compiled once and reused by every layer and every step. kvlib's model
has the same seams: `Attention.forward` hands the cache ``q``, ``k`` and ``v`` through
one call, ``cache.update_and_attend``. `compile_blocks` cuts each `Block` there:

* ``before``: ``attn_norm``, the ``wqkv`` product, RoPE on q and k, the head split;
* the cache call, eager (any `Cache`: paged, packed, varlen, dynamic);
* ``after``: the ``wo`` product and its residual, ``mlp_norm``, SwiGLU and its residual.

The two pieces are plain functions of tensors, the weights passed in as arguments, so one
compiled graph serves all layers (compiling each block's module would guard on the module
and compile once per layer). ``dynamic=True`` makes the number of tokens a symbol, so a
packed step of any length reuses the graph; inductor still keeps a separate graph for one
token (a decode step), the usual 0/1 specialisation. The first steps pay the compilation
(`compile_seconds` of the bench measures it); inductor keeps what it generated on disk, so
a second process pays less.

What it can and cannot save. Compilation fuses the small operations between the matrix
products (the norms, RoPE, SiLU, the residual adds) into a few loops and skips their
Python dispatch; the matrix products still call the same BLAS kernel, and attention is not
compiled at all. So it helps where a step is dispatch-bound (one token, a small model) and
little where the matrix products dominate, as in a decode step at batch 16
(``python -m kvbench --compile`` measures both, section (l)).

A prepacked model (`kvlib.prepack`) compiles too, as vLLM's CPU backend compiles around its
oneDNN products: a `PackedLinear`'s weight is an opaque oneDNN tensor that the compiler cannot
trace, so its product enters the graph as one opaque call, the custom operator
``kvlib::packed_linear`` (registered here, with the output shape the compiler traces with); the
norms, RoPE, SiLU and residuals around it are compiled and fused as for a plain model. A quantized or batch-invariant model raises, naming what to undo. `decompile_blocks` restores the eager
blocks. Logits agree with the eager model's to float rounding (the fused loops may sum in
another order), so greedy tokens agree wherever the two best logits are not within rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from .attention import attend
from .model import Block, Linear, Transformer
from .prepack import PackedLinear
from .rope import apply_rope

__all__ = ["compile_blocks", "decompile_blocks", "is_compiled"]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`kvlib.model.RMSNorm`'s arithmetic: fused in fp32, else normalised in fp32 and scaled after."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@torch.library.custom_op("kvlib::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """oneDNN's product of ``(M, in)`` rows by a `PackedLinear`'s packed weight -> ``(M, out)``.

    A custom operator, opaque to the compiler (as vLLM registers its oneDNN matmul): the graph
    holds one call to it and does not break there, and the compiled loops around it are fused."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)  # the shape the compiler traces with


def _packed_product(h: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    y = packed_linear(h.reshape(-1, layer.in_features), layer.packed, layer.out_features)
    return y.view(*h.shape[:-1], layer.out_features)


Weight = torch.Tensor | PackedLinear  # a plain (in, out) matrix, or a prepacked layer


def _product(h: torch.Tensor, w: Weight) -> torch.Tensor:
    """``h @ w``: traced into the graph for a plain matrix, left out of it for a packed layer."""
    return h @ w if isinstance(w, torch.Tensor) else _packed_product(h, w)


def before_attention(x: torch.Tensor, norm_w: torch.Tensor, wqkv: Weight, cos: torch.Tensor,
                     sin: torch.Tensor, *, eps: float, heads: tuple[int, int, int]):
    """``x`` ``(B, T, d_model)`` -> ``q`` ``(B, H, T, D)``, ``k``, ``v`` ``(B, H_kv, T, D)``."""
    H, H_kv, D = heads
    B, T, _ = x.shape
    h = _rms_norm(x, norm_w, eps)
    qkv = _product(h, wqkv).view(B, T, H + 2 * H_kv, D)  # [q | k | v] heads
    qk = apply_rope(qkv[:, :, : H + H_kv], cos, sin)
    return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + H_kv :].transpose(1, 2)


def after_attention(x: torch.Tensor, y: torch.Tensor, wo: Weight, norm_w: torch.Tensor,
                    w_gate_up: Weight, w_down: Weight, *, eps: float) -> torch.Tensor:
    """``x`` ``(B, T, d_model)`` and attention's ``y`` ``(B, H, T, D)`` -> the block's output."""
    B, T, _ = x.shape
    x = x + _product(y.transpose(1, 2).reshape(B, T, -1), wo)
    h = _rms_norm(x, norm_w, eps)
    gate, up = _product(h, w_gate_up).chunk(2, dim=-1)
    return x + _product(F.silu(gate) * up, w_down)


def _weight(layer: Linear | PackedLinear) -> Weight:
    return layer.weight if type(layer) is Linear else layer


def _piecewise_forward(block: Block, before: Callable, after: Callable, x, cos, sin, cache, mask):
    a, m = block.attn, block.mlp
    q, k, v = before(x, block.attn_norm.weight, _weight(a.wqkv), cos, sin)
    if cache is None:
        y = attend(q, k, v, mask, a.impl)
    else:  # the seam: the cache and its attention stay eager
        y = cache.update_and_attend(q, k, v, a.layer, mask, a.impl)
    return after(x, y, _weight(a.wo), block.mlp_norm.weight, _weight(m.w_gate_up), _weight(m.w_down))


def _check(model: Transformer) -> None:
    if not isinstance(model, Transformer):
        raise TypeError(f"compile_blocks takes a kvlib Transformer, got {type(model).__name__}")
    if model.batch_invariant:
        raise ValueError("a batch-invariant model runs its own kernels: call model.set_batch_invariant(False) "
                         "before compile_blocks")
    for i, block in enumerate(model.layers):
        if not isinstance(block, Block):
            raise ValueError(f"layer {i} is a {type(block).__name__}, not a plain Block: compile_blocks "
                             "compiles SmolLM2-style blocks only")
        for name in ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down"):
            layer = block.get_submodule(name)
            if type(layer) not in (Linear, PackedLinear):
                raise ValueError(f"layers.{i}.{name} is a {type(layer).__name__}, not a plain or prepacked "
                                 "Linear: compile the model loaded unquantized")


def compile_blocks(model: Transformer, dynamic: bool = True) -> Transformer:
    """Compile ``model``'s blocks piecewise, in place, around their cache calls; returns ``model``.

    Nothing is compiled until the first forward. ``dynamic=True``: one graph for every number
    of tokens above one (see the module's docstring). Undo with `decompile_blocks`.
    """
    _check(model)
    cfg = model.config
    before = torch.compile(partial(before_attention, eps=cfg.norm_eps,
                                   heads=(cfg.n_head, cfg.n_kv_head, cfg.head_dim)), dynamic=dynamic)
    after = torch.compile(partial(after_attention, eps=cfg.norm_eps), dynamic=dynamic)
    for block in model.layers:  # an instance attribute: nn.Module.__call__ calls it, state_dict is unchanged
        block.forward = partial(_piecewise_forward, block, before, after)
    return model


def is_compiled(model: Transformer) -> bool:
    """Whether `compile_blocks` has cut ``model``'s blocks."""
    return any("forward" in vars(block) for block in model.layers)


def decompile_blocks(model: Transformer) -> Transformer:
    """The eager blocks back, in place; returns ``model``."""
    for block in model.layers:
        vars(block).pop("forward", None)
    return model
