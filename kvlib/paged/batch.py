"""One forward pass over a paged pool: slot mapping, `gather`, and the `PagedBatch` a model runs against.

A paged pool is ``(num_blocks, block_size, kv_heads, head_dim)`` per layer. A
sequence's tokens sit in the slots its block table names (`slot_mapping`), and
`gather` reads them back, through the table, into the contiguous
``(batch, kv_heads, seq, head_dim)`` layout that attention expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..cache import Cache, CacheSpec

if TYPE_CHECKING:
    from .cache import PagedCache


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slot ids for tokens ``start .. end-1`` of a sequence: ``block * block_size + offset``."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise IndexError(f"tokens {start}..{end} do not fit a table of {len(block_table)} blocks of {block_size}")
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]


def gather(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Read sequences out of a pool through their block tables: ``(B, kv_heads, length, head_dim)``.

    ``pool`` is ``(num_blocks, block_size, kv_heads, head_dim)``; ``block_tables`` is
    ``(B, n)`` long, padded with any valid block id past a sequence's end (mask those
    keys). This copies every key it reads; a fused kernel (vLLM's) reads blocks in place.
    """
    if pool.dim() != 4:
        raise ValueError(f"pool must be (num_blocks, block_size, kv_heads, head_dim), got {tuple(pool.shape)}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"block_tables must be a (batch, blocks) int tensor, got {block_tables.dtype} {tuple(block_tables.shape)}")
    B, n = block_tables.shape
    _, bs, H, D = pool.shape
    if not 0 < length <= n * bs:
        raise ValueError(f"length {length} does not fit {n} blocks of {bs} slots")
    blocks = pool[block_tables]  # (B, n, block_size, H, D): one copy of everything read
    return blocks.view(B, n * bs, H, D)[:, :length].transpose(1, 2)  # (B, H, length, D)


class PagedBatch(Cache):
    """One forward pass's view of a `PagedCache`: the sequences ``sids`` and their new tokens.

    ``update(k, v, layer)`` gathers each sequence's keys through its block table,
    right-padded to the longest, with this step's ``(B, kv_heads, T, head_dim)``
    keys placed after each sequence's own: ``(B, kv_heads, S, head_dim)``. Its
    ``positions()`` and ``mask()`` let each sequence see only its own keys, causally,
    so ``model(tokens, batch)`` needs nothing else. The pool is written only by
    ``commit()`` (the ``with`` block calls it), once every layer has run.
    """

    def __init__(self, cache: "PagedCache", sids: list[int], tokens: list[list[int]], lengths: list[int]) -> None:
        B, T = len(sids), len(tokens[0])
        device = cache.device
        super().__init__(cache.n_layer, CacheSpec(B, cache.n_kv_head, cache.head_dim, cache.dtype, device))
        self.cache, self.sids, self.new_tokens, self.start = cache, sids, tokens, lengths
        self.T = T
        self.lengths = torch.tensor(lengths, device=device)  # (B,): tokens held before this step
        self.S = max(lengths) + T  # keys per row after this step (the longest sequence)
        bs = cache.block_size
        n_blocks = -(-self.S // bs)
        tables = [cache.block_table(s)[:n_blocks] for s in sids]
        # Blocks this step has not reserved yet, and rows shorter than the longest, read block 0:
        # those slots are overwritten with the new tokens below, or masked out.
        self.block_tables = torch.tensor([t + [0] * (n_blocks - len(t)) for t in tables], device=device)  # (B, n)
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.n_layer
        self.committed = False
        self._version = cache.version  # any later change to the tables makes this batch stale

    # -- where the tokens sit and what they see ------------------------------------------------
    def _check_tokens(self, tokens: torch.Tensor | None) -> None:
        if tokens is not None and tuple(tokens.shape[:2]) != (len(self.sids), self.T):
            raise ValueError(f"this step holds {self.T} new tokens for {len(self.sids)} sequences, "
                             f"got tokens of shape {tuple(tokens.shape)}")

    def positions(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T)`` RoPE positions of the new tokens: each sequence continues from its own length."""
        self._check_tokens(tokens)
        return self.lengths[:, None] + torch.arange(self.T, device=self.lengths.device)

    def mask(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, 1, T, S)`` bool: query ``t`` of sequence ``b`` sees its own keys up to itself,
        ``0 .. lengths[b] + t``, and none of the right padding."""
        q_pos = self.positions(tokens)  # (B, T)
        return (torch.arange(self.S, device=q_pos.device) <= q_pos[..., None])[:, None]  # (B, 1, T, S)

    # -- the Cache protocol ----------------------------------------------------------------------
    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.staged[layer]
        rows = torch.arange(len(self.sids), device=k.device)[:, None]  # (B, 1)
        cols = self.positions()  # (B, T): where each new token sits in its row
        out = []
        for pool, new in ((self.cache.keys[layer], k), (self.cache.values[layer], v)):
            kv = gather(pool, self.block_tables, self.S)  # (B, H, S, D), a fresh copy
            kv[rows, :, cols] = new.transpose(1, 2)  # (B, T, H, D) into the copy, after each row's keys
            out.append(kv)
        return out[0], out[1]

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        if key_states.shape[2] != self.T:
            raise ValueError(f"this step reserved {self.T} tokens per sequence but update got {key_states.shape[2]}")
        if self.staged[layer_idx] is not None:
            raise ValueError(f"layer {layer_idx} was already written in this step")
        self._check_fresh()
        self.staged[layer_idx] = (key_states, value_states)
        self.count_written(key_states, value_states)  # what the commit will write into the pool
        return self._read(layer_idx)

    def _check_fresh(self) -> None:
        if self.committed:
            raise ValueError("this PagedBatch was already committed; call PagedCache.step for the next step")
        if self.cache.version != self._version:
            raise ValueError(
                "this PagedBatch is stale: the cache's block tables changed after it was made "
                "(a step, fork, truncate or free); call PagedCache.step again"
            )

    @property
    def complete(self) -> bool:
        """Has every layer been written?"""
        return all(s is not None for s in self.staged)

    def commit(self) -> None:
        """Store this step in the cache. Raises, changing nothing, unless every layer was
        written and this is the cache's open step, not committed yet and not stale."""
        self.cache._commit(self)

    def __enter__(self) -> "PagedBatch":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.cache._drop(self)  # a commit that failed (stale, say) must not block the cache
                raise
        else:
            self.cache._drop(self)  # the forward failed: nothing was written, nothing to undo
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.S if self.staged[layer_idx] is not None else self.S - self.T

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def reset(self) -> None:
        raise NotImplementedError("a PagedBatch lives for one forward pass; free sequences with PagedCache.free")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a PagedBatch lives for one forward pass; free sequences with PagedCache.free")

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.staged[layer_idx] is None else self._read(layer_idx)
