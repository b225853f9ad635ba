"""How fast attention kernels reorganise the same arithmetic, in readable torch.

Attention is ``softmax(q kᵀ * scale) v``, and the softmax seems to need a whole row of
scores before it can start. Two facts remove that need:

* **Partial results merge exactly.** Attention over a slice of the keys can return its
  normalised output ``out_i`` and the log-sum-exp ``lse_i`` of its scores. Then the
  attention over all the slices is ``sum_i exp(lse_i - lse) * out_i`` with
  ``lse = logsumexp_i(lse_i)`` (`partial_attention`, `merge_partials`).
* **So the keys can be visited in order or in parallel.** FlashAttention walks the key
  blocks one after another, keeping a running max, sum and output
  (`online_softmax_attention`). FlashDecoding cuts the keys into splits, computes them
  all at once and merges them (`split_kv_attention`, and `split_kv` for a model).

Every function here equals ordinary softmax attention up to rounding; on a CPU none of
them is faster. They show *what* the GPU kernels compute, not how fast.

Layout: q ``(B, H, Tq, D)``, k and v ``(B, H_kv, Tk, D)`` with ``H % H_kv == 0``.
Masks are bool, True = may attend, broadcastable to ``(B, H, Tq, Tk)``; ``None`` means
bottom-right causal (`kvlib.attention.causal_mask`). Half-precision inputs are
accumulated in float32 and returned in their own dtype.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .validate import an_int
from .attention import _check_qkv, causal_mask, softmax_lse

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- checks
def _check_count(name: str, value: object) -> int:
    if an_int(name, value) < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _prepare(q, k, v, mask, scale):
    """Validate; return ``(B, H, Tq, D, H_kv, G, mask5, scale, acc_dtype)``.

    ``mask5`` is the mask in the grouped layout ``(B|1, H_kv|1, G|1, Tq, Tk)``, so that
    query head ``h = kv * G + g`` reads entry ``[.., kv, g]`` without copying KV heads.
    """
    B, H, Tq, D, H_kv = _check_qkv(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    Tk, G = k.shape[2], H // H_kv
    if mask is None:
        mask = causal_mask(Tq, Tk, device=q.device)  # (Tq, Tk), bottom-right aligned
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got {getattr(mask, 'dtype', type(mask))}")
    want = (B, H, Tq, Tk)
    if not 2 <= mask.dim() <= 4 or any(m not in (1, w) for m, w in zip(mask.shape[::-1], want[::-1])):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Tq, Tk) = {want}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, Tq|1, Tk|1)
    mask = mask.expand(mask.shape[0], mask.shape[1], Tq, Tk)  # (B|1, H|1, Tq, Tk)
    if mask.shape[1] == H:  # a mask per query head: split H into (H_kv, G) as the queries are
        mask5 = mask.reshape(mask.shape[0], H_kv, G, Tq, Tk)  # (B|1, H_kv, G, Tq, Tk)
    else:
        mask5 = mask[:, :, None]  # (B|1, 1, 1, Tq, Tk)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 for fp16/bf16/fp32 inputs
    return B, H, Tq, D, H_kv, G, mask5.to(q.device), scale, acc


def _softmax_lse(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim and its log-sum-exp. A row with no key: p = 0, lse = -inf."""
    return softmax_lse(scores.masked_fill(~mask, NEG_INF))


