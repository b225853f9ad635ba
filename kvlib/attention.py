"""Reference attention, written to be read.

Layout everywhere in kvlib: ``(batch, heads, seq, head_dim)``.

Masks are boolean with ``True`` meaning "this query may look at this key".
When the queries are the *last* ``q_len`` positions of a ``k_len``-long
sequence (a prefill into a non-empty cache, or a decode step), the causal
mask is aligned to the bottom-right corner: query ``i`` sits at absolute
position ``k_len - q_len + i`` and may see every key up to that position.
"""

from __future__ import annotations

import math
from typing import Callable, Union

import torch
import torch.nn.functional as F

AttentionImpl = Union[str, Callable[..., torch.Tensor]]  # "sdpa", "reference", or fn(q, k, v, mask) -> y


def causal_mask(q_len: int, k_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``(q_len, k_len)`` bool mask, bottom-right aligned.

    With ``q_len == k_len`` this is the usual lower triangle; with ``q_len == 1``
    (a decode step) it is a single row of ``True``: the newest token sees all.
    """
    if q_len <= 0 or k_len <= 0:
        raise ValueError(f"causal_mask needs positive lengths, got q_len={q_len}, k_len={k_len}")
    if q_len > k_len:
        raise ValueError(f"q_len={q_len} queries cannot be the last tokens of only k_len={k_len} keys")
    offset = k_len - q_len  # absolute position of query 0
    q_pos = torch.arange(q_len, device=device)[:, None] + offset  # (q_len, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, k_len)
    return k_pos <= q_pos


def attention_mask(
    q_len: int,
    k_len: int,
    key_valid: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    pads_see_themselves: bool = False,
) -> torch.Tensor:
    """Causal mask combined with an optional padding mask.

    ``key_valid`` is ``(batch, k_len)`` bool, ``False`` where a key is padding.
    Returns ``(batch or 1, 1, q_len, k_len)``, ready to broadcast over heads.
    A left-pad query may see no key at all, and a softmax over nothing is NaN;
    ``pads_see_themselves=True`` lets such a query, and only such a query, see its
    own slot (the bottom-right diagonal). A query that sees any valid key is left
    alone, so nothing leaks into real tokens (this is what the model uses).
    """
    mask = causal_mask(q_len, k_len, device=device)[None, None]  # (1, 1, q, k)
    if key_valid is None:
        return mask
    if key_valid.dtype != torch.bool or key_valid.dim() != 2 or key_valid.shape[1] != k_len:
        raise ValueError(
            f"key_valid must be a (batch, k_len={k_len}) bool tensor, got {tuple(key_valid.shape)} {key_valid.dtype}"
        )
    mask = mask & key_valid[:, None, None, :].to(mask.device)  # (B, 1, q, k)
    if pads_see_themselves:
        q_pos = torch.arange(q_len, device=mask.device)[:, None] + (k_len - q_len)  # (q, 1)
        blind = ~mask.any(dim=-1, keepdim=True)  # (B, 1, q, 1): queries that would see no key
        mask = mask | (blind & (torch.arange(k_len, device=mask.device)[None, :] == q_pos))
    return mask


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``(B, H_kv, T, D)`` to ``(B, H_kv * n_rep, T, D)`` for GQA/MQA.

    Query head ``h`` uses KV head ``h // n_rep``: the groups are contiguous,
    as in Llama and Hugging Face.
    """
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1, got {n_rep}")
    if n_rep == 1:
        return x
    B, H_kv, T, D = x.shape
    x = x[:, :, None, :, :].expand(B, H_kv, n_rep, T, D)  # (B, H_kv, n_rep, T, D)
    return x.reshape(B, H_kv * n_rep, T, D)


def softmax_lse(scores: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerically stable softmax over ``dim`` and the log-sum-exp of the scores.

    Subtract the row maximum before ``exp``, so no ``exp`` overflows. A row that is
    entirely ``-inf`` (a query allowed to see nothing) gives zeros instead of NaN, and
    an lse of ``-inf``. `kvlib.kernels` merges partial attentions with the lse.
    """
    m = scores.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: keep exp() at 0
    e = torch.exp(scores - m)
    s = e.sum(dim=dim, keepdim=True)  # 0 for an empty row, >= 1 otherwise
    p = e / torch.where(s > 0, s, torch.ones_like(s))
    return p, (m + torch.log(s)).squeeze(dim)  # log(0) = -inf: an empty row's lse


def softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax (`softmax_lse` without the lse); an all ``-inf`` row gives zeros."""
    return softmax_lse(scores, dim)[0]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate ``q (B, H, Tq, D)``, ``k = v (B, H_kv, Tk, D)``; return ``B, H, Tq, D, H_kv``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, Tq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    H_kv = k.shape[1]
    if H % H_kv != 0:
        raise ValueError(f"{H} query heads cannot be split evenly over {H_kv} KV heads (H must be divisible by H_kv)")
    return B, H, Tq, D, H_kv


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ / √d) v, with GQA handled by repeating KV heads.

    q: ``(B, H, Tq, D)``; k, v: ``(B, H_kv, Tk, D)`` with ``H % H_kv == 0``;
    mask: bool, broadcastable to ``(B, H, Tq, Tk)``, ``True`` = may attend.
    Returns ``(B, H, Tq, D)``.
    """
    B, H, Tq, D, H_kv = _check_qkv(q, k, v)
    k, v = repeat_kv(k, H // H_kv), repeat_kv(v, H // H_kv)  # (B, H, Tk, D)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ v  # (B, H, Tq, D)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The same result as `attention`, without copying KV heads.

    The ``H`` query heads are viewed as ``H_kv`` groups of ``G = H / H_kv``; each
    group multiplies its one KV head directly. `repeat_kv` materialises ``G``
    copies of the cache; this reads it once, which is the point of GQA/MQA.
    Shapes as in `attention`; ``mask`` is ``(Tq, Tk)`` or ``(B or 1, 1, Tq, Tk)``.
    """
    B, H, Tq, D, H_kv = _check_qkv(q, k, v)
    G = H // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.reshape(B, H_kv, G, Tq, D)  # (B, H_kv, G, Tq, D): query heads grouped by their KV head
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k) * scale  # (B, H_kv, G, Tq, Tk)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (Tq, Tk) -> (1, 1, Tq, Tk)
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"grouped_attention takes a mask shared by all heads, (B or 1, 1, Tq, Tk); got {tuple(mask.shape)}")
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # (B|1, 1, 1, Tq, Tk)
    out = torch.einsum("bkgts,bksd->bkgtd", softmax(scores, dim=-1), v)  # (B, H_kv, G, Tq, D)
    return out.reshape(B, H, Tq, D)


