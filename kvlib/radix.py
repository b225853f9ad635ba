"""A radix-tree prefix cache: SGLang's RadixAttention index, at token granularity.

`kvlib.paged.blocks` finds a cached prefix by hashing *full blocks*: a prompt that shares
83 tokens with an earlier one reuses 80 of them when blocks hold 16. A radix tree
(a trie whose edges hold runs of tokens) finds the longest cached prefix token by
token. This module is the index only: it maps token ids to opaque *values* (for an
engine, the KV slot of each token) and never touches a tensor.

* ``match_prefix(tokens)``: the longest cached prefix, its values, and a handle;
* ``insert(tokens, values)``: add a sequence, sharing what is cached already;
* ``lock(match)`` / ``unlock(match)``: a running request pins its prefix;
* ``evict(n)``: drop ``n`` tokens, least recently used leaf first, never a locked one.

Every ``match_prefix`` and ``insert`` ends its walk on a node boundary (it *splits* the
edge it stops inside), so all tokens of a node share one last-access time and one
lock count. Eviction trims leaves from their tail, token by token.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .validate import int_at_least, positive_int


class CacheFull(RuntimeError):
    """An insert needs more room than evicting every unlocked token would free."""


class RadixNode:
    """One edge of the tree and the node it leads to: a run of tokens and one value per token."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], value: list, parent: RadixNode | None, last_access: int) -> None:
        self.key = key  # the tokens on the edge from parent to here
        self.value = value  # one value per token of key (a KV slot, say)
        self.children: dict[int, RadixNode] = {}  # first token of the child's edge -> child
        self.parent = parent
        self.lock_ref = 0  # locks held on this node or below it: > 0 means "do not evict"
        self.last_access = last_access  # logical clock of the last match or insert that reached it


class Match(NamedTuple):
    """What ``match_prefix`` found: ``length`` tokens, their ``values``, and ``node``, the
    handle to pass to ``lock``/``unlock`` (the node where the matched prefix ends)."""

    length: int
    values: list
    node: RadixNode