def online_softmax_step(
    m: torch.Tensor, l: torch.Tensor, s: torch.Tensor  # noqa: E741
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of scores into a running softmax: the heart of FlashAttention.

    ``m`` and ``l`` ``(..., 1)`` are the running max and ``sum exp(score - m)`` of the
    blocks seen so far; ``s`` ``(..., n)`` is this block's scores (masked ones ``-inf``).
    Returns ``(m_new, l_new, p, alpha)``: ``p = exp(s - m_new)`` weighs this block's
    values, and ``alpha = exp(m - m_new)`` rescales what was summed against the old max,
    so the caller updates its output as ``acc = alpha * acc + p @ v``. A row that has
    seen no key yet keeps ``m = 0`` internally, so ``exp`` never sees ``-inf - -inf``.
    """
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    m_new = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # no key yet: 0
    alpha = torch.exp(m - m_new)  # rescale the old sum and output to the new max
    p = torch.exp(s - m_new)  # (..., n): this block's unnormalised weights
    return m_new, alpha * l + p.sum(dim=-1, keepdim=True), p, alpha


# ----------------------------------------------------------------------------- the pieces
def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys given (often a slice of the sequence), plus its log-sum-exp.

    Returns ``out`` ``(B, H, Tq, D)``, normalised over these keys only, in q's dtype, and
    ``lse = log(sum_j exp(s_j))`` over the scaled, masked scores ``s_j`` of these keys,
    ``(B, H, Tq)`` in float32. A query that sees no key here gets ``out = 0`` and
    ``lse = -inf``: its weight in `merge_partials` is ``exp(-inf) = 0``.
    ``mask=None`` is causal *relative to these keys*; for a slice of a longer sequence,
    pass the matching slice of the full mask, ``mask[..., start:end]``.
    """
    B, H, Tq, D, H_kv, G, mask5, scale, acc = _prepare(q, k, v, mask, scale)
    qg = q.reshape(B, H_kv, G, Tq, D).to(acc)  # (B, H_kv, G, Tq, D): query heads grouped by KV head
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k.to(acc)) * scale  # (B, H_kv, G, Tq, Tk)
    p, lse = _softmax_lse(scores, mask5)
    out = torch.einsum("bkgts,bksd->bkgtd", p, v.to(acc))  # (B, H_kv, G, Tq, D)
    return out.reshape(B, H, Tq, D).to(q.dtype), lse.reshape(B, H, Tq)


