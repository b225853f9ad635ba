"""Paging a hybrid cache: one block pool, a block table per group of layers (vLLM's hybrid manager).

A model that mixes layer kinds (`kvlib.layers`: Gemma 3's five window layers to one full
layer, say) keeps very different amounts per layer: a full layer every token, a window
layer the last W. vLLM pages such a model with **KV-cache groups**:

* the layers are grouped by kind, and every group has the same number of layers (the "1"
  of an n:1 pattern; a kind with a remainder gets a group padded with unused layers), so a
  block, ``block_size`` tokens of every layer in its group, is the same size in every group
  and all groups draw on **one pool**;
* each sequence has **one block table per group**; a shared layer (`kvlib.layers.shared`)
  reads another layer's cache and owns no blocks;
* after every step a group gives back the blocks no future query can see (vLLM's
  ``remove_skipped_blocks``): a window of W passes whole blocks, keeping its sinks' blocks,
  and a chunked layer drops its past chunks. The table keeps a hole (``None``) there.

Prefix caching works per group: a full block is sealed under the hash chain of its prefix.
A new prompt can reuse ``L`` cached tokens only if *every* group still holds what a
sequence of ``L`` tokens holds: the full group every block, a window group only the blocks
of the last W tokens (vLLM searches those from the right). `blocks_held` says which blocks
those are; the hit is the longest ``L`` every group can serve.

This module is bookkeeping only (no tensors), like `kvlib.paged.blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..layers import LayerKind, check_pattern
from ..validate import int_at_least, positive_int
from .blocks import OutOfBlocks, chain_hash

__all__ = ["HybridBlockPool", "KVGroup", "blocks_held", "kv_groups"]


# -- which blocks a layer kind keeps --------------------------------------------------------------
def blocks_held(kind: LayerKind, n: int, block_size: int) -> list[int]:
    """The logical blocks a sequence of ``n`` tokens keeps in a layer of ``kind``.

    A block is kept while the next query (position ``n``) can see one of its tokens, or while
    it is the partly filled last block that the next token goes into. A full layer keeps
    blocks ``0 .. ceil(n/b) - 1``; a window of W keeps those from the block of token
    ``n - W + 1`` on, plus the blocks of its sinks; a chunked layer those of the current chunk.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind must be a LayerKind, got {type(kind).__name__}")
    if kind.kind == "shared":
        raise ValueError("a shared layer keeps no blocks: it reads its source layer's")
    int_at_least("n", n, 0)
    b = positive_int("block_size", block_size)
    if kind.kind == "window":
        first = max(0, n - kind.size + 1)  # the oldest token the next query sees
    elif kind.kind == "chunked":
        first = n // kind.size * kind.size  # the start of the next query's chunk
    else:
        first = 0  # full, latent
    kept = range(first // b, -(-n // b))
    sinks = range(-(-min(kind.sinks, n) // b))  # the blocks of the first `sinks` tokens
    return sorted(set(sinks) | set(kept))


# -- KV-cache groups ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: all of one kind. ``layers`` are model layer
    indices; ``padding`` counts the empty layer slots each of its blocks carries."""

    kind: LayerKind
    layers: tuple[int, ...]
    padding: int = 0


def kv_groups(layers: Sequence[LayerKind]) -> tuple[KVGroup, ...]:
    """vLLM's grouping of a layer pattern: every group holds ``g`` layers of one kind, ``g`` the
    fewest layers any kind has; a kind with ``k`` layers gets ``ceil(k/g)`` groups, layers
    ``i, i + n, i + 2n, ...`` in the ``i``-th of ``n``, the last padded to ``g`` when ``g`` does
    not divide ``k``. Shared layers own no cache and join no group.
    """
    layers = check_pattern(layers, len(layers))
    by_kind: dict[LayerKind, list[int]] = {}
    for i, kind in enumerate(layers):
        if kind.kind != "shared":
            by_kind.setdefault(kind, []).append(i)
    if not by_kind:
        raise ValueError("the pattern has no layer with a cache of its own")
    if any(k.kind == "latent" for k in by_kind) and len(by_kind) > 1:
        raise ValueError("latent layers store a different number of bytes per token than the others: "
                         "one pool of equal blocks cannot hold both")
    g = min(len(idx) for idx in by_kind.values())
    groups = []
    for kind, idx in by_kind.items():
        n = -(-len(idx) // g)
        for i in range(n):
            part = tuple(idx[i::n])
            groups.append(KVGroup(kind, part, g - len(part)))
    return tuple(groups)


# -- the prefix a sealed block holds ---------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Prefix:
    """The tokens up to the end of one full block: its own tokens after its parent prefix.

    Hashed by the chain hash, compared token for token (so a hash collision is a miss, never
    someone else's K/V). A window group may have given the parent block back, so the parent
    is this record, not a block.
    """

    parent: _Prefix | None
    tokens: tuple[int, ...]
    hash: int
    depth: int  # blocks in the prefix

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        a, b = self, other
        if not isinstance(b, _Prefix) or a.depth != b.depth:
            return False
        while a is not b:  # two chains that meet are equal from there down
            if a.hash != b.hash or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True

    def all_tokens(self) -> tuple[int, ...]:
        parts, p = [], self
        while p is not None:
            parts.append(p.tokens)
            p = p.parent
        return tuple(t for part in reversed(parts) for t in part)


def _prefixes(tokens: Sequence[int], block_size: int, start: list[_Prefix]) -> list[_Prefix]:
    """``start`` extended with one `_Prefix` per full block of ``tokens`` after them."""
    out = list(start)
    for i in range(len(out), len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = out[-1] if out else None
        out.append(_Prefix(parent, block, chain_hash(parent.hash if parent else None, block), i + 1))
    return out


@dataclass
class _Seq:
    tokens: list[int]
    prefixes: list[_Prefix]  # one per full block of tokens
    tables: list[list[int | None]]  # per group; None: a block the group gave back (or never needed)


# -- the pool -----------------------------------------------------------------------------------
class HybridBlockPool:
    """One pool of blocks shared by the KV-cache groups of a hybrid model (accounting only).

    ``sid, cached = pool.add(prompt)`` starts a sequence, reusing ``cached`` prompt tokens;
    ``pool.append(sid, tokens)`` stores a step's tokens in every group (all its blocks at once,
    as one forward writes them) and then gives back what the window has passed;
    ``pool.fork(sid)`` shares a sequence copy-on-write; ``pool.free(sid)`` ends it.
    ``block_tables(sid)`` shows the result, one table per group.

    Freed blocks join a free list that is also the prefix cache: blocks that hold nothing
    are reused first, then sealed ones, least recently freed first (as `BlockAllocator`).
    """

    def __init__(self, layers: Sequence[LayerKind], num_blocks: int, block_size: int = 16, *,
                 prefix_caching: bool = True) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        self.layers = check_pattern(layers, len(layers))
        self.groups = kv_groups(self.layers)
        self.group_size = len(self.groups[0].layers) + self.groups[0].padding  # layers per block
        self.prefix_caching = prefix_caching
        self._refcount = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head goes first
        self._sealed: dict[int, tuple[int, _Prefix]] = {}  # block -> (group, the prefix it ends)
        self._index: dict[tuple[int, _Prefix], list[int]] = {}  # (group, prefix) -> sealed blocks
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # -- reading the state ------------------------------------------------------------------------
    num_free = property(lambda self: len(self._free), doc="Blocks on the free list (cached ones included).")
    num_used = property(lambda self: self.num_blocks - len(self._free), doc="Blocks some table holds.")
    layers_with_cache = property(lambda self: sum(len(g.layers) for g in self.groups), doc="Layers not shared.")

    def _seq(self, sid: int) -> _Seq:
        if sid not in self._seqs:
            raise IndexError(f"no sequence {sid!r} in this pool (live: {sorted(self._seqs)})")
        return self._seqs[sid]

    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    def num_tokens(self, sid: int) -> int:
        return len(self._seq(sid).tokens)

    def tokens(self, sid: int) -> list[int]:  # a copy: the pool's own list is never handed out
        return list(self._seq(sid).tokens)

    def block_tables(self, sid: int) -> list[list[int | None]]:
        """One table per group (in ``groups`` order): logical block -> pool block, None where given back."""
        return [list(t) for t in self._seq(sid).tables]

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def free_order(self) -> list[int]:
        """The free list, in the order blocks are handed out."""
        return list(self._free)

    def cached(self, block: int) -> tuple[int, tuple[int, ...]] | None:
        """``(group, prefix tokens)`` if ``block`` is sealed (findable by a prefix hit), else None."""
        self._check_id(block)
        if block not in self._sealed:
            return None
        g, prefix = self._sealed[block]
        return g, prefix.all_tokens()

    def used_by_group(self) -> list[int]:
        """Blocks in use, per group (a block belongs to one group's tables at a time)."""
        held = [set() for _ in self.groups]
        for seq in self._seqs.values():
            for g, table in enumerate(seq.tables):
                held[g].update(b for b in table if b is not None)
        return [len(h) for h in held]

    def layer_blocks(self) -> tuple[int, int]:
        """``(held, all_full)``: layer-blocks (``block_size`` tokens of one layer) the live sequences
        hold, padding layers included, and what the same sequences would hold with every layer
        full. Each sequence is counted alone on both sides (a shared block once per owner)."""
        held = sum(self.group_size * sum(b is not None for b in t) for s in self._seqs.values() for t in s.tables)
        full = sum(-(-len(s.tokens) // self.block_size) * self.layers_with_cache for s in self._seqs.values())
        return held, full

    def memory_saved(self) -> float:
        """The share of all-full memory the groups do not hold (0.0 with no tokens)."""
        held, full = self.layer_blocks()
        return 1.0 - held / full if full else 0.0

    # -- the free list ----------------------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise TypeError(f"a block id is an int, got {type(block).__name__} {block!r}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is not in this pool of {self.num_blocks} blocks")

    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)  # callers counted the free blocks first
        if block in self._sealed:  # evict the cached prefix it held
            g, prefix = self._sealed.pop(block)
            self._index[g, prefix].remove(block)
            if not self._index[g, prefix]:
                del self._index[g, prefix]
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free[block] = None  # tail: the most recently freed cached prefix is evicted last
            if block not in self._sealed:
                self._free.move_to_end(block, last=False)  # holds nothing: reuse it first

    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._free[block]  # revive a cached block
        self._refcount[block] += 1

    def _seal(self, g: int, block: int, prefix: _Prefix) -> None:
        if block not in self._sealed:
            self._sealed[block] = (g, prefix)
            self._index.setdefault((g, prefix), []).append(block)

    # -- prefix hits ------------------------------------------------------------------------------
    def _find(self, g: int, prefix: _Prefix) -> int | None:
        same = self._index.get((g, prefix), [])
        return max(same, key=lambda b: self._refcount[b] > 0) if same else None  # prefer one in use

    def longest_hit(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` every group can serve from the cache (no change made).

        ``L`` is servable when each group has a cached block for every block in
        ``blocks_held(kind, L)``; at least the last prompt token is left to run. A full group
        needs the whole prefix, a window group only its last blocks, so the answer is the
        longest ``L`` (a whole number of blocks, or one less than a prompt of whole blocks).
        """
        return self._hit(self._prompt(prompt))[0]

    def _prompt(self, prompt: Sequence[int]) -> list[int]:
        if bad := [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]:
            raise TypeError(f"tokens must be int ids, got {type(bad[0]).__name__} {bad[0]!r}")
        return list(prompt)

    def _hit(self, prompt: list[int]) -> tuple[int, list[_Prefix]]:
        if not self.prefix_caching or len(prompt) < 2:
            return 0, []
        bs, prefixes = self.block_size, _prefixes(prompt, self.block_size, [])
        have = [[self._find(g, p) is not None for p in prefixes] for g in range(len(self.groups))]
        for n_blocks in range(len(prefixes), 0, -1):  # the longest first
            L = min(n_blocks * bs, len(prompt) - 1)
            if all(all(have[g][i] for i in blocks_held(grp.kind, L, bs)) for g, grp in enumerate(self.groups)):
                return L, prefixes
        return 0, prefixes

    # -- sequences --------------------------------------------------------------------------------
    def add(self, prompt: Sequence[int] = ()) -> tuple[int, int]:
        """Start a sequence. Returns ``(sid, cached)``: run ``prompt[cached:]`` with `append`."""
        prompt = self._prompt(prompt)
        L, prefixes = self._hit(prompt)
        tables: list[list[int | None]] = []
        for g, grp in enumerate(self.groups):
            held = blocks_held(grp.kind, L, self.block_size)
            table: list[int | None] = [None] * -(-L // self.block_size)  # a hole where nothing is needed
            for i in held:
                table[i] = self._find(g, prefixes[i])
                self._take(table[i])
            tables.append(table)
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = _Seq(prompt[:L], prefixes[: L // self.block_size], tables)
        return sid, L

    def _copies_first(self, seq: _Seq, g: int) -> bool:
        """Must the next token's block be copied before it is written (shared, or sealed)?"""
        i, table = len(seq.tokens) // self.block_size, seq.tables[g]
        if i >= len(table) or table[i] is None:
            return False
        return self._refcount[table[i]] > 1 or table[i] in self._sealed

    def blocks_needed(self, sid: int, n_new: int) -> int:
        """Blocks `append` of ``n_new`` tokens to ``sid`` takes from the free list, before it gives any back."""
        seq, bs = self._seq(sid), self.block_size
        int_at_least("n_new", n_new, 0)
        if n_new == 0:
            return 0
        n = len(seq.tokens)
        last = -(-(n + n_new) // bs)  # blocks the tokens span
        return sum(max(last - len(t), 0) + self._copies_first(seq, g) for g, t in enumerate(seq.tables))

    def append(self, sid: int, tokens: Sequence[int]) -> None:
        """Store ``tokens`` after sequence ``sid`` in every group, then give back passed blocks.

        Raises `OutOfBlocks` before changing anything if the pool cannot hold the step.
        """
        seq, tokens = self._seq(sid), self._prompt(tokens)
        if not tokens:
            raise ValueError("append needs at least one token")
        if (need := self.blocks_needed(sid, len(tokens))) > len(self._free):
            raise OutOfBlocks(f"appending {len(tokens)} tokens to sequence {sid} needs {need} blocks, "
                              f"{len(self._free)} are free")
        bs, n = self.block_size, len(seq.tokens)
        for g, table in enumerate(seq.tables):
            if self._copies_first(seq, g):  # copy-on-write: this sequence gets its own copy
                old = table[n // bs]
                table[n // bs] = self._allocate()
                self._release(old)
            while len(table) * bs < n + len(tokens):
                table.append(self._allocate())
        seq.tokens.extend(tokens)
        seq.prefixes = _prefixes(seq.tokens, bs, seq.prefixes)
        for g, grp in enumerate(seq.tables):
            if self.prefix_caching:
                for i in range(n // bs, len(seq.prefixes)):  # the blocks this step filled
                    self._seal(g, grp[i], seq.prefixes[i])
            keep = set(blocks_held(self.groups[g].kind, len(seq.tokens), bs))
            for i, block in enumerate(grp):  # oldest first: the first to be evicted
                if block is not None and i not in keep:
                    grp[i] = None
                    self._release(block)

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block ``sid`` holds; the first write to a shared block copies it."""
        parent = self._seq(sid)
        for table in parent.tables:
            for block in table:
                if block is not None:
                    self._refcount[block] += 1
        child, self._next_id = self._next_id, self._next_id + 1
        self._seqs[child] = _Seq(list(parent.tokens), list(parent.prefixes), [list(t) for t in parent.tables])
        return child

    def free(self, sid: int) -> None:
        """End a sequence: drop its share of every block, group by group, last block first."""
        seq = self._seq(sid)
        for table in seq.tables:
            for block in reversed(table):
                if block is not None:
                    self._release(block)
        del self._seqs[sid]

    # -- invariants -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (the tests call it)."""
        owners = [0] * self.num_blocks
        group_of: dict[int, int] = {}
        for sid, seq in self._seqs.items():
            for g, table in enumerate(seq.tables):
                for b in table:
                    if b is None:
                        continue
                    owners[b] += 1
                    if group_of.setdefault(b, g) != g:
                        raise AssertionError(f"block {b} is in the tables of groups {group_of[b]} and {g}")
        for b in range(self.num_blocks):  # every owner counted, and the free list is exactly the unowned
            if owners[b] != self._refcount[b]:
                raise AssertionError(f"block {b} has {owners[b]} owners but reference count {self._refcount[b]}")
            if (self._refcount[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: reference count {self._refcount[b]}, on the free list: {b in self._free}")
        indexed = sorted(b for blocks in self._index.values() for b in blocks)
        if indexed != sorted(self._sealed):
            raise AssertionError("the prefix index and the sealed blocks disagree")

    def __repr__(self) -> str:
        return (f"HybridBlockPool(groups={len(self.groups)} x {self.group_size} layers, blocks={self.num_used}/"
                f"{self.num_blocks} used, block_size={self.block_size}, sequences={len(self._seqs)})")
