"""Paged KV memory: fixed-size blocks, block tables, copy-on-write and prefix sharing.

A contiguous cache reserves ``max_len`` slots per sequence before it knows how
long the sequence will be. A paged cache (vLLM's PagedAttention) cuts memory
into *blocks* of ``block_size`` token slots and hands them out one at a time,
the way an operating system pages RAM:

* `BlockAllocator` owns block ids ``0 .. num_blocks-1``: a free list, a
  reference count per block, and an index of full blocks by the hash of their
  tokens *and every token before them* (prefix caching).
* A sequence's *block table* maps its logical block ``i`` (tokens
  ``i*block_size`` to ``(i+1)*block_size - 1``) to a physical block. Token ``t``
  lives in *slot* ``table[t // block_size] * block_size + t % block_size``.
* `PagedCache` holds one key pool and one value pool per layer, each
  ``(num_blocks, block_size, kv_heads, head_dim)``, and the block tables.
  `PagedCache.step` returns a `PagedBatch`: the `Cache` a model forward runs
  against. It writes new keys and values into their slots and reads each
  sequence's keys back through its block table (`gather`).
* `Engine` runs several sequences of different lengths through a model in one
  batch over a `PagedCache`.

Nothing here is global: block tables, slots and positions are passed explicitly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .attention import grouped_attention
from .cache import Cache
from .config import ModelConfig
from .generate import _check_sampling, sample
from .model import Transformer


class OutOfBlocks(RuntimeError):
    """The pool has no free block left: the caller must wait, preempt a sequence, or free one."""


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens and the key of the block before it.

    Chaining makes the key depend on *every* earlier token, because a block's keys and
    values do: the same 16 tokens after a different prefix hold different K/V.
    """
    return hash((parent_hash, tokens))


@dataclass(frozen=True)
class _Sealed:
    """What the prefix index knows about one full, immutable block."""

    hash: int
    parent: tuple[int, int] | None  # (block id, generation) of the block before it; None for a first block
    tokens: tuple[int, ...]