def merge_partials(
    outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> torch.Tensor:
    """Combine `partial_attention` results over disjoint key slices into the full attention.

    ``outs``: a list/tuple of ``(..., D)`` tensors, or one tensor with the slices stacked
    on dim 0, ``(n, ..., D)``; ``lses``: the same with ``(...)``. The result is
    ``sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i(lse_i)``: each slice is
    weighted by its share of the total softmax mass. A slice with ``lse = -inf`` gets weight
    0 (whatever its ``out``); if every slice is ``-inf`` the result is 0. Returns outs' dtype.
    """
    if isinstance(outs, (list, tuple)) and isinstance(lses, (list, tuple)):
        if len(outs) != len(lses) or not outs:
            raise ValueError(f"need as many outs as lses (at least one), got {len(outs)} and {len(lses)}")
        if len({tuple(o.shape) for o in outs}) > 1 or len({tuple(x.shape) for x in lses}) > 1:
            raise ValueError(f"every slice needs the same shape, got outs {[tuple(o.shape) for o in outs]}")
        outs, lses = torch.stack(list(outs)), torch.stack(list(lses))  # (n, ..., D), (n, ...)
    if not isinstance(outs, torch.Tensor) or not isinstance(lses, torch.Tensor):
        raise TypeError(
            f"outs and lses must both be tensors or both lists/tuples, got {type(outs).__name__}, {type(lses).__name__}"
        )
    if outs.dim() < 2 or outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs (n, ..., D) and lses (n, ...) disagree: {tuple(outs.shape)} and {tuple(lses.shape)}")
    acc = torch.promote_types(outs.dtype, torch.float32)
    lses = lses.to(acc)
    m = lses.amax(dim=0)  # (...): the largest slice lse
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all slices empty: weights stay 0
    lse = m + torch.log(torch.exp(lses - m).sum(dim=0))  # (...): logsumexp over the slices
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(lses - lse)[..., None]  # (n, ..., 1): each slice's share; 0 where lse_i = -inf
    out = torch.where(w > 0, w * outs.to(acc), torch.zeros((), dtype=acc, device=outs.device)).sum(dim=0)
    return out.to(outs.dtype)  # (..., D)


# ----------------------------------------------------------------------------- FlashAttention
def online_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention computed one key block at a time: the FlashAttention recurrence.

    For each query row keep a running max ``m``, a running sum ``l = sum exp(s - m)`` and a
    running unnormalised output ``acc = sum exp(s - m) v``. When a block raises the max to
    ``m_new``, everything kept so far was measured against the old max, so it is rescaled by
    ``exp(m - m_new)`` before the block is added. After the last block, ``out = acc / l``.
    The full ``(Tq, Tk)`` score matrix never exists, only one ``(Tq, block_size)`` tile.
    Shapes as in `partial_attention`; returns ``(B, H, Tq, D)`` in q's dtype.
    """
    block_size = _check_count("block_size", block_size)
    B, H, Tq, D, H_kv, G, mask5, scale, acc_t = _prepare(q, k, v, mask, scale)
    qg = q.reshape(B, H_kv, G, Tq, D).to(acc_t)  # (B, H_kv, G, Tq, D)
    m = torch.full((B, H_kv, G, Tq, 1), NEG_INF, dtype=acc_t, device=q.device)  # running max
    l = torch.zeros((B, H_kv, G, Tq, 1), dtype=acc_t, device=q.device)  # running sum  # noqa: E741
    acc = torch.zeros((B, H_kv, G, Tq, D), dtype=acc_t, device=q.device)  # running exp(s - m) @ v
    for start in range(0, k.shape[2], block_size):
        kb = k[:, :, start:start + block_size].to(acc_t)  # (B, H_kv, bs, D)
        vb = v[:, :, start:start + block_size].to(acc_t)  # (B, H_kv, bs, D)
        s = torch.einsum("bkgtd,bksd->bkgts", qg, kb) * scale  # (B, H_kv, G, Tq, bs)
        s = s.masked_fill(~mask5[..., start:start + block_size], NEG_INF)
        m, l, p, alpha = online_softmax_step(m, l, s)  # noqa: E741
        acc = alpha * acc + torch.einsum("bkgts,bksd->bkgtd", p, vb)
    out = acc / torch.where(l > 0, l, torch.ones_like(l))  # a query that saw nothing: 0
    return out.reshape(B, H, Tq, D).to(q.dtype)


# ----------------------------------------------------------------------------- FlashDecoding
def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    n_splits: int = 4,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention with the keys cut into splits, all computed at once, then merged (FlashDecoding).

    Each split has ``S = ceil(Tk / n_splits)`` keys (the last may be shorter; at most ``Tk``
    splits, and ``ceil(Tk / S)`` splits are used, so ``Tk=9, n_splits=4`` gives 3 of 3).
    The keys are padded to a whole number of splits and viewed as ``(B, H_kv, n, S, D)``;
    one einsum gives every split's partial output and lse, the padding masked out, and
    `merge_partials` combines them. GQA query heads are grouped, KV heads never copied.
    Shapes as in `partial_attention`; returns ``(B, H, Tq, D)`` in q's dtype.
    """
    n_splits = _check_count("n_splits", n_splits)
    B, H, Tq, D, H_kv, G, mask5, scale, acc = _prepare(q, k, v, mask, scale)
    Tk = k.shape[2]
    if Tk == 0:
        raise ValueError("split_kv_attention needs at least one key, got Tk=0")
    S = math.ceil(Tk / min(n_splits, Tk))  # keys per split
    n = math.ceil(Tk / S)  # splits actually used (<= n_splits)
    pad = n * S - Tk  # padding keys at the end of the last split
    ks = F.pad(k.to(acc), (0, 0, 0, pad)).reshape(B, H_kv, n, S, D)  # (B, H_kv, n, S, D)
    vs = F.pad(v.to(acc), (0, 0, 0, pad)).reshape(B, H_kv, n, S, D)  # (B, H_kv, n, S, D)
    ms = F.pad(mask5, (0, pad), value=False)  # (B|1, H_kv|1, G|1, Tq, n*S): padding never attends
    ms = ms.reshape(*ms.shape[:4], n, S).permute(0, 1, 4, 2, 3, 5)  # (B|1, H_kv|1, n, G|1, Tq, S)
    qg = q.reshape(B, H_kv, G, Tq, D).to(acc)  # (B, H_kv, G, Tq, D)
    scores = torch.einsum("bkgtd,bknsd->bkngts", qg, ks) * scale  # (B, H_kv, n, G, Tq, S)
    p, lse = _softmax_lse(scores, ms)  # p (B, H_kv, n, G, Tq, S), lse (B, H_kv, n, G, Tq)
    outs = torch.einsum("bkngts,bknsd->bkngtd", p, vs)  # (B, H_kv, n, G, Tq, D): split outputs
    out = merge_partials(outs.movedim(2, 0), lse.movedim(2, 0))  # splits first: (B, H_kv, G, Tq, D)
    return out.reshape(B, H, Tq, D).to(q.dtype)


def split_kv(n_splits: int) -> Callable[..., torch.Tensor]:
    """An attention function ``fn(q, k, v, mask)`` for ``model.set_attention_impl(split_kv(4))``.

    It runs `split_kv_attention` with ``n_splits`` splits; its ``__name__`` is ``"split_kv(4)"``.
    """
    n_splits = _check_count("n_splits", n_splits)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return split_kv_attention(q, k, v, mask, n_splits=n_splits)

    fn.__name__ = fn.__qualname__ = f"split_kv({n_splits})"
    return fn
