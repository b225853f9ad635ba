"""Varlen attention for a packed paged step: each sequence attends to its own keys, and no others.

A packed step (`kvlib.paged.PackedPagedBatch`) lays every sequence's new tokens end to
end in one row. Run through SDPA, the row needs a block-diagonal mask
(`kvlib.packed.packed_mask`), and SDPA still computes every score between two
sequences before the mask hides it: with 16 prompts of 16 to 160 tokens (1,402 in
all) that is 1,402² = 1,965,604 scores where the sequences need only the sum of
their own squares, 154,186: about a thirteenth. A varlen kernel (FlashAttention's ``flash_attn_varlen_func``,
vLLM's attention backends) takes the boundaries instead and computes only the
diagonal blocks. `paged_varlen_attention` does that in two parts, the way vLLM's
backends split a step:

* **decode rows** (one new token each) run together, as one batched decode: each
  sequence's keys are read through its block table into a ``(B, kv_heads, S,
  head_dim)`` tensor padded to the longest, its new key is placed after its own, and a
  padding mask hides the rest (`kvlib.attention.attend` then reads each KV head once);
* **prefill chunks** (several new tokens) run one sequence at a time, bottom-right
  causal over that sequence's cached keys and its new ones; a chunk with nothing
  cached attends over its own new keys where they lie, with no copy at all.

`VarlenPlan` holds what the split needs, built once per step from host ints, so the
attention of every layer reads nothing back from the device.

What it still copies: eager PyTorch has no attention kernel that reads keys through a
block table, so the decode rows' cached keys (padded to the longest) and a chunk's cached
keys are gathered into a fresh tensor for each layer (``bytes_copied``, counted per step). vLLM's PagedAttention kernel reads
them in place; `kvlib.paged.kernel.paged_attention_loop` is that kernel's loop in
readable torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention import attend

__all__ = ["VarlenPlan", "paged_varlen_attention"]


@dataclass
class VarlenPlan:
    """One packed step, split for varlen attention: which rows decode, which prefill.

    ``decode_at`` ``(B_d,)``: the row positions of the decode tokens; ``decode_slots``
    ``(B_d * S,)``: for each decode sequence, the flat pool slots of its ``S`` keys (the
    longest one's, its new key included), padded with slot 0 past its own (masked out);
    ``decode_cols`` ``(B_d,)``: where each one's new key goes (the keys it held);
    ``decode_mask`` ``(B_d, 1, 1, S)``: True on each one's own keys. ``chunks``: per prefill
    segment, ``(row_start, count, cached_slots)``, ``cached_slots`` a ``(n,)`` tensor of its
    cached keys' flat slots (None when nothing is cached). ``bytes_copied_per_layer``: the
    bytes of K and V one layer copies out of the pool.
    """

    decode_at: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_cols: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_span: int
    chunks: list[tuple[int, int, torch.Tensor | None]]
    bytes_copied_per_layer: int

    @classmethod
    def build(cls, tables: Sequence[Sequence[int]], lengths: Sequence[int], counts: Sequence[int],
              block_size: int, bytes_per_token: int, device: torch.device) -> "VarlenPlan":
        """The plan of a step whose sequence ``i`` has block table ``tables[i]``, holds
        ``lengths[i]`` keys and brings ``counts[i]`` new tokens, in that order in the row.
        ``bytes_per_token``: one token's K plus V in one layer of the pool."""
        def as_long(xs: list) -> torch.Tensor:  # host ints to the device: a copy there, never a read back
            return torch.tensor(xs, dtype=torch.long, device=device)

        def slots(table: Sequence[int], n: int) -> list[int]:  # where its first n keys lie
            return [table[t // block_size] * block_size + t % block_size for t in range(n)]

        rows, decodes, chunks, copied, start = [], [], [], 0, 0
        for table, n, c in zip(tables, lengths, counts):
            if c == 1:
                rows.append(start)
                decodes.append(slots(table, n))
            else:
                chunks.append((start, c, as_long(slots(table, n)) if n else None))
                copied += n * bytes_per_token
            start += c
        if not rows:
            return cls(None, None, None, None, 0, chunks, copied)
        span = max(len(d) for d in decodes) + 1  # the longest decode sequence's keys, its new one included
        padded = [x for d in decodes for x in d + [0] * (span - len(d))]  # slot 0 past a sequence's keys: masked
        copied += len(rows) * span * bytes_per_token
        cols = as_long([len(d) for d in decodes])  # (B_d,): where each new key goes
        mask = (torch.arange(span, device=device) <= cols[:, None])[:, None, None]  # (B_d, 1, 1, S)
        return cls(as_long(rows), as_long(padded), cols, mask, span, chunks, copied)


def paged_varlen_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
    """Attention of one packed step, each sequence over its own keys only.

    ``q`` ``(1, H, N, D)``; ``k_new``, ``v_new`` ``(1, H_kv, N, D)``: the step's new keys,
    not yet in the pool; pools ``(num_blocks, block_size, H_kv, D)``. Returns ``(1, H, N, D)``,
    equal (up to rounding) to SDPA over the whole row under the block-diagonal mask.
    Keys are read with ``index_select`` over flat slots: on a CPU it copies several times
    faster than indexing the pool with a tensor (``pool[slots]``, ``aten::index``).
    """
    _, _, H_kv, D = k_pool.shape
    y = torch.empty_like(q)  # (1, H, N, D)
    if plan.decode_at is not None:
        B, S = len(plan.decode_at), plan.decode_span
        qd = q[0].index_select(1, plan.decode_at).transpose(0, 1)[:, :, None]  # (B_d, H, 1, D)
        rows = torch.arange(B, device=q.device)
        kv = []
        for pool, new in ((k_pool, k_new), (v_pool, v_new)):
            seq = pool.view(-1, H_kv, D).index_select(0, plan.decode_slots).view(B, S, H_kv, D)  # the copy
            seq[rows, plan.decode_cols] = new[0].index_select(1, plan.decode_at).transpose(0, 1)  # new keys
            kv.append(seq.transpose(1, 2))  # (B_d, H_kv, S, D)
        yd = attend(qd, kv[0], kv[1], plan.decode_mask, "sdpa")  # (B_d, H, 1, D)
        y[0].index_copy_(1, plan.decode_at, yd[:, :, 0].transpose(0, 1))
    for start, count, slots in plan.chunks:
        end = start + count
        qi = q[:, :, start:end]  # (1, H, c, D)
        ki, vi = k_new[:, :, start:end], v_new[:, :, start:end]  # (1, H_kv, c, D): where they lie
        if slots is not None:  # keys cached before this chunk come first
            ki = torch.cat([k_pool.view(-1, H_kv, D).index_select(0, slots).transpose(0, 1)[None], ki], dim=2)
            vi = torch.cat([v_pool.view(-1, H_kv, D).index_select(0, slots).transpose(0, 1)[None], vi], dim=2)
        y[:, :, start:end] = attend(qi, ki, vi, None, "sdpa")  # bottom-right causal over its own keys
    return y
