"""kvlib.radix against a brute-force reference (a dict of every cached prefix), and against
kvlib.paged.blocks' hash chain on shared-prefix workloads."""

import contextlib
import random

import pytest

from kvlib.paged import BlockAllocator
from kvlib.radix import CacheFull, Match, RadixCache, prefix_hits

pytestmark = pytest.mark.cpu_only("pure Python: formulas, tables and simulations with no tensors on a device")


# -- the reference: every cached prefix, explicitly -----------------------------------------------
class Reference:
    """A prefix cache with no tree: ``value[p]`` and ``access[p]`` for every cached prefix ``p``
    (a tuple of tokens), LRU eviction of one leaf prefix at a time, locks as a list of prefixes."""

    def __init__(self, capacity: int):
        self.capacity, self.clock = capacity, 0
        self.value: dict[tuple, object] = {}
        self.access: dict[tuple, int] = {}
        self.locks: list[tuple] = []

    def prefixes(self, tokens):
        return [tuple(tokens[: i + 1]) for i in range(len(tokens))]

    def locked(self, p) -> bool:  # p lies on some locked prefix
        return any(q[: len(p)] == p for q in self.locks if len(q) >= len(p))

    def is_leaf(self, p) -> bool:
        return not any(len(q) == len(p) + 1 and q[:-1] == p for q in self.value)

    def evictable_leaves(self, protect=()):
        return [p for p in self.value if self.is_leaf(p) and not self.locked(p) and p not in protect]

    def match(self, tokens):
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.value:
            n += 1
        hit = self.prefixes(tokens)[:n]
        self.clock += 1
        for p in hit:
            self.access[p] = self.clock
        return n, [self.value[p] for p in hit]

    def evict(self, n, protect=()):
        freed = 0
        while freed < n:
            leaves = self.evictable_leaves(protect)
            if not leaves:
                break
            p = min(leaves, key=self.access.__getitem__)
            del self.value[p], self.access[p]
            freed += 1
        return freed

    def insert(self, tokens, values):
        path = set(self.prefixes(tokens))
        new = [p for p in self.prefixes(tokens) if p not in self.value]
        over = len(self.value) + len(new) - self.capacity
        if over > 0:
            protect = path & set(self.value)
            room = sum(1 for p in self.value if p not in protect and not self.locked(p))
            if room < over:
                return None  # CacheFull
            self.evict(over, protect)
        self.clock += 1
        for p, v in zip(self.prefixes(tokens), values):
            self.value.setdefault(p, v)
            self.access[p] = self.clock
        return len(new)


def tree_prefixes(cache: RadixCache) -> dict:
    """Every cached prefix of the tree, with its value, read through ``sequences()``."""
    out = {}
    for tokens, values in cache.sequences():
        for i in range(len(tokens)):
            out[tokens[: i + 1]] = values[i]
    return out


def check_tree(cache: RadixCache) -> None:
    """The tree's own invariants: children filed under their first token, parents used at least as
    recently as their children and locked at least as often, and the token counts it keeps."""
    total = locked = 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        for first, c in node.children.items():
            assert c.parent is node and c.key and c.key[0] == first
            assert c.last_access <= node.last_access
        if node is not cache.root:
            assert len(node.value) == len(node.key)
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            total += len(node.key)
            locked += len(node.key) if node.lock_ref > 0 else 0
    assert (total, total - locked) == (cache.total_tokens, cache.evictable_tokens)


VOCAB = 3