# -- the allocator --------------------------------------------------------------------------------
class BlockAllocator:
    """A fixed pool of block ids with a free list, reference counts and a prefix index.

    ``allocate`` hands out a block with reference count 1; ``share`` adds an owner;
    ``free`` drops one, and a block whose count reaches 0 returns to the free list.
    A full block can be *sealed* (``seal``): it becomes immutable and findable by
    ``lookup(parent, tokens)``. A sealed block that is freed keeps its contents
    until the free list hands it out again (that is its *eviction*), so a later
    request with the same prefix can revive it.

    The free list is ordered: blocks that hold nothing useful are reused first,
    then sealed blocks, least recently freed first (LRU).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash,
    ) -> None:
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        if not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable (parent_hash, tokens) -> int, got {hash_fn!r}")
        self.hash_fn = hash_fn
        self.refcount = [0] * num_blocks
        # Bumped every time a block is handed out afresh, so a stale reference to an
        # evicted parent ("block 7 as it was then") can never match the new block 7.
        self.generation = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head is reused first
        self._sealed: dict[int, _Sealed] = {}  # block -> what it holds
        self._index: dict[int, list[int]] = {}  # hash -> sealed blocks with that hash (usually one)
        self.hits = self.misses = self.evictions = 0

    # -- counting ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out, including sealed blocks it may evict."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a sealed prefix (revivable until evicted)."""
        return sum(1 for b in self._free if b in self._sealed)

    def is_sealed(self, block: int) -> bool:
        self._check_id(block)
        return block in self._sealed

    # -- allocate / share / free ------------------------------------------------------------------
    def _check_id(self, block) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise TypeError(f"a block id is an int, got {type(block).__name__} {block!r}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is not in this pool of {self.num_blocks} blocks (ids 0..{self.num_blocks - 1})")

    def _check_used(self, block, action: str) -> None:
        self._check_id(block)
        if self.refcount[block] == 0:
            raise ValueError(f"cannot {action} block {block}: it is free (reference count 0)")

    def allocate(self) -> int:
        """A fresh block with reference count 1; evicts the least recently freed cached block if need be."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use (block_size={self.block_size})")
        block, _ = self._free.popitem(last=False)
        if block in self._sealed:
            self._unseal(block)
        self.generation[block] += 1
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more owner of ``block`` (a fork): it is freed only when every owner has freed it."""
        self._check_used(block, "share")
        self.refcount[block] += 1

    def free(self, block: int) -> None:
        """Drop one owner. Freeing a block that is already free raises ``ValueError`` (a double free)."""
        self._check_id(block)
        if self.refcount[block] == 0:
            raise ValueError(f"double free: block {block} is already free")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free[block] = None  # tail: most recently freed
            if block not in self._sealed:
                self._free.move_to_end(block, last=False)  # holds nothing worth keeping: reuse it first

    # -- prefix caching ---------------------------------------------------------------------------
    def _parent_key(self, parent: int | None) -> tuple[tuple[int, int] | None, int | None]:
        if parent is None:
            return None, None
        self._check_id(parent)
        if parent not in self._sealed:
            raise ValueError(f"parent block {parent} is not sealed: only a full block can precede another in the index")
        return (parent, self.generation[parent]), self._sealed[parent].hash

    def _check_tokens(self, tokens) -> tuple[int, ...]:
        tokens = tuple(tokens)
        if len(tokens) != self.block_size or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"a sealed block holds exactly block_size={self.block_size} int tokens, got {len(tokens)}")
        return tokens

    def seal(self, block: int, parent: int | None, tokens: Iterable[int]) -> int:
        """Mark the full ``block`` (holding ``tokens`` right after ``parent``) immutable and index it.

        Returns its hash. Blocks that share a hash (the same prefix computed twice,
        or a collision) are all indexed; ``lookup`` tells them apart.
        """
        self._check_used(block, "seal")
        if block in self._sealed:
            raise ValueError(f"block {block} is already sealed")
        tokens = self._check_tokens(tokens)
        parent_key, parent_hash = self._parent_key(parent)
        h = self.hash_fn(parent_hash, tokens)
        self._sealed[block] = _Sealed(h, parent_key, tokens)
        self._index.setdefault(h, []).append(block)
        return h

    def lookup(self, parent: int | None, tokens: Iterable[int]) -> int | None:
        """The cached block holding ``tokens`` right after ``parent``, or None (a miss).

        On a hit the caller becomes an owner (reference count + 1; a free block is
        revived). The hash only finds a candidate; its tokens and its parent are then
        compared, so a hash collision is a miss, never wrong K/V.
        """
        tokens = self._check_tokens(tokens)
        parent_key, parent_hash = self._parent_key(parent)
        same = [
            b for b in self._index.get(self.hash_fn(parent_hash, tokens), [])
            if self._sealed[b].tokens == tokens and self._sealed[b].parent == parent_key
        ]
        if not same:
            self.misses += 1
            return None
        self.hits += 1
        block = max(same, key=lambda b: self.refcount[b] > 0)  # prefer a copy in use to reviving a free one
        if self.refcount[block] == 0:
            del self._free[block]  # revive it: its contents were never overwritten
        self.refcount[block] += 1
        return block

    def _unseal(self, block: int) -> None:
        sealed = self._sealed.pop(block)
        self._index[sealed.hash].remove(block)
        if not self._index[sealed.hash]:
            del self._index[sealed.hash]
        self.evictions += 1

    # -- invariants -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (used by the tests)."""
        free = self._free  # an ordered dict: a block cannot be on it twice
        for b in range(self.num_blocks):
            if self.refcount[b] < 0:
                raise AssertionError(f"block {b} has negative reference count {self.refcount[b]}")
            if (self.refcount[b] == 0) != (b in free):
                raise AssertionError(f"block {b}: reference count {self.refcount[b]} but on free list: {b in free}")
        indexed = [b for blocks in self._index.values() for b in blocks]
        if sorted(indexed) != sorted(self._sealed):
            raise AssertionError("the index and the sealed blocks disagree")
        for h, blocks in self._index.items():
            for b in blocks:
                if self._sealed[b].hash != h:
                    raise AssertionError(f"index entry {h} points at block {b}, which does not hold it")