# Measured on this book's build machine (torch 2.13, 30 layers, `python -m kvbench` section
# (h)): for fp32 the grouped decode read streamed the cache faster than SDPA's one task per
# query head, 1.1x at 1,024 keys to 1.5x at 8,192 in the stored 2-thread run; for bf16 the two
# were within 10% when tried by hand at 8,192 keys, so bf16 keeps SDPA's own GQA path.
GROUPED_DECODE_DTYPES = (torch.float32,)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention that reads each KV head once for all its query heads.

    q: ``(B, H, 1, D)``, one new token per sequence; k, v: ``(B, H_kv, S, D)``; mask:
    None (the new token sees every key) or bool ``(B or 1, 1, 1, S)``, False on padding.
    Returns ``(B, H, 1, D)``, what ``F.scaled_dot_product_attention(q, k, v,
    enable_gqa=True)`` returns, up to rounding.

    PyTorch's fused CPU kernel runs one task per (sequence, query head), so with GQA each
    KV head is streamed once for *every* query head that shares it: three times for
    SmolLM2's 9 query heads on 3 KV heads. But at decode time the ``G = H / H_kv`` query
    heads of a group are just ``G`` query rows against the same keys, so they can be
    handed to the same fused kernel as ``G`` *queries* of one head: ``(B, H_kv, G, D)``,
    one task per KV head, each KV head read once. A decode query has no causal limit
    (it is the newest token), so only a padding mask is needed, and it is the same for
    every query row. FlashAttention-3 and FlashInfer pack GQA decoding this way; the
    FlashAttention-2 kernel runs one program per query head, and the flash-attn library
    that ships it makes the same swap for one query per head (``seqlenq_ngroups_swapped``).
    """
    B, H, Tq, D, H_kv = _check_qkv(q, k, v)
    if Tq != 1:
        raise ValueError(f"decode_attention takes one query per sequence (a decode step), got q_len={Tq}")
    if not _padding_mask(mask, B, k.shape[2]):
        raise ValueError(f"mask must be bool ({B} or 1, 1, 1, {k.shape[2]}), got {mask.dtype} {tuple(mask.shape)}")
    G = H // H_kv
    rows = q.reshape(B, H_kv, G, D)  # (B, H_kv, G, D): head h = kv * G + g becomes query row g of kv
    y = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)  # (B, H_kv, G, D)
    return y.reshape(B, H, 1, D)


def _padding_mask(mask: torch.Tensor | None, B: int, S: int) -> bool:
    """Whether ``mask`` is what `decode_attention` takes: None, or bool ``(B or 1, 1, 1, S)``."""
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, B)
                            and tuple(mask.shape[1:]) == (1, 1, S))


def _groupable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `decode_attention` computes exactly what SDPA would for these inputs: one
    query, GQA, fp32 on the CPU, k and v of one shape with q's batch, and no mask or a
    bool padding mask ``(B or 1, 1, 1, S)``. Anything else (a broadcast batch, a float
    mask) stays on SDPA, which takes it as it always did."""
    if q.dim() != 4 or k.dim() != 4:
        return False
    B, H, Tq, _ = q.shape
    return (Tq == 1 and H != k.shape[1] and q.device.type == "cpu" and q.dtype in GROUPED_DECODE_DTYPES
            and k.shape == v.shape and k.shape[0] == B and H % k.shape[1] == 0
            and _padding_mask(mask, B, k.shape[2]))