def test_fuzz_against_brute_force():
    rng = random.Random(1234)
    cache, ref = RadixCache(40), Reference(40)
    handles: list[tuple[Match, tuple]] = []  # each lock: its handle and the prefix it pins
    counts = dict.fromkeys(["match", "insert", "full", "lock", "unlock", "evict", "evicted"], 0)

    def seq():
        return [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]  # few ids: prefixes collide often

    for step in range(12_000):
        phase = (step // 1000) % 2  # phases that pile locks up (until inserts hit CacheFull), then drain
        op = rng.choices(["match", "insert", "lock", "unlock", "evict"], [3, 4, 1, 0.5 + 2 * phase, 1])[0]
        before = dict(ref.value)
        if op == "match":
            n, values, _ = cache.match_prefix(s := seq())
            assert (n, values) == ref.match(s), (step, s)
        elif op == "insert":
            s = seq()
            values = [(step, i) for i in range(len(s))]  # unique values: a wrong slot cannot pass
            expected = ref.insert(s, values)
            if expected is None:
                with pytest.raises(CacheFull):
                    cache.insert(s, values)
                counts["full"] += 1
            else:
                assert cache.insert(s, values) == expected, (step, s)
        elif op == "lock":  # a request starts: match its prompt and pin what it found
            s = seq()
            if rng.random() < 0.5:  # half of them were just cached whole: they pin a long prefix
                with pytest.raises(CacheFull) if ref.insert(s, s) is None else contextlib.nullcontext():
                    cache.insert(s, s)
            m = cache.match_prefix(s)
            assert (m.length, m.values) == ref.match(s)
            cache.lock(m)
            ref.locks.append(tuple(s[: m.length]))
            handles.append((m, tuple(s[: m.length])))
        elif op == "unlock" and not handles:
            continue
        elif op == "unlock":
            m, prefix = handles.pop(rng.randrange(len(handles)))
            cache.unlock(m)
            ref.locks.remove(prefix)
        elif op == "evict":
            want = rng.randint(0, 12)
            freed = cache.evict(want)
            after = tree_prefixes(cache)
            gone = set(before) - set(after)
            assert freed == len(gone) == min(want, sum(not ref.locked(p) for p in before)), step
            # what went was unlocked, and no unlocked leaf left behind was used less recently (LRU)
            assert not any(ref.locked(p) for p in gone), step
            leaves = [p for p in after if not ref.locked(p) and not any((*p, t) in after for t in range(VOCAB))]
            if gone and leaves:
                assert max(ref.access[g] for g in gone) <= min(ref.access[p] for p in leaves), step
            assert ref.evict(want) == freed  # and the reference, evicting its own way, agrees
            counts["evicted"] += freed
        counts[op] += 1
        # the whole state, every step: same prefixes, same values, no leaked or double-counted token
        assert tree_prefixes(cache) == ref.value, (step, op)
        assert cache.total_tokens == len(ref.value) <= 40
        assert cache.evictable_tokens == sum(not ref.locked(p) for p in ref.value)
        assert all(p in ref.value for q in ref.locks for p in ref.prefixes(q))  # locked: never evicted
        check_tree(cache)
    # the run exercised every path, not only the easy ones
    print(counts)
    assert min(counts.values()) >= 50, counts


# -- by hand ----------------------------------------------------------------------------------------
def test_split_share_lock_evict_by_hand():
    cache = RadixCache(100)
    assert cache.insert([1, 2, 3, 4, 5], "abcde") == 5
    assert cache.insert([1, 2, 3, 9], "xyzw") == 1  # shares 1 2 3; only 9 is new, and it keeps a b c
    assert (cache.total_tokens, len(cache)) == (6, 3)  # edges: [1 2 3] -> [4 5], [9]
    m = cache.match_prefix([1, 2, 7])  # ends inside the edge [1 2 3]: split into [1 2] -> [3]
    assert (m.length, m.values, len(cache)) == (2, ["a", "b"], 4)
    cache.lock(m)
    assert cache.evictable_tokens == 4
    assert cache.evict(100) == 4  # everything but the locked [1 2]
    assert cache.sequences() == [((1, 2), ["a", "b"])]
    cache.unlock(m)
    assert cache.evict(1) == 1 and cache.sequences() == [((1,), ["a"])]  # trimmed from the tail


def test_lru_and_capacity():
    cache = RadixCache(10)
    cache.insert([1, 1, 1, 1], range(4))  # clock 1
    cache.insert([2, 2, 2, 2], range(4))  # clock 2
    cache.match_prefix([1, 1])  # clock 3: 1 1 is now newer than 2 2 2 2, but 1 1 (tail) is the oldest
    assert cache.insert([3, 3, 3, 3], range(4)) == 4  # 12 > 10: evict 2, the oldest leaf tokens
    assert cache.sequences() == [((1, 1), [0, 1]), ((2, 2, 2, 2), [0, 1, 2, 3]), ((3, 3, 3, 3), [0, 1, 2, 3])]
    locked = cache.match_prefix([2, 2, 2, 2])
    cache.lock(locked)
    cache.lock(cache.match_prefix([3, 3, 3, 3]))
    with pytest.raises(CacheFull, match="only 2 of the 10"):  # 4 new, 2 free in capacity, 2 unlocked
        cache.insert([4, 4, 4, 4, 4], range(5))
    assert cache.total_tokens == 10  # a refused insert evicts nothing
    cache.unlock(locked)
    assert cache.insert([2, 2, 2, 2, 5], range(5)) == 1  # its own prefix is protected: 1 1 goes
    assert [t for t, _ in cache.sequences()] == [(1,), (2, 2, 2, 2, 5), (3, 3, 3, 3)]


def test_stale_handle():
    cache = RadixCache(10)
    cache.insert([1, 2, 3], range(3))
    m = cache.match_prefix([1, 2, 3])
    cache.evict(2)
    with pytest.raises(ValueError, match="stale handle"):
        cache.lock(m)


def test_pretty():
    cache = RadixCache(64)
    cache.insert(list(range(20)), range(20))
    cache.insert(list(range(5)) + [99], range(6))
    cache.lock(cache.match_prefix([0, 1, 2, 3, 4, 99]))
    text = cache.pretty()
    print(text)
    lines = text.splitlines()
    assert lines[0] == "RadixCache: 21/64 tokens, 3 edges, 15 evictable"
    assert lines[1].startswith("└─ [0 1 2 3 4] (5)") and lines[1].endswith("lock=1")
    assert lines[2].startswith("   ├─ [5 6 7 8 9 10 11 12 …] (15)") and "lock" not in lines[2]
    assert lines[3].startswith("   └─ [99] (1)") and lines[3].endswith("lock=1")
    shown = cache.pretty(fmt=lambda ids: "<" + "|".join(map(str, ids[:2])) + ">")  # e.g. a decoder
    assert [line.split()[1] for line in shown.splitlines()[1:]] == ["'<0|1>'", "'<5|6>'", "'<99>'"]


# -- bad input ------------------------------------------------------------------------------------
def test_match_on_empty_prompt_raises():
    cache = RadixCache(8)
    cache.insert([1, 2], [0, 1])
    with pytest.raises(ValueError, match="empty"):
        cache.match_prefix([])


@pytest.mark.parametrize("capacity, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_capacity_raises(capacity, error):
    with pytest.raises(error, match="capacity_tokens"):
        RadixCache(capacity)


def test_unlock_below_zero_raises():
    cache = RadixCache(8)
    cache.insert([1, 2], [0, 1])
    m = cache.match_prefix([1, 2])
    cache.lock(m)
    cache.unlock(m)
    with pytest.raises(ValueError, match="below zero"):
        cache.unlock(m)


def test_values_of_another_length_raise():
    cache = RadixCache(8)
    with pytest.raises(ValueError, match="3 tokens but 2 values"):
        cache.insert([1, 2, 3], [0, 1])
    assert cache.total_tokens == 0


def test_other_bad_input():
    cache = RadixCache(8)
    with pytest.raises(TypeError, match="token ids are ints"):
        cache.insert([1, "2"], [0, 1])
    with pytest.raises(ValueError, match="empty"):
        cache.insert([], [])
    with pytest.raises(ValueError, match="n_tokens"):
        cache.evict(-1)
    with pytest.raises(TypeError, match="Match"):
        cache.lock(cache.root)
    with pytest.raises(ValueError, match="stale handle"):  # a handle from another cache
        RadixCache(8).lock(cache.match_prefix([1]))

# -- radix tree vs kvlib's block hash chain ------------------------------------------------------
BS = 16  # tokens per block


def hashchain_serve(alloc: BlockAllocator, tokens: list[int]) -> int:
    """Look ``tokens`` up block by block the way `kvlib.paged.PagedCache.add` does, then cache them
    (allocate the missing blocks, seal the full ones, free all: they stay cached). Returns the hits
    in tokens."""
    table, parent = [], None
    for i in range(len(tokens) // BS):
        block = alloc.lookup(parent, tokens[i * BS : (i + 1) * BS])
        if block is None:
            break  # a chain: after the first miss nothing later can hit
        table.append(parent := block)
    hits = len(table) * BS
    table += [alloc.allocate() for _ in range(-(-len(tokens) // BS) - len(table))]
    alloc.seal_full(table, tokens, since=hits)
    for block in table:
        alloc.free(block)
    return hits


def radix_serve(cache: RadixCache, tokens: list[int], slots: dict) -> int:
    """Match ``tokens`` in the radix tree, check the slots it returns, then cache them. Returns the hits."""
    n, values, _ = cache.match_prefix(tokens)
    assert values == [slots[tuple(tokens[: i + 1])] for i in range(n)]  # the K/V of these very tokens
    new_slots = [slots.setdefault(tuple(tokens[: i + 1]), len(slots)) for i in range(len(tokens))]
    cache.insert(tokens, new_slots)
    return n


def serve_both(requests: list[list[int]]) -> tuple[list[int], list[int]]:
    alloc, cache, slots = BlockAllocator(4096, BS), RadixCache(1 << 20), {}
    chain = [hashchain_serve(alloc, r) for r in requests]
    radix = [radix_serve(cache, r, slots) for r in requests]
    alloc.check()
    check_tree(cache)
    assert alloc.evictions == 0 and cache.total_tokens == len(slots)  # nothing evicted: hits are the index's alone
    return radix, chain


def few_shot(prefix_len: int, n: int, rng: random.Random) -> list[list[int]]:
    """``n`` prompts: one shared instruction-and-examples prefix, then a question each, whose first
    token differs from every other question's (so the shared part is exactly ``prefix_len``)."""
    prefix = [rng.randrange(1000, 2000) for _ in range(prefix_len)]
    return [prefix + [q] + [rng.randrange(1000) for _ in range(rng.randint(5, 40))] for q in range(n)]


@pytest.mark.parametrize("prefix_len", [5 * BS, 2 * BS, 5 * BS + 3, 5 * BS + BS - 1, 7])
def test_few_shot_hits(prefix_len):
    radix, chain = serve_both(few_shot(prefix_len, 8, random.Random(prefix_len)))
    # the first prompt finds nothing; each later one finds the shared prefix: all of it in the tree,
    # its full blocks in the hash chain
    assert radix == [0] + [prefix_len] * 7
    assert chain == [0] + [prefix_len // BS * BS] * 7
    if prefix_len % BS == 0:
        assert sum(radix) == sum(chain)
    else:
        assert sum(radix) - sum(chain) == 7 * (prefix_len % BS) > 0


def test_multi_turn_chat_tree_hits():
    """Conversations that share a system prompt and branch (a user regenerates, or edits a turn):
    each turn's prompt is an earlier prompt, its reply, and a new message."""
    rng = random.Random(7)
    system = [rng.randrange(1000, 2000) for _ in range(37)]
    done: list[list[int]] = []  # prompt + reply of every served turn
    requests, expected = [], []  # the turns, and the longest prefix each shares with one served before
    for _ in range(40):
        base = rng.choice(done) if done and rng.random() < 0.8 else system
        prompt = base + [rng.randrange(1000) for _ in range(rng.randint(3, 30))]
        requests.append(prompt + [rng.randrange(1000) for _ in range(rng.randint(1, 25))])  # + reply
        expected.append(max([_shared(requests[-1], d) for d in done] + [0]))
        done.append(requests[-1])
    radix, chain = serve_both(requests)  # each request is cached with its reply, as an engine does
    assert radix == expected  # token granularity: every shared token is found
    assert chain == [n // BS * BS for n in expected]  # only the full blocks of it
    assert all(0 <= r - c < BS for r, c in zip(radix, chain)) and sum(radix) > sum(chain)
    assert sum(c > 0 for c in chain) >= 20  # the workload does share: most turns hit


def test_prefix_hits_serves_both_indexes_like_the_references_here():
    """kvlib.radix.prefix_hits against this file's two serving loops, on a branching chat tree,
    and the memory each index keeps: every distinct prefix token once; the full blocks."""
    rng = random.Random(3)
    system = [rng.randrange(1000, 2000) for _ in range(21)]
    done = []
    for _ in range(25):
        base = rng.choice(done) if done and rng.random() < 0.7 else system
        done.append(base + [rng.randrange(1000) for _ in range(rng.randint(1, 40))])
    got = prefix_hits(done, BS)
    radix, chain = serve_both(done)
    assert (got.radix, got.chain) == (radix, chain)
    distinct = {tuple(r[: i + 1]) for r in done for i in range(len(r))}
    assert got.radix_tokens == len(distinct)
    full = {tuple(r[: (i + 1) * BS]) for r in done for i in range(len(r) // BS)}
    assert got.chain_blocks == len(full)
    with pytest.raises(ValueError, match="request needs at least one token"):
        prefix_hits([[1, 2], []])
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        prefix_hits([[1, 2]], 0)


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