class RadixCache:
    """A prefix cache of at most ``capacity_tokens`` tokens, indexed by a radix tree.

    ``insert`` evicts least recently used unlocked tokens when it would go over
    capacity, and raises `CacheFull` (evicting nothing) if even that cannot make room.
    ``len(cache)`` counts edges (nodes below the root); ``total_tokens`` counts tokens.

    Example

    >>> cache = kvlib.radix.RadixCache(capacity_tokens=100)
    >>> cache.insert([1, 2, 3, 4], ["k1", "k2", "k3", "k4"])  # tokens, and one value (a slot) each
    4
    >>> cache.insert([1, 2, 5], ["x1", "x2", "k5"])  # [1, 2] is shared: one new token
    1
    >>> match = cache.match_prefix([1, 2, 3, 9])
    >>> match.length, match.values, cache.total_tokens
    (3, ['k1', 'k2', 'k3'], 5)
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = positive_int("capacity_tokens", capacity_tokens)
        self.root = RadixNode((), [], None, 0)
        self.total_tokens = 0
        self._locked_tokens = 0  # tokens in nodes with lock_ref > 0
        self._clock = 0  # a logical clock: one tick per match or insert

    # -- counting ---------------------------------------------------------------------------------
    @property
    def evictable_tokens(self) -> int:
        """Tokens that ``evict`` could free now: every token no lock protects."""
        return self.total_tokens - self._locked_tokens

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes()) - 1  # the root holds no edge

    def _nodes(self) -> Iterable[RadixNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- walking ----------------------------------------------------------------------------------
    @staticmethod
    def _check_tokens(tokens: Iterable[int], what: str) -> tuple[int, ...]:
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError(f"{what} needs at least one token, got an empty sequence")
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise TypeError(f"token ids are ints, got {type(bad[0]).__name__} {bad[0]!r}")
        return tokens

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node. ``node`` keeps the
        tail, so a handle to it still means the same prefix."""
        upper = RadixNode(node.key[:k], node.value[:k], node.parent, node.last_access)
        upper.lock_ref = node.lock_ref  # every lock through node passes through upper
        upper.children = {node.key[k]: node}
        node.parent.children[node.key[0]] = upper
        node.key, node.value, node.parent = node.key[k:], node.value[k:], upper
        return upper

    def _walk(self, tokens: tuple[int, ...]) -> tuple[RadixNode, int, list]:
        """Follow ``tokens`` down from the root, splitting the edge the match ends inside.
        Returns (the node where the match ends, its length, the matched values)."""
        node, n, values = self.root, 0, []
        while n < len(tokens) and tokens[n] in node.children:
            child = node.children[tokens[n]]
            k = 0  # how far tokens follows child's edge
            while k < len(child.key) and n + k < len(tokens) and child.key[k] == tokens[n + k]:
                k += 1
            if k < len(child.key):
                child = self._split(child, k)
            node, n = child, n + k
            values.extend(child.value)
        return node, n, values

    def _touch(self, node: RadixNode) -> None:
        """Tick the clock and stamp ``node`` and its ancestors as just used."""
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    # -- the four operations ----------------------------------------------------------------------
    def match_prefix(self, tokens: Iterable[int]) -> Match:
        """The longest cached prefix of ``tokens``: ``Match(length, values, node)``.

        The match may end inside an edge; that edge is split there, so ``node`` marks
        exactly the matched prefix (``lock(match)`` pins those tokens and no others).
        """
        tokens = self._check_tokens(tokens, "match_prefix")
        node, n, values = self._walk(tokens)
        self._touch(node)
        return Match(n, values, node)

    def insert(self, tokens: Iterable[int], values: Iterable[Any]) -> int:
        """Cache ``tokens`` with one value each; returns how many tokens were new.

        Tokens already cached keep their old values, so the caller may free its copies
        ``values[: len(tokens) - new]``. Evicts (LRU, unlocked only, never this sequence's
        own cached prefix) if the new tokens would go over capacity.
        """
        tokens = self._check_tokens(tokens, "insert")
        values = list(values)
        if len(values) != len(tokens):
            raise ValueError(f"insert needs one value per token: {len(tokens)} tokens but {len(values)} values")
        node, n, _ = self._walk(tokens)
        new = len(tokens) - n
        over = self.total_tokens + new - self.capacity_tokens
        if over > 0:
            self._add_lock(node, +1)  # the cached part of this sequence is about to be reused: keep it
            room = self.evictable_tokens
            if room >= over:
                self.evict(over)
            self._add_lock(node, -1)
            if room < over:
                raise CacheFull(
                    f"inserting {new} new tokens needs {over} evicted, but only {room} of the "
                    f"{self.total_tokens} cached tokens are unlocked (capacity {self.capacity_tokens})"
                )
        if new:
            leaf = RadixNode(tokens[n:], values[n:], node, 0)
            node.children[tokens[n]] = leaf
            self.total_tokens += new
            node = leaf
        self._touch(node)
        return new

    def lock(self, match: Match) -> None:
        """Pin the prefix ``match`` found (a running request reads its K/V): add one to the lock
        count of its node and every ancestor, so ``evict`` skips them until ``unlock``."""
        self._add_lock(self._check_handle(match), +1)

    def unlock(self, match: Match) -> None:
        """Undo one ``lock(match)``. Unlocking a prefix no lock holds raises ``ValueError``.
        (A match of length 0 pins nothing: locking or unlocking it does nothing.)"""
        node = self._check_handle(match)
        if node is not self.root and node.lock_ref == 0:
            raise ValueError(f"unlock below zero: the {match.length}-token prefix is not locked")
        self._add_lock(node, -1)

    def _check_handle(self, match: Match) -> RadixNode:
        if not isinstance(match, Match):
            raise TypeError(f"lock/unlock take the Match that match_prefix returned, got {type(match).__name__}")
        node, depth = match.node, 0
        while node.parent is not None:
            depth += len(node.key)
            node = node.parent
        if node is not self.root or depth != match.length:
            raise ValueError(
                f"stale handle: its {match.length}-token prefix was evicted since the match "
                "(lock right after match_prefix)"
            )
        return match.node

    def _add_lock(self, node: RadixNode, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the lock count of ``node`` and of every ancestor."""
        while node is not self.root:
            if (node.lock_ref == 0) != (node.lock_ref + delta == 0):  # locked <-> unlocked
                self._locked_tokens += delta * len(node.key)
            node.lock_ref += delta
            node = node.parent

    def evict(self, n_tokens: int) -> int:
        """Free up to ``n_tokens`` tokens, least recently used unlocked leaf first, trimming a
        leaf's edge from its tail; a parent left childless becomes a leaf in turn.
        Returns how many were freed (fewer only if nothing evictable is left)."""
        int_at_least("n_tokens", n_tokens, 0)
        leaves = [(n.last_access, id(n), n) for n in self._nodes()
                  if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < n_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            k = min(n_tokens - freed, len(leaf.key))
            freed += k
            if k < len(leaf.key):  # a partial trim: the leaf stays, and we are done
                leaf.key, leaf.value = leaf.key[:-k], leaf.value[:-k]
                break
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None  # detached: a handle to it is now stale
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.total_tokens -= freed
        return freed

    # -- looking inside ---------------------------------------------------------------------------
    def sequences(self) -> list[tuple[tuple[int, ...], list]]:
        """Every cached sequence that no other extends (root-to-leaf paths), with its values."""
        out, stack = [], [(self.root, (), [])]
        while stack:
            node, tokens, values = stack.pop()
            tokens, values = tokens + node.key, values + node.value
            if not node.children and node is not self.root:
                out.append((tokens, values))
            stack.extend((c, tokens, values) for c in node.children.values())
        return sorted(out, key=lambda tv: tv[0])

    def pretty(self, fmt: Callable[[list[int]], str] | None = None, width: int = 8) -> str:
        """The tree, one edge a line: its tokens (``fmt(tokens)`` if given, else at most
        ``width`` ids), its length, last access and lock count."""
        lines = [f"RadixCache: {self.total_tokens}/{self.capacity_tokens} tokens, {len(self)} edges, "
                 f"{self.evictable_tokens} evictable"]

        def show(node: RadixNode, indent: str) -> None:
            kids = [node.children[t] for t in sorted(node.children)]
            for i, c in enumerate(kids):
                last = i == len(kids) - 1
                if fmt is not None:
                    text = repr(fmt(list(c.key)))
                else:
                    ids = " ".join(map(str, c.key[:width]))
                    text = f"[{ids}{' …' if len(c.key) > width else ''}]"
                lock = f" lock={c.lock_ref}" if c.lock_ref else ""
                lines.append(f"{indent}{'└─' if last else '├─'} {text} ({len(c.key)}) t={c.last_access}{lock}")
                show(c, indent + ("   " if last else "│  "))

        show(self.root, "")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RadixCache(capacity_tokens={self.capacity_tokens}, total_tokens={self.total_tokens}, edges={len(self)})"


# -- the two prefix indexes side by side ---------------------------------------------------------------
class PrefixHits(NamedTuple):
    """What `prefix_hits` found: per request, the prompt tokens each index already held."""

    radix: list[int]  # token granularity: the longest cached prefix
    chain: list[int]  # block granularity: the cached full blocks of it
    radix_tokens: int  # tokens the tree holds at the end (each distinct prefix once)
    chain_blocks: int  # sealed (full, reusable) blocks the hash chain holds at the end


def prefix_hits(requests: Iterable[Iterable[int]], block_size: int = 16) -> PrefixHits:
    """Serve ``requests`` in order through a `RadixCache` and through the block hash chain of
    `kvlib.paged.blocks` (looked up as `kvlib.paged.PagedCache.add` does), caching each whole request
    afterwards, with room for everything (no eviction). Counts only; no tensors. The hits are
    the index's: `PagedCache.add` would still run a fully cached prompt's last token."""
    from .paged import BlockAllocator  # the chapter-9 index

    requests = [RadixCache._check_tokens(r, "request") for r in requests]
    bs = positive_int("block_size", block_size)
    alloc = BlockAllocator(sum(-(-len(r) // bs) for r in requests) or 1, bs)
    tree, slots = RadixCache(sum(len(r) for r in requests) or 1), 0
    radix, chain = [], []
    for r in requests:
        radix.append(tree.match_prefix(r).length)
        tree.insert(r, range(slots, slots + len(r)))  # the values stand for KV slots
        slots += len(r)
        table, parent = [], None
        for i in range(len(r) // bs):
            parent = alloc.lookup(parent, r[i * bs : (i + 1) * bs])
            if parent is None:
                break  # a chain: after the first miss nothing later can hit
            table.append(parent)
        chain.append(len(table) * bs)
        table += [alloc.allocate() for _ in range(-(-len(r) // bs) - len(table))]
        alloc.seal_full(table, list(r), since=chain[-1])
        for b in table:
            alloc.free(b)  # sealed blocks stay cached; a part-filled tail is simply free again
    sealed = sum(alloc.is_sealed(b) for b in range(alloc.num_blocks))
    return PrefixHits(radix, chain, tree.total_tokens, sealed)
