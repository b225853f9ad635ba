"""Batch-invariant inference: a sequence's logits, bit for bit, whatever runs beside it.

Floating-point addition is not associative, so a sum's last bits depend on the order of
its terms, and fast kernels choose the order from the *shape* of the call. A one-row
matrix product (a decode step) takes another path through the BLAS than a 64-row one (a
prefill, or a batch of 64 decode rows); SDPA splits its keys into blocks sized by the
sequence length; torch's vectorised ``exp`` and ``silu`` compute the last few elements
of a tensor with scalar code, so an element's bits can depend on where it falls. Each
is correct to rounding, and together they make cached and uncached logits, a sequence
alone and the same sequence in a batch, differ in their last bits (``kvlib.numerics``
measures by how much).

This module is the other choice, after Thinking Machines' "Defeating Nondeterminism in
LLM Inference" (2025) and vLLM's batch-invariant mode: every reduction is done in an
order fixed by the *data's own* coordinates, never by the batch or the step:

* `linear`: each row is multiplied by the same one-row BLAS call, on a fresh
  contiguous copy (same shape, same alignment: the same arithmetic);
* `rms_norm`: the mean of squares is a `fixed_sum` over ``d_model``;
* `attention`: dot products summed over ``head_dim`` in a fixed order; the softmax
  denominator and the weighted sum of values added key by key, left to right, so the
  masked keys of a longer step (exact zeros) change nothing; ``exp`` through
  `elementwise`;
* `elementwise`: a transcendental function applied in chunks whose size is a multiple
  of every SIMD width, so no element takes the scalar tail;
* RoPE: cos and sin computed once for every position (`kvlib.rope.rope_table`, kept by
  the model while the mode is on), then looked up: computed per step, a position's
  ``cos`` would sit at another place in another-sized tensor, and could take the scalar tail.

Adds and multiplies of single elements are exact IEEE operations whatever the
vectorisation, so what is left is the same sequence of operations on the same numbers.
``model.set_batch_invariant(True)`` switches a `kvlib.Transformer` over: the model owns
the switch (it flags its layers, gives them `attention` and keeps RoPE's table), and this
module holds only the kernels. It costs speed (a prefill loses its matrix-matrix
products; ``python -m kvbench --invariant`` measures how much). It holds for one
machine, one torch build and one thread count, which is all batch invariance promises:
a different CPU may round differently, but always the same way for every batch.
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention import repeat_kv

_VEC = 64  # elements: a multiple of twice every SIMD width torch uses (AVX-512: 16 floats)
_CHUNK = 16384  # elements per elementwise call: below torch's grain size, so one thread does it all


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, with every element on the vectorised path.

    torch computes the last ``n mod 2·width`` elements of an elementwise call on a
    contiguous tensor (and of each thread's share) with scalar code, which may differ from
    the SIMD code in the last bit: on the machine this was written on, ``silu`` does and
    ``exp`` does not. Padding to a multiple of `_VEC` and calling on chunks of at most
    `_CHUNK` elements (one thread each) sends every element down the same path. (A view
    whose rows are a multiple of the SIMD width, like the MLP's gate, is safe anyway: torch
    loops over its rows, so every row has the same tail.)
    """
    flat = x.reshape(-1)  # (n,)
    n = flat.numel()
    pad = -n % _VEC
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.cat([fn(c) for c in flat.split(_CHUNK)]) if flat.numel() else flat
    return out[:n].view(x.shape)


def fixed_sum(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Sum over the last dimension in one fixed order: ``(..., n) -> (...)``.

    The terms are added left to right in blocks of ``block`` (every block at once), then
    the block sums left to right: only elementwise adds, so the order does not depend on
    the other dimensions, the thread count or the vector width. For a dimension of fixed
    length and alignment (``d_model``, ``head_dim``), not for keys, whose offsets vary.
    """
    n = x.shape[-1]
    x = torch.nn.functional.pad(x, (0, -n % block)).unflatten(-1, (-1, block))  # (..., n_blocks, block)
    acc = x[..., 0]
    for j in range(1, block):
        acc = acc + x[..., j]  # (..., n_blocks)
    total = acc[..., 0]
    for i in range(1, acc.shape[-1]):
        total = total + acc[..., i]
    return total


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` with each row computed by the same one-row product: ``(..., K) -> (..., N)``.

    A BLAS picks its blocking (and so its order of additions) from the number of rows;
    one row at a time, every row gets the one-row kernel, on a fresh contiguous copy so
    that its alignment is the same too. This is what makes a prefill cost as many
    matrix-vector products as it has tokens.
    """
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    out = torch.cat([r.clone()[None] @ weight for r in rows]) if len(rows) else rows.new_zeros(0, weight.shape[1])
    return out.view(*x.shape[:-1], weight.shape[1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the mean of squares as a `fixed_sum` (in fp32 for half-precision ``x``)."""
    xf = x.float()
    mean_sq = fixed_sum(xf * xf) / xf.shape[-1]  # (...)
    return weight * (xf / torch.sqrt(mean_sq + eps)[..., None]).to(x.dtype)  # sqrt and / round exactly


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √D) v, every sum in an order set by the key's index alone.

    q: ``(B, H, Tq, D)``; k, v: ``(B, H_kv, S, D)``; mask: bool ``(B or 1, 1, Tq, S)``, True =
    may attend (the model always passes one to a kernel of this kind). A query's masked keys
    give exactly zero weight, and zeros added to a running sum leave it unchanged, so a
    query gets the same bits with 5 keys or with 500 of which 495 are masked (a longer
    prefill, padding, another sequence in a packed row). Slow: a Python loop over keys.
    """
    B, H, Tq, D = q.shape
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])  # (B, H, S, D), copies
    S = k.shape[2]
    scores = q[..., 0, None] * k[:, :, None, :, 0]  # (B, H, Tq, S): the d = 0 term
    for d in range(1, D):  # q·k over head_dim, left to right
        scores = scores + q[..., d, None] * k[:, :, None, :, d]
    scores = (scores * D**-0.5).masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # a max is exact in any order
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a query that sees nothing
    e = elementwise(torch.exp, scores - top)  # (B, H, Tq, S); masked keys: exactly 0
    denom = torch.zeros_like(e[..., 0])  # (B, H, Tq)
    out = torch.zeros_like(q)  # (B, H, Tq, D)
    for s in range(S):  # key by key, left to right
        denom = denom + e[..., s]
        out = out + e[..., s, None] * v[:, :, None, s]
    return out / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