def attend_default(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`attend` with SDPA as a model runs by default: where ``mask`` is the plain bottom-right
    causal one ``(1, 1, T, S)`` (`causal_mask`), the kernel gets no mask and takes SDPA's own
    causal path, bit for bit the model's default kernel; any other mask is passed on.

    On the CPU the mask is read and compared. On an accelerator that read would wait for the
    device, so a mask of that shape is attended both ways and the device keeps the right one
    (`_causal_or_masked`): twice the attention, no wait, and a padding mask is never taken for
    the causal one.
    """
    T, S = q.shape[2], k.shape[2]
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, T, S):
        return attend(q, k, v, mask, "sdpa")
    if mask.device.type != "cpu":
        return _causal_or_masked(q, k, v, mask)
    return attend(q, k, v, None if torch.equal(mask[0, 0], causal_mask(T, S)) else mask, "sdpa")


def _causal_or_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attend_default` without reading ``mask``: both results, the choice made on the device."""
    causal = (mask[0, 0] == causal_mask(q.shape[2], k.shape[2], device=mask.device)).all()  # () bool
    return torch.where(causal, attend(q, k, v, None, "sdpa"), attend(q, k, v, mask, "sdpa"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           impl: AttentionImpl = "sdpa") -> torch.Tensor:
    """One layer's attention for a step: the mask decision, then the kernel ``impl``.

    ``mask=None`` means bottom-right causal with nothing padded. SDPA then needs no
    mask at all when it is a decode step (``Tq == 1``: the new token sees every key)
    or a fresh prefill (``Tq == Tk``: its own ``is_causal``); a chunk appended to a
    non-empty cache gets an explicit bottom-right mask, because SDPA's ``is_causal``
    aligns top-left. A CPU decode step with GQA in fp32 goes to `decode_attention`, which
    reads each KV head once, where it computes what SDPA would (`_groupable`); inputs SDPA
    broadcasts, or a float mask, stay on SDPA. Any other kernel always gets an explicit bool mask. The decision
    is made here, per layer and per step, so layers with different kernels each get
    what theirs needs.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if impl == "sdpa" and _groupable(q, k, v, mask):
        return decode_attention(q, k, v, mask)  # each KV head read once, not once per query head
    if impl == "sdpa" and mask is None and (Tq == 1 or Tq == Tk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=Tq > 1, enable_gqa=gqa)
    if mask is None:
        mask = causal_mask(Tq, Tk, device=q.device)[None, None]  # (1, 1, Tq, Tk)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if impl == "reference":
        return attention(q, k, v, mask)
    return impl(q, k, v, mask)  # (B, H, Tq, D), a learner's kernel
