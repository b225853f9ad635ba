"""Block memory for a paged KV cache: a pool of block ids, reference counts, and a prefix index.

A paged cache (vLLM's PagedAttention) cuts memory into *blocks* of
``block_size`` token slots and hands them out one at a time, the way an
operating system pages RAM. This module does the bookkeeping and never touches
a tensor: `BlockAllocator` owns block ids ``0 .. num_blocks-1``, a free list, a
reference count per block (forks share blocks), and an index of full blocks by
the hash of their tokens *and every token before them* (prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..validate import positive_int


class OutOfBlocks(RuntimeError):
    """The pool has no free block left: the caller must wait, preempt a sequence, or free one."""


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
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
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

    def free_order(self) -> list[int]:
        """The free list, in the order ``allocate`` hands blocks out."""
        return list(self._free)

    def reorder_free(self, order: Iterable[int]) -> None:
        """Hand the free blocks out in ``order`` (a permutation of the free list): tests and demos
        use it to scramble a pool, so that block tables are not simply 0, 1, 2, ..."""
        order = list(order)
        if sorted(order) != sorted(self._free):
            raise ValueError(f"order must be a permutation of the {len(self._free)} free blocks, got {order}")
        self._free = OrderedDict.fromkeys(order)

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

    def seal_full(self, table: list[int], tokens: list[int], since: int = 0) -> None:
        """Seal every block of ``table`` that became full once ``tokens[since:]`` were added."""
        bs = self.block_size
        for i in range(since // bs, len(tokens) // bs):
            if not self.is_sealed(table[i]):
                self.seal(table[i], table[i - 1] if i > 0 else None, tokens[i * bs : (i + 1) * bs])

    def lookup(self, parent: int | None, tokens: Iterable[int]) -> int | None:
        """The cached block holding ``tokens`` right after ``parent``, or None (a miss).

        On a hit the caller becomes an owner (reference count + 1; a free block is
        revived). The hash only finds a candidate; its tokens and its parent are then
        compared, so a hash collision is a miss, never wrong K/V.
        """
        tokens = self._check_tokens(tokens)
        parent_key, parent_hash = self._parent_key(parent)
        same = [
            b for b in self.with_hash(self.hash_fn(parent_hash, tokens))
            if self._sealed[b].tokens == tokens and self._sealed[b].parent == parent_key
        ]
        if not same:
            self.misses += 1
            return None
        self.hits += 1
        block = max(same, key=lambda b: self.refcount[b] > 0)  # prefer a copy in use to reviving a free one
        self.take(block)
        return block

    def with_hash(self, h: int) -> list[int]:
        """Every sealed block indexed under hash ``h``: candidates only, their tokens unchecked."""
        return list(self._index.get(h, []))

    def take(self, block: int) -> None:
        """Become an owner of the sealed ``block``, reviving it if it is free (what a lookup hit does)."""
        self._check_id(block)
        if block not in self._sealed:
            raise ValueError(f"block {block} is not sealed: only a cached block can be taken by its contents")
        if self.refcount[block] == 0:
            del self._free[block]  # revive it: its contents were never overwritten
        self.refcount[block] += 1

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


# -- the tables over the pool ---------------------------------------------------------------------
class BlockTableError(AssertionError):
    """A set of block tables and the allocator they draw from disagree (`check_block_tables`)."""


def _holders(n: int, entries: int) -> str:
    """``"1 table holds it"``, ``"2 tables hold it"``, or, when a table lists a block twice, entries."""
    if entries != n:
        return f"{entries} table entries hold it"
    return "no table holds it" if n == 0 else f"{n} table{'s' if n != 1 else ''} hold{'s' if n == 1 else ''} it"


def check_block_tables(allocator: BlockAllocator, tables: Mapping[str, Sequence[int]]) -> None:
    """Raise `BlockTableError` unless ``tables`` (every block table over ``allocator``'s pool,
    by sequence name) and the allocator's reference counts tell the same story:

    1. the allocator's own bookkeeping holds (`BlockAllocator.check`);
    2. every block a table holds is in use (reference count > 0): a free block can be handed
       to another sequence while this one still reads it;
    3. each block's reference count equals the number of table entries holding it: one more
       and the block never returns to the free list (a leak); one fewer and freeing one
       table frees it under another.

    Example

    >>> from kvlib.paged import BlockAllocator, check_block_tables
    >>> pool = BlockAllocator(num_blocks=8, block_size=4)
    >>> parent = [pool.allocate() for _ in range(3)]
    >>> pool.share(parent[0]); pool.share(parent[1])  # a fork: the full blocks are shared ...
    >>> child = parent[:2] + [pool.allocate()]  # ... and the partial last one copied
    >>> check_block_tables(pool, {"parent": parent, "child": child})  # consistent: returns None
    >>> check_block_tables(pool, {"parent": parent})
    Traceback (most recent call last):
    ...
    kvlib.paged.blocks.BlockTableError: block 0 has reference count 2 but 1 table holds it: ...
    """
    if not isinstance(allocator, BlockAllocator):
        raise TypeError(f"allocator must be a kvlib.paged.BlockAllocator, got {type(allocator).__name__}")
    if not isinstance(tables, Mapping):
        raise TypeError(f"tables must map a sequence's name to its block table, got {type(tables).__name__}")
    for name, table in tables.items():
        if not isinstance(name, str):
            raise TypeError(f"tables are named by str, got {type(name).__name__} {name!r}")
        if not isinstance(table, Sequence) or isinstance(table, (str, bytes)):
            raise TypeError(f"table {name!r} must be a list of block ids, got {type(table).__name__}")
    try:
        allocator.check()
    except AssertionError as e:
        raise BlockTableError(f"the allocator's own bookkeeping is inconsistent: {e}") from e
    entries: dict[int, int] = {}  # block -> table entries holding it
    holders: dict[int, set[str]] = {}  # block -> names of the tables holding it
    for name, table in tables.items():
        for block in table:
            if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < allocator.num_blocks:
                raise BlockTableError(f"table {name!r} holds {block!r}, which is not a block of this pool "
                                      f"(ids 0..{allocator.num_blocks - 1})")
            if allocator.refcount[block] == 0:
                raise BlockTableError(f"table {name!r} holds block {block}, which is free (its reference count is "
                                      f"0): it can be handed to another sequence while this one reads it")
            entries[block] = entries.get(block, 0) + 1
            holders.setdefault(block, set()).add(name)
    for block in range(allocator.num_blocks):
        count, held = allocator.refcount[block], entries.get(block, 0)
        if count == held:
            continue
        why = ("it will never return to the free list" if count > held else
               f"freeing one will free it under the other{'s' if held - count > 1 else ''}")
        raise BlockTableError(f"block {block} has reference count {count} but "
                              f"{_holders(len(holders.get(block, ())), held)}: {why}")
