"""The paged kernel's loop: one decode token's attention, read block by block where the blocks lie.

`kvlib.paged.gather` copies a sequence out of the pool before attention runs; vLLM's
PagedAttention kernel never makes that copy. It walks the block table and folds each
block's scores into a running softmax (`kvlib.kernels.online_softmax_step`, the
FlashAttention recurrence), so no copy of the whole sequence is ever made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import online_softmax_step
from ..validate import an_int

__all__ = ["paged_attention_loop"]


def paged_attention_loop(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: Sequence[int],
    length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode token's attention, read block by block where the blocks lie: the loop of
    vLLM's PagedAttention kernel, in readable torch. Equals attention over `gather`'s copy.

    ``q`` ``(H, D)``: the new token's query heads; pools ``(num_blocks, block_size, H_kv, D)``;
    ``block_table``: the sequence's blocks; ``length``: its keys (the new token's included).
    Each block's scores update a running max ``m``, softmax denominator ``l`` and weighted
    sum ``acc`` (online softmax), so no copy of the whole sequence is ever made.
    """
    if q.dim() != 2 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape or q.shape[1] != k_pool.shape[3]:
        raise ValueError(f"need q (H, D) and two equal pools (num_blocks, block_size, H_kv, D), "
                         f"got {tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    H, D = q.shape
    _, bs, H_kv, _ = k_pool.shape
    if H % H_kv:
        raise ValueError(f"{H} query heads cannot share {H_kv} KV heads evenly")
    if not 0 < an_int("length", length) <= len(block_table) * bs:
        raise ValueError(f"length {length!r} does not fit a table of {len(block_table)} blocks of {bs}")
    G = H // H_kv  # query heads per KV head
    qg = q.float().view(H_kv, G, D) * (D**-0.5 if scale is None else scale)  # (H_kv, G, D)
    m = torch.full((H_kv, G, 1), float("-inf"), device=q.device)  # running max of the scores
    l = torch.zeros(H_kv, G, 1, device=q.device)  # running sum of exp(score - m)  # noqa: E741
    acc = torch.zeros(H_kv, G, D, device=q.device)  # running sum of exp(score - m) * v
    for i in range(-(-length // bs)):
        n = min(bs, length - i * bs)  # tokens held in this block (the last may be partial)
        k = k_pool[block_table[i], :n].float()  # (n, H_kv, D): read in place, one block
        v = v_pool[block_table[i], :n].float()
        s = torch.einsum("hgd,nhd->hgn", qg, k)  # (H_kv, G, n) scores against this block
        m, l, p, alpha = online_softmax_step(m, l, s)  # noqa: E741
        acc = alpha * acc + torch.einsum("hgn,nhd->hgd", p, v)
    return (acc / l).reshape(H, D).to(q.dtype)
