"""One forward pass over a paged pool: slot mapping, `gather`, and the batches a model runs against.

A paged pool is ``(num_blocks, block_size, kv_heads, head_dim)`` per layer. A
sequence's tokens sit in the slots its block table names (`slot_mapping`), and
`gather` reads them back, through the table, into the contiguous
``(batch, kv_heads, seq, head_dim)`` layout that attention expects.

A step can be laid out two ways:

* `PagedBatch`, a rectangle: every sequence brings the same number ``T`` of new
  tokens, ``(B, T)``, and its keys are right-padded to the longest sequence.
* `PackedPagedBatch`, one packed row (`kvlib.packed`): sequences bring different
  numbers of new tokens (a decode token here, a prompt chunk there), laid end to
  end as ``(1, N)`` with no pad, the way vLLM's V1 engine flattens a step.

**Host round-trips.** None inside a step: block tables, slots, positions and masks are built from host ints
(`kvlib.paged.PagedCache` keeps its tables and prefix index on the host, as vLLM does) and
copied to the pool's device. The host learns a step's new tokens before the step, from its
caller: ``cache.step(sids, tokens)`` given a tensor reads it once (`kvlib.engine.Engine`
passes host ints it already has).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

import torch

from ..attention import attend
from ..cache import Cache, CacheSpec
from ..packed import cu_seqlens
from .blocks import BlockAllocator, OutOfBlocks
from .varlen import VarlenPlan, paged_varlen_attention


class StepPool(Protocol):
    """What a step needs of the pool it runs against: `kvlib.paged.PagedCache` is one.

    A step reads the pool (its shapes, ``keys``/``values``, block tables, ``version``) and
    may be stored in it once. Storing is package-internal: `PagedCache._commit` is called
    only by a step's ``commit``, after every check (so this module needs no import of the
    cache, and the cache reads only a step's public attributes).
    """

    n_layer: int
    n_kv_head: int
    head_dim: int
    block_size: int
    version: int  # bumped by every change to the tables
    keys: list[torch.Tensor]  # per layer, (num_blocks, block_size, kv_heads, head_dim)
    values: list[torch.Tensor]
    allocator: BlockAllocator

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def open_step(self) -> object | None: ...
    def block_table(self, sid: int) -> list[int]: ...
    def blocks_needed(self, sids: Sequence[int], n_new: int | Sequence[int]) -> int: ...
    def _commit(self, step: "_Step") -> int: ...  # store a checked step; returns the bytes copy-on-write copied
    def _close(self, step: "_Step") -> None: ...  # forget ``step`` if it is the open one


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
        raise ValueError(f"block_tables must be a (batch, blocks) int tensor, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    B, n = block_tables.shape
    _, bs, H, D = pool.shape
    if not 0 < length <= n * bs:
        raise ValueError(f"length {length} does not fit {n} blocks of {bs} slots")
    # one copy of everything read; index_select, several times faster on a CPU than pool[block_tables]
    blocks = pool.index_select(0, block_tables.reshape(-1).long())  # (B * n, block_size, H, D)
    return blocks.view(B, n * bs, H, D)[:, :length].transpose(1, 2)  # (B, H, length, D)


class _Step(Cache):
    """What both layouts share: the staged K/V of one forward, and the commit that stores them.

    A step's life: `PagedCache.step` opens it; ``update`` stages each layer's new keys and
    values (the pool is not touched); ``commit()`` stores it, once every layer has run, or
    a failed forward drops it. Use it as ``with cache.step(...) as batch:``, which commits
    when the block ends without an error and drops the step when it raises. Calling
    ``batch.commit()`` inside the block is allowed too: the step is stored then, once, and
    the end of the block stores nothing more (an error raised after that commit does not
    undo it). A subclass sets ``counts`` (new tokens per sequence) and lays out the keys.
    """

    @classmethod
    def for_model(cls, model_or_config: object, *args, **kwargs) -> "_Step":
        """Not for a step: `kvlib.paged.PagedCache.step` opens one on a pool built for the model."""
        raise TypeError(f"a {cls.__name__} is opened by PagedCache.step: "
                        f"kvlib.paged.PagedCache.for_model(model, num_blocks), then cache.step(...)")

    def __init__(self, cache: StepPool, sids: list[int], tokens: list[list[int]], lengths: list[int],
                 spec: CacheSpec) -> None:
        super().__init__(cache.n_layer, spec)
        self.cache, self.sids, self.new_tokens, self.start = cache, sids, tokens, lengths
        self.counts = [len(r) for r in tokens]  # new tokens per sequence
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.n_layer
        self.committed = False
        self._version = cache.version  # any later change to the tables makes this step stale

    def new_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's staged keys and values of ``layer``, ``(N, kv_heads, head_dim)`` each, with
        ``N = sum(counts)``: sequence by sequence, in the order `commit` writes their slots."""
        raise NotImplementedError

    def _stage(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        if self.staged[layer_idx] is not None:
            raise ValueError(f"layer {layer_idx} was already written in this step")
        self._check_fresh()
        self.staged[layer_idx] = (key_states, value_states)
        self.count_written(key_states, value_states)  # what the commit will write into the pool

    def _check_fresh(self) -> None:
        if self.committed:
            raise ValueError(f"this {type(self).__name__} was already committed; "
                             "call PagedCache.step for the next step")
        if self.cache.version != self._version:
            raise ValueError(
                f"this {type(self).__name__} is stale: the cache's block tables changed after it was made "
                "(a step, fork, truncate or free); call PagedCache.step again"
            )

    @property
    def complete(self) -> bool:
        """Has every layer been written?"""
        return all(s is not None for s in self.staged)

    def commit(self) -> None:
        """Store this step in the cache: reserve its slots (copy-on-write, new blocks), write
        each sequence's new K/V, extend its tokens and seal full blocks.

        Every check runs first, so a refused commit (a second one, a stale or incomplete
        step, one that is not the cache's open step) raises and changes nothing. A block
        copied on write is counted in `bytes_written`, as the new K/V were when staged.
        """
        self._check_fresh()  # not committed yet, and no table changed since it was made
        if self.cache.open_step is not self:
            raise ValueError(f"this {type(self).__name__} is not the open step of its cache; "
                             "call PagedCache.step again")
        missing = [i for i, s in enumerate(self.staged) if s is None]
        if missing:
            raise ValueError(f"cannot commit a step whose layers {missing} were never written")
        if self.cache.blocks_needed(self.sids, self.counts) > self.cache.allocator.num_free:
            raise OutOfBlocks("the pool no longer has room for this step")  # unreachable unless stale
        self.bytes_written += self.cache._commit(self)  # the block copies; the new K/V were counted when staged
        self.committed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.committed:
            return False  # committed inside the block: stored once, nothing left to do
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.cache._close(self)  # a commit that failed (stale, say) must not block the cache
                raise
        else:
            self.cache._close(self)  # the forward failed: nothing was written, nothing to undo
        return False

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def reset(self) -> None:
        raise NotImplementedError(f"a {type(self).__name__} lives for one forward pass; "
                                  "free sequences with PagedCache.free")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(f"a {type(self).__name__} lives for one forward pass; "
                                  "free sequences with PagedCache.free")


class PagedBatch(_Step):
    """One forward pass's view of a `PagedCache`: the sequences ``sids`` and ``T`` new tokens each.

    ``update(k, v, layer)`` gathers each sequence's keys through its block table,
    right-padded to the longest, with this step's ``(B, kv_heads, T, head_dim)``
    keys placed after each sequence's own: ``(B, kv_heads, S, head_dim)``. Its
    ``positions()`` and ``mask()`` let each sequence see only its own keys, causally,
    so ``model(tokens, batch)`` needs nothing else. The pool is written only by
    ``commit()`` (the ``with`` block calls it), once every layer has run.
    """

    def __init__(self, cache: StepPool, sids: list[int], tokens: list[list[int]], lengths: list[int]) -> None:
        B, T = len(sids), len(tokens[0])
        device = cache.device
        spec = CacheSpec(B, cache.n_kv_head, cache.head_dim, cache.dtype, device)  # keys (B, H_kv, T, D)
        super().__init__(cache, sids, tokens, lengths, spec)
        self.T = T
        self.lengths = torch.tensor(lengths, device=device)  # (B,): tokens held before this step
        self.S = max(lengths) + T  # keys per row after this step (the longest sequence)
        bs = cache.block_size
        n_blocks = -(-self.S // bs)
        tables = [cache.block_table(s)[:n_blocks] for s in sids]
        # Blocks this step has not reserved yet, and rows shorter than the longest, read block 0:
        # those slots are overwritten with the new tokens below, or masked out.
        self.block_tables = torch.tensor([t + [0] * (n_blocks - len(t)) for t in tables], device=device)  # (B, n)

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
        self._stage(key_states, value_states, layer_idx)
        return self._read(layer_idx)

    def new_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.staged[layer]
        B, H, T, D = k.shape
        return k.transpose(1, 2).reshape(B * T, H, D), v.transpose(1, 2).reshape(B * T, H, D)  # (B * T, H, D)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.S if self.staged[layer_idx] is not None else self.S - self.T

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.staged[layer_idx] is None else self._read(layer_idx)


class PackedPagedBatch(_Step):
    """One forward over a `PagedCache` as a single packed row: ragged steps, no pads anywhere.

    Sequence ``i`` holds ``start[i]`` tokens and brings ``counts[i]`` new ones (a decode
    token, or a chunk of its prompt). The model runs on their ids end to end, ``(1, N)``
    with ``N = sum(counts)``. ``update(k, v, layer)`` takes this step's ``(1, kv_heads, N,
    head_dim)`` keys and returns the row of every key the step attends to, ``(1, kv_heads,
    K, head_dim)`` with ``K = sum(start) + N``: sequence by sequence, its cached keys (one
    gather through a flat slot index) followed by its new ones. ``positions()`` ``(1, N)``
    continue each sequence from its own length, and ``block_mask()`` ``(1, 1, N, K)`` is
    block-diagonal and bottom-right causal (`kvlib.packed.packed_mask`'s picture, built
    from host ints so that the step reads nothing back from the device). ``cu_seqlens_q``
    and ``cu_seqlens_k`` are the boundaries a varlen kernel takes.

    ``varlen=True`` (the default) attends the way a varlen kernel does
    (`kvlib.paged.varlen`): the model's attention calls ``update_and_attend``, which runs
    the decode rows as one batched decode and each prompt chunk over its own sequence's
    keys, so no score between two sequences is ever computed, and ``mask()`` is None (the
    step needs no picture). ``varlen=False`` is the row through the model's kernel under
    the block-diagonal mask (``block_mask()``), which computes every score between two
    sequences and hides it. A kernel of your own (`Transformer.set_attention_impl`), or
    an explicit ``mask``, always gets the row and the mask. ``bytes_copied`` counts the
    bytes of cached K/V the step has copied out of the pool to attend over them.
    """

    def __init__(self, cache: StepPool, sids: list[int], tokens: list[list[int]], lengths: list[int],
                 varlen: bool = True) -> None:
        device = cache.device
        spec = CacheSpec(1, cache.n_kv_head, cache.head_dim, cache.dtype, device)  # keys (1, H_kv, N, D): one row
        super().__init__(cache, sids, tokens, lengths, spec)
        self.varlen = varlen
        self.bytes_copied = 0  # cached K/V copied out of the pool to attend over, all layers
        totals = [n + c for n, c in zip(lengths, self.counts)]  # keys of each sequence after this step
        self.N, self.K = sum(self.counts), sum(totals)
        self.longest = max(totals)  # the longest sequence, which the model's max_seq_len bounds (not the row)
        self.cu_seqlens_q = cu_seqlens(self.counts, device=device)  # (B + 1,)
        self.cu_seqlens_k = cu_seqlens(totals, device=device)  # (B + 1,)
        cu_k = list(accumulate(totals, initial=0))  # the same boundaries as host ints
        bs = cache.block_size
        cached_slots, cached_at, new_at, q_pos, q_seq, k_seq, k_pos = [], [], [], [], [], [], []
        for i, (sid, n, c) in enumerate(zip(sids, lengths, self.counts)):
            cached_slots += slot_mapping(cache.block_table(sid), 0, n, bs)  # its cached keys, in the pool
            cached_at += range(cu_k[i], cu_k[i] + n)  # ...and where they go in the row of keys
            new_at += range(cu_k[i] + n, cu_k[i + 1])  # its new keys come right after them
            q_pos += range(n, n + c)
            q_seq += [i] * c
            k_seq += [i] * (n + c)
            k_pos += range(n + c)
        def as_long(xs: list[int]) -> torch.Tensor:  # host ints to the device: a copy there, never a read back
            return torch.tensor(xs, dtype=torch.long, device=device)

        self.cached_slots, self.cached_at, self.new_at = as_long(cached_slots), as_long(cached_at), as_long(new_at)
        self._positions = as_long(q_pos)[None]  # (1, N)
        self._picture = (q_seq, k_seq, q_pos, k_pos)  # the block-diagonal mask, built when first asked for
        self._mask: torch.Tensor | None = None
        elt = torch.empty((), dtype=cache.dtype).element_size()
        self._kv_bytes = 2 * cache.n_kv_head * cache.head_dim * elt  # one token's K and V in one layer
        self.plan = (VarlenPlan.build([cache.block_table(s) for s in sids], lengths, self.counts, bs,
                                      self._kv_bytes, device) if varlen else None)

    # -- where the tokens sit and what they see ------------------------------------------------
    def _check_tokens(self, tokens: torch.Tensor | None) -> None:
        if tokens is not None and tuple(tokens.shape) != (1, self.N):
            raise ValueError(f"this packed step holds {self.N} new tokens ({self.counts} per sequence) as one row "
                             f"(1, {self.N}), got tokens of shape {tuple(tokens.shape)}")

    def positions(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``(1, N)`` RoPE positions: sequence ``i``'s new tokens sit at ``start[i], start[i] + 1, ...``."""
        self._check_tokens(tokens)
        return self._positions

    def mask(self, tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask the model passes on: `block_mask` with ``varlen=False``, None with ``varlen=True``
        (the step attends sequence by sequence itself, and needs no picture)."""
        self._check_tokens(tokens)
        return None if self.varlen else self.block_mask()

    def block_mask(self) -> torch.Tensor:
        """``(1, 1, N, K)`` bool: a query sees the keys of its own sequence up to itself, no other's."""
        if self._mask is None:
            q_seq, k_seq, q_pos, k_pos = (torch.tensor(x, device=self.cache.device) for x in self._picture)
            same = q_seq[:, None] == k_seq[None, :]  # (N, K): the same sequence
            self._mask = (same & (k_pos[None, :] <= q_pos[:, None]))[None, None]  # (1, 1, N, K)
        return self._mask

    # -- the Cache protocol ----------------------------------------------------------------------
    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.staged[layer]  # (1, H, N, D)
        out = []
        for pool, new in ((self.cache.keys[layer], k), (self.cache.values[layer], v)):
            _, _, H, D = pool.shape
            row = torch.empty(self.K, H, D, dtype=pool.dtype, device=pool.device)  # (K, H, D)
            if len(self.cached_slots):  # every cached key, one gather
                row.index_copy_(0, self.cached_at, pool.view(-1, H, D).index_select(0, self.cached_slots))
            row.index_copy_(0, self.new_at, new[0].transpose(0, 1))  # (N, H, D): each one's new keys after its own
            out.append(row.transpose(0, 1)[None])  # (1, H, K, D)
        return out[0], out[1]

    def _check_and_stage(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        self.validate_update(key_states, value_states, layer_idx)
        if key_states.shape[2] != self.N:
            raise ValueError(f"this packed step holds {self.N} new tokens ({self.counts} per sequence) but update "
                             f"got {key_states.shape[2]}")
        self._stage(key_states, value_states, layer_idx)

    def update(self, key_states, value_states, layer_idx):
        self._check_and_stage(key_states, value_states, layer_idx)
        self.bytes_copied += len(self.cached_slots) * self._kv_bytes  # every cached key, gathered into the row
        return self._read(layer_idx)

    def update_and_attend(self, q: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                          layer_idx: int, mask: torch.Tensor | None, impl: object = "sdpa") -> torch.Tensor:
        """Stage the layer's new keys, then attend: sequence by sequence (`paged_varlen_attention`)
        with ``varlen=True`` and the default kernel, else over the row under the mask."""
        if not (self.varlen and impl == "sdpa" and mask is None):
            k, v = self.update(key_states, value_states, layer_idx)  # (1, H_kv, K, D): the whole row
            return attend(q, k, v, self.block_mask() if mask is None else mask, impl)
        self._check_and_stage(key_states, value_states, layer_idx)
        self.bytes_copied += self.plan.bytes_copied_per_layer
        return paged_varlen_attention(q, key_states, value_states, self.cache.keys[layer_idx],
                                      self.cache.values[layer_idx], self.plan)  # (1, H, N, D)

    def new_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.staged[layer]
        return k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, H, D): already sequence by sequence

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.K if self.staged[layer_idx] is not None else self.K - self.N

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.staged[layer_idx] is None else self._read(layer_idx)