# -- reading a paged pool ---------------------------------------------------------------------------
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


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Attention for ``q`` ``(B, H, T, D)``, the last ``T`` tokens of each sequence, over paged K/V.

    Sequence ``b`` holds ``lengths[b]`` keys (its ``T`` new ones included), so its query
    ``t`` sees keys ``0 .. lengths[b] - T + t``: bottom-right causal, per sequence.
    """
    B, _, T, _ = q.shape
    if lengths.shape != (B,) or block_tables.shape[0] != B:
        raise ValueError(f"q has batch {B} but lengths is {tuple(lengths.shape)} and block_tables {tuple(block_tables.shape)}")
    if bool((lengths < T).any()):
        raise ValueError(f"every sequence must hold at least the T={T} new tokens, got lengths {lengths.tolist()}")
    S = int(lengths.max())
    k, v = gather(k_pool, block_tables, S), gather(v_pool, block_tables, S)  # (B, H_kv, S, D)
    last = (lengths - T)[:, None] + torch.arange(T, device=q.device)  # (B, T): position of each query
    mask = torch.arange(S, device=q.device) <= last[..., None]  # (B, T, S)
    return grouped_attention(q, k, v, mask[:, None])  # mask (B, 1, T, S)


# -- the paged cache ----------------------------------------------------------------------------------
@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)  # the block table
    tokens: list[int] = field(default_factory=list)  # ids whose K/V are stored, for sealing full blocks


class PagedCache:
    """Per-layer block pools shared by many sequences, each with its own block table.

    Lifecycle: ``sid, cached = cache.add(prompt)`` starts a sequence (reusing cached
    prompt blocks); ``b = cache.step([sid, ...], tokens)`` then
    ``model(tokens, b, positions=b.positions(), mask=b.mask())`` appends;
    ``cache.fork(sid)`` shares a sequence copy-on-write; ``cache.truncate(sid, n)`` rolls
    it back; ``cache.free(sid)`` ends it.
    """

    def __init__(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
        hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash,
    ) -> None:
        for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim)):
            _positive_int(name, val)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.allocator = BlockAllocator(num_blocks, block_size, hash_fn=hash_fn)
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        shape = (num_blocks, block_size, n_kv_head, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.copies = 0  # copy-on-write block copies so far
        self.version = 0  # bumped by every change to the tables; a PagedBatch made before it is stale

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int = 16, **kwargs) -> "PagedCache":
        """A cache shaped for ``config``: its layers, KV heads and head_dim."""
        return cls(config.n_layer, config.n_kv_head, config.head_dim, num_blocks=num_blocks, block_size=block_size, **kwargs)

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return 2 * self.n_layer * self.k[0][0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool, used or not."""
        return self.num_blocks * self.block_bytes

    # -- sequences ----------------------------------------------------------------------------------
    def _seq(self, sid) -> _Seq:
        if sid not in self.seqs:
            raise IndexError(f"no sequence {sid!r} in this cache (live: {sorted(self.seqs)})")
        return self.seqs[sid]

    def __len__(self) -> int:
        return len(self.seqs)

    def seq_len(self, sid: int) -> int:
        return len(self._seq(sid).tokens)

    def block_table(self, sid: int) -> list[int]:
        return list(self._seq(sid).blocks)

    def tokens(self, sid: int) -> list[int]:
        return list(self._seq(sid).tokens)

    def add(self, prompt: Sequence[int] = ()) -> tuple[int, int]:
        """Start a sequence. Returns ``(sid, cached)``: the first ``cached`` prompt tokens'
        K/V are already in the pool (prefix-cache hits), so run only ``prompt[cached:]``.

        At least the last prompt token is always left to run, even when every block
        hits: its logits are what the next token is sampled from.
        """
        prompt = [int(t) for t in prompt]
        seq, bs = _Seq(), self.block_size
        if self.prefix_caching:
            parent = None
            for i in range(len(prompt) // bs):
                block = self.allocator.lookup(parent, prompt[i * bs : (i + 1) * bs])
                if block is None:
                    break  # a chain: after the first miss nothing later can hit
                seq.blocks.append(block)
                parent = block
            cached = min(len(seq.blocks) * bs, max(len(prompt) - 1, 0))
            seq.tokens = prompt[:cached]  # a fully cached prompt ends inside its last (sealed) block: copy-on-write
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = seq
        self.version += 1
        return sid, len(seq.tokens)

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid``; the first write to a shared block copies it."""
        parent = self._seq(sid)
        held = parent.blocks[: -(-len(parent.tokens) // self.block_size)]  # not blocks reserved past the end
        for block in held:
            self.allocator.share(block)
        child = self._next_id
        self._next_id += 1
        self.seqs[child] = _Seq(list(held), list(parent.tokens))
        self.version += 1
        return child

    def free(self, sid: int) -> None:
        """End a sequence: drop its ownership of every block, last block first (evicted first)."""
        seq = self._seq(sid)
        for block in reversed(seq.blocks):
            self.allocator.free(block)
        del self.seqs[sid]
        self.version += 1

    def truncate(self, sid: int, n: int) -> None:
        """Keep the first ``n`` tokens of a sequence (roll back a draft, or re-time a step).

        Blocks past the new end are freed; a kept block that is shared or sealed is
        copied before it is written again, so no other sequence sees the rollback.
        """
        seq = self._seq(sid)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(seq.tokens):
            raise IndexError(f"cannot truncate sequence {sid} of {len(seq.tokens)} tokens to {n!r}")
        keep = -(-n // self.block_size)
        for block in reversed(seq.blocks[keep:]):
            self.allocator.free(block)
        del seq.blocks[keep:]
        del seq.tokens[n:]
        self.version += 1

    # -- making room --------------------------------------------------------------------------------
    def _writable_tail(self, seq: _Seq) -> bool:
        """Can the next token be written into the sequence's last block in place?"""
        i = len(seq.tokens) // self.block_size
        if i >= len(seq.blocks):
            return True  # the next token starts a block not allocated yet
        block = seq.blocks[i]  # partly filled, or reserved by a step that never finished
        return self.allocator.refcount[block] == 1 and not self.allocator.is_sealed(block)

    def blocks_needed(self, sids: Sequence[int], n_new: int) -> int:
        """Blocks ``step(sids, ...)`` with ``n_new`` tokens each would take from the free list."""
        need, tails = 0, {}
        for sid in sids:
            seq = self._seq(sid)
            want = -(-(len(seq.tokens) + n_new) // self.block_size)  # ceil
            need += max(want - len(seq.blocks), 0)
            i = len(seq.tokens) // self.block_size
            if i < len(seq.blocks):
                tails[seq.blocks[i]] = tails.get(seq.blocks[i], 0) + 1  # owners writing this block now
        for block, k in tails.items():
            if self.allocator.is_sealed(block) or self.allocator.refcount[block] > k:
                need += k  # every writer copies it
            else:
                need += k - 1  # all its owners write: the last one finds itself alone and writes in place
        return need

    def _copy_on_write(self, seq: _Seq) -> None:
        i = len(seq.tokens) // self.block_size
        old = seq.blocks[i]
        new = self.allocator.allocate()
        for pool in self.k + self.v:
            pool[new].copy_(pool[old])  # the whole block: its first tokens are this sequence's too
        self.allocator.free(old)
        seq.blocks[i] = new
        self.copies += 1

    def _reserve(self, seq: _Seq, n_new: int) -> None:
        if not self._writable_tail(seq):
            self._copy_on_write(seq)
        while len(seq.blocks) * self.block_size < len(seq.tokens) + n_new:
            seq.blocks.append(self.allocator.allocate())

    def step(self, sids: Sequence[int], tokens: torch.Tensor | Sequence[Sequence[int]]) -> "PagedBatch":
        """Make room for ``tokens`` ``(B, T)`` after sequences ``sids`` and return the `Cache`
        that one model forward writes through.

        The sequences may hold different numbers of tokens; pass the batch's
        ``positions()`` and ``mask()`` to the model. Raises `OutOfBlocks` before touching anything if the pool cannot hold the step.
        """
        sids = list(sids)
        if not sids:
            raise ValueError("step needs at least one sequence")
        if len(set(sids)) != len(sids):
            raise ValueError(f"a sequence appears twice in one step: {sids}")
        seqs = [self._seq(s) for s in sids]
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens)
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be int ids, got {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[0] != len(sids) or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be (batch={len(sids)}, T >= 1), got shape {tuple(tokens.shape)}")
        T = tokens.shape[1]
        lengths = [len(s.tokens) for s in seqs]
        need = self.blocks_needed(sids, T)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"this step needs {need} blocks but only {self.allocator.num_free} are free")
        for seq in seqs:
            self._reserve(seq, T)
        self.version += 1
        return PagedBatch(self, sids, tokens.tolist(), lengths)

    def _commit(self, sids: list[int], tokens: list[list[int]]) -> None:
        """After the last layer has written: extend the token lists and seal newly full blocks."""
        bs = self.block_size
        self.version += 1
        for sid, new in zip(sids, tokens):
            seq = self.seqs[sid]
            before = len(seq.tokens)
            seq.tokens.extend(new)
            if not self.prefix_caching:
                continue
            for i in range(before // bs, len(seq.tokens) // bs):
                block = seq.blocks[i]
                if not self.allocator.is_sealed(block):
                    parent = seq.blocks[i - 1] if i > 0 else None
                    self.allocator.seal(block, parent, seq.tokens[i * bs : (i + 1) * bs])

    # -- reading back ---------------------------------------------------------------------------------
    def layer_kv(self, sid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values in ``layer``, contiguous: each ``(1, kv_heads, len, head_dim)``."""
        seq = self._seq(sid)
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} is out of range for {self.n_layer} layers")
        if not seq.tokens:
            raise ValueError(f"sequence {sid} is empty")
        table = torch.tensor([seq.blocks], device=self.k[0].device)  # (1, n)
        n = len(seq.tokens)
        return gather(self.k[layer], table, n), gather(self.v[layer], table, n)

    def check(self) -> None:
        """Raise ``AssertionError`` unless every reference count equals the number of tables holding the block."""
        self.allocator.check()
        owners = [0] * self.num_blocks
        for sid, seq in self.seqs.items():
            if len(set(seq.blocks)) != len(seq.blocks):
                raise AssertionError(f"sequence {sid} holds a block twice: {seq.blocks}")
            if len(seq.blocks) * self.block_size < len(seq.tokens):
                raise AssertionError(f"sequence {sid} has {len(seq.tokens)} tokens but {len(seq.blocks)} blocks")
            for b in seq.blocks:
                owners[b] += 1
        for b, (n, rc) in enumerate(zip(owners, self.allocator.refcount)):
            if n != rc:
                raise AssertionError(f"block {b} is in {n} block tables but has reference count {rc}")

    def __repr__(self) -> str:
        a = self.allocator
        return (
            f"PagedCache(blocks={a.num_used}/{a.num_blocks} used, block_size={self.block_size}, "
            f"sequences={len(self.seqs)}, nbytes={self.nbytes})"
        )


class PagedBatch(Cache):
    """One forward pass's view of a `PagedCache`: the sequences ``sids`` and their new tokens.

    ``update(layer, k, v)`` writes the new ``(B, kv_heads, T, head_dim)`` keys and
    values into their slots, then gathers each sequence's keys back, right-padded to
    the longest: ``(B, kv_heads, S, head_dim)``. Pass ``positions()`` and ``mask()``
    to the model so each sequence sees only its own keys, causally.
    """

    def __init__(self, cache: PagedCache, sids: list[int], tokens: list[list[int]], lengths: list[int]) -> None:
        super().__init__(cache.n_layer)
        self.cache, self.sids, self.new_tokens = cache, sids, tokens
        B, T = len(sids), len(tokens[0])
        device = cache.k[0].device
        self.T = T
        self.lengths = torch.tensor(lengths, device=device)  # (B,): tokens held before this step
        bs = cache.block_size
        self.slots = torch.tensor(
            [slot_mapping(cache.seqs[s].blocks, n, n + T, bs) for s, n in zip(sids, lengths)], device=device
        ).view(-1)  # (B * T,): where each new token goes
        self.S = max(lengths) + T  # keys per row after this step (the longest sequence)
        n_blocks = -(-self.S // bs)
        tables = [cache.seqs[s].blocks[:n_blocks] for s in sids]
        pad = tables[0][0]  # any valid block: the keys it yields are masked out
        self.block_tables = torch.tensor([t + [pad] * (n_blocks - len(t)) for t in tables], device=device)  # (B, n)
        self._spec = (B, cache.n_kv_head, cache.head_dim, cache.k[0].dtype, device)
        self._done = [False] * cache.n_layer
        self._version = cache.version  # any later change to the tables makes this batch stale

    def positions(self) -> torch.Tensor:
        """``(B, T)`` RoPE positions of the new tokens: each sequence continues from its own length."""
        return self.lengths[:, None] + torch.arange(self.T, device=self.lengths.device)

    def mask(self) -> torch.Tensor:
        """``(B, 1, T, S)`` bool for the model's ``mask=``: query ``t`` of sequence ``b`` sees its
        own keys up to itself, ``0 .. lengths[b] + t``, and none of the right padding."""
        q_pos = self.positions()  # (B, T)
        return (torch.arange(self.S, device=q_pos.device) <= q_pos[..., None])[:, None]  # (B, 1, T, S)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(layer, k, v)
        if k.shape[2] != self.T:
            raise ValueError(f"this step reserved {self.T} tokens per sequence but update got {k.shape[2]}")
        if self._done[layer]:
            raise ValueError(f"layer {layer} was already written in this step")
        if self.cache.version != self._version:
            raise ValueError(
                "this PagedBatch is stale: the cache's block tables changed after it was made "
                "(a step, fork, truncate or free); call PagedCache.step again"
            )
        B, H, T, D = k.shape
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.view(-1, H, D)[self.slots] = k.transpose(1, 2).reshape(B * T, H, D)  # (slots, H, D): one row per slot
        v_pool.view(-1, H, D)[self.slots] = v.transpose(1, 2).reshape(B * T, H, D)
        self.bytes_written += k.nbytes + v.nbytes
        self._done[layer] = True
        if all(self._done):  # every layer holds this step's tokens now
            self.cache._commit(self.sids, self.new_tokens)
        return gather(k_pool, self.block_tables, self.S), gather(v_pool, self.block_tables, self.S)

    def get_seq_len(self, layer: int = 0) -> int:
        return self.S if self._done[layer] else self.S - self.T

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def reset(self) -> None:
        raise NotImplementedError("a PagedBatch lives for one forward pass; free sequences with PagedCache.free")

    def crop(self, n: int) -> None:
        raise NotImplementedError("a PagedBatch lives for one forward pass; free sequences with PagedCache.free")

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._done[layer]:
            return None
        return gather(self.cache.k[layer], self.block_tables, self.S), gather(self.cache.v[layer], self.block_tables, self.S)


# -- a small engine -------------------------------------------------------------------------------------
@dataclass
class Request:
    """A prompt to continue ``n`` times (parallel sampling shares the prompt's blocks)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    outputs: list[list[int]] = field(default_factory=list)  # one token list per sample
    done: list[bool] = field(default_factory=list)


@dataclass
class _Running:
    req: Request
    sample: int  # which of the request's n outputs
    sid: int
    pending: int  # the last sampled token: emitted, not yet fed to the model


class Engine:
    """Continuous batching over a `PagedCache`, in the shape of vLLM's scheduler.

    Each ``step()`` admits waiting requests while the pool has room (prefilling
    each on its own, then forking it ``n`` ways), then runs one decode step for
    every running sequence together, whatever their lengths. When a decode step
    needs more blocks than are free, the newest sequence is *preempted*: its
    blocks are freed and it is queued again with its tokens so far, to be
    recomputed later (prefix caching often makes that cheap).
    """

    def __init__(
        self,
        model: Transformer,
        cache: PagedCache,
        *,
        max_batch: int = 64,
        stop: Iterable[int] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"Engine needs a kvlib Transformer, got {type(model).__name__}")
        if not isinstance(cache, PagedCache):
            raise TypeError(f"Engine needs a PagedCache, got {type(cache).__name__}")
        c = model.config
        if (cache.n_layer, cache.n_kv_head, cache.head_dim) != (c.n_layer, c.n_kv_head, c.head_dim):
            raise ValueError(
                f"cache is shaped (layers, kv_heads, head_dim)={(cache.n_layer, cache.n_kv_head, cache.head_dim)} "
                f"but the model needs {(c.n_layer, c.n_kv_head, c.head_dim)}"
            )
        self.model, self.cache = model, cache
        self.max_batch = _positive_int("max_batch", max_batch)
        self.stop = {int(t) for t in stop}
        self.generator = generator
        self.waiting: list[tuple[Request, int, list[int]]] = []  # (request, sample or -1 for all, tokens to prefill)
        self.running: list[_Running] = []
        self.requests: dict[int, Request] = {}
        self.stats = {"steps": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0,
                      "preemptions": 0, "peak_blocks": 0, "peak_batch": 0}

    def add(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> int:
        """Queue a request; returns its id. ``run()`` or ``step()`` moves it along."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a request needs a non-empty prompt")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise IndexError(f"prompt token ids must lie in [0, {vocab}), got min {min(prompt)} max {max(prompt)}")
        _positive_int("max_new_tokens", max_new_tokens)
        _positive_int("n", n)
        if n > self.max_batch:
            raise ValueError(f"n={n} samples cannot run at once with max_batch={self.max_batch}")
        _check_sampling(temperature, top_k, top_p)
        total = len(prompt) + max_new_tokens
        if total > self.model.config.max_seq_len:
            raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceeds max_seq_len={self.model.config.max_seq_len}")
        stored = total - 1  # the last token is emitted, never fed back
        need = max(-(-stored // self.cache.block_size), self._blocks_to_admit(len(prompt), n))
        if need > self.cache.num_blocks:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens, {n} samples, need {need} blocks: "
                f"more than the pool's {self.cache.num_blocks} blocks of {self.cache.block_size}"
            )
        rid = len(self.requests)
        req = Request(rid, prompt, max_new_tokens, n, temperature, top_k, top_p, [[] for _ in range(n)], [False] * n)
        self.requests[rid] = req
        self.waiting.append((req, -1, prompt))
        return rid

    # -- one iteration ----------------------------------------------------------------------------------
    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        return int(sample(logits[None], req.temperature, req.top_k, req.top_p, self.generator)[0])

    def _emit(self, req: Request, i: int, token: int) -> bool:
        """Record a token; True if sample ``i`` has finished."""
        req.outputs[i].append(token)
        req.done[i] = token in self.stop or len(req.outputs[i]) >= req.max_new_tokens
        return req.done[i]

    def _blocks_to_admit(self, n_tokens: int, n_samples: int) -> int:
        """The prompt, one decode step's growth, and one copy of the last block per extra fork."""
        return -(-(n_tokens + 1) // self.cache.block_size) + n_samples - 1

    def _admit(self) -> None:
        while self.waiting:
            req, which, tokens = self.waiting[0]
            samples = list(range(req.n)) if which < 0 else [which]
            need = self._blocks_to_admit(len(tokens), len(samples))
            if need > self.cache.allocator.num_free or len(self.running) + len(samples) > self.max_batch:
                if not self.running and need > self.cache.allocator.num_free:
                    raise OutOfBlocks(f"a request of {len(tokens)} tokens needs {need} blocks; the pool has {self.cache.num_blocks}")
                return  # first come, first served: wait for room
            self.waiting.pop(0)
            try:
                self._prefill(req, samples, tokens)
            except BaseException:
                self.waiting.insert(0, (req, which, tokens))  # nothing was emitted: it can be retried
                raise

    @torch.inference_mode()
    def _prefill(self, req: Request, samples: list[int], tokens: list[int]) -> None:
        sid, cached = self.cache.add(tokens)
        try:
            todo = torch.tensor([tokens[cached:]], device=self.model.device)  # (1, T): what the cache lacks
            batch = self.cache.step([sid], todo)
            self._note_peak()
            logits = self.model(todo, batch, positions=batch.positions(), mask=batch.mask(), last_only=True)[0, -1]
        except BaseException:
            self.cache.free(sid)  # leave no half-made sequence behind
            raise
        self.stats["prefill_tokens"] += todo.shape[1]
        self.stats["cached_tokens"] += cached
        sids = [sid] + [self.cache.fork(sid) for _ in samples[1:]]  # parallel samples share the prompt's blocks
        for s, i in zip(sids, samples):
            token = self._sample(req, logits)
            if self._emit(req, i, token):
                self.cache.free(s)
            else:
                self.running.append(_Running(req, i, s, token))

    def _note_peak(self) -> None:
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.cache.allocator.num_used)

    def _preempt(self) -> None:
        victim = self.running.pop()  # the newest sequence
        self.cache.free(victim.sid)
        req, i = victim.req, victim.sample
        self.waiting.insert(0, (req, i, req.prompt + req.outputs[i]))  # recompute it later
        self.stats["preemptions"] += 1

    @torch.inference_mode()
    def _decode(self) -> None:
        while self.running and self.cache.blocks_needed([r.sid for r in self.running], 1) > self.cache.allocator.num_free:
            self._preempt()
        if not self.running:
            return
        sids = [r.sid for r in self.running]
        tokens = torch.tensor([[r.pending] for r in self.running], device=self.model.device)  # (B, 1)
        batch = self.cache.step(sids, tokens)
        self._note_peak()
        logits = self.model(tokens, batch, positions=batch.positions(), mask=batch.mask(), last_only=True)[:, -1]
        self.stats["decode_tokens"] += len(sids)
        self.stats["peak_batch"] = max(self.stats["peak_batch"], len(sids))
        still = []
        for r, row in zip(self.running, logits):
            r.pending = self._sample(r.req, row)
            if self._emit(r.req, r.sample, r.pending):
                self.cache.free(r.sid)
            else:
                still.append(r)
        self.running = still

    def step(self) -> None:
        """Admit what fits, then one decode step for every running sequence."""
        self._admit()
        self._note_peak()  # after admission: the forks' shared blocks
        self._decode()
        self.stats["steps"] += 1

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def run(self) -> dict[int, list[list[int]]]:
        """Step until every request is done; returns ``{request id: [tokens of each sample]}``."""
        while not self.finished:
            self.step()
        return {rid: [list(o) for o in req.outputs] for rid, req in self.requests.items()}
