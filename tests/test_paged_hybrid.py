"""kvlib.paged.hybrid against brute force: which blocks each group keeps (from the attention
mask alone), the pool's reference counts and free list after random operations, prefix hits
against the longest prefix every group can serve, and an all-full pattern against PagedCache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.layers import chunked, full, latent, repeat, shared, visible, window
from kvlib.paged import HybridBlockPool, OutOfBlocks, PagedCache, blocks_held, kv_groups

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")


# -- brute force --------------------------------------------------------------------------------
def brute_held(kind, n: int, bs: int) -> set[int]:
    """Blocks a sequence of n tokens must keep, from the mask alone: those holding a token the
    next query (position n) sees, and the partly filled block the next token goes into."""
    if n == 0:
        return set()
    seen = visible(kind, torch.tensor([n]), torch.arange(n))[0]  # (n,): may query n see token p?
    keep = {p // bs for p in range(n) if seen[p]}
    return keep | ({n // bs} if n % bs else set())


def brute_hit(pool: HybridBlockPool, prompt: list[int]) -> int:
    """The longest L < len(prompt) for which every group has a sealed block holding exactly
    prompt[:(i+1)*bs] for each block i a sequence of L tokens keeps (read block by block)."""
    bs = pool.block_size
    content = {pool.cached(b) for b in range(pool.num_blocks)} - {None}
    for L in range(len(prompt) - 1, 0, -1):
        if all((i + 1) * bs <= len(prompt) and (g, tuple(prompt[: (i + 1) * bs])) in content
               for g, grp in enumerate(pool.groups) for i in brute_held(grp.kind, L, bs)):
            return L
    return 0


def check_pool(pool: HybridBlockPool) -> None:
    """Everything the pool reports, recounted from its block tables and the brute-force rule."""
    bs, owners, where = pool.block_size, {}, {}
    held = full_blocks = 0
    for sid in pool.sequences():
        n, tokens = pool.num_tokens(sid), pool.tokens(sid)
        for g, (grp, table) in enumerate(zip(pool.groups, pool.block_tables(sid))):
            assert len(table) == -(-n // bs)
            assert {i for i, b in enumerate(table) if b is not None} == brute_held(grp.kind, n, bs)
            for i, b in enumerate(table):
                if b is None:
                    continue
                owners[b] = owners.get(b, 0) + 1
                assert where.setdefault(b, g) == g, "a block in two groups"
                if (i + 1) * bs <= n and pool.prefix_caching:  # a full block: sealed with its prefix
                    assert pool.cached(b) == (g, tuple(tokens[: (i + 1) * bs]))
            held += pool.group_size * sum(b is not None for b in table)
        full_blocks += -(-n // bs) * pool.layers_with_cache
    for b in range(pool.num_blocks):
        assert pool.refcount(b) == owners.get(b, 0)
    assert pool.num_used == len(owners) and pool.num_used + pool.num_free == pool.num_blocks
    assert sorted(pool.free_order()) == sorted(set(range(pool.num_blocks)) - set(owners))
    assert pool.used_by_group() == [sum(1 for b in where if where[b] == g) for g in range(len(pool.groups))]
    assert pool.layer_blocks() == (held, full_blocks)
    pool.check()


# -- which blocks a kind keeps --------------------------------------------------------------------
KINDS = [full(), latent(8), window(1), window(3), window(5, 2), window(4, 7), window(9, 1),
         chunked(1), chunked(4), chunked(6)]


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("bs", [1, 2, 3, 4, 7])
def test_blocks_held_is_the_mask(kind, bs):
    for n in range(0, 40):
        assert set(blocks_held(kind, n, bs)) == brute_held(kind, n, bs), (str(kind), n, bs)


def test_kv_groups_as_vllm():
    gemma = kv_groups(repeat([window(512)] * 5 + [full()], 30))  # 25 window, 5 full
    assert [(str(g.kind), len(g.layers), g.padding) for g in gemma] == [("window(512)", 5, 0)] * 5 + [("full", 5, 0)]
    assert gemma[0].layers == (0, 6, 12, 18, 24)  # layers i, i + n, ...: one of each repetition
    odd = kv_groups([full()] * 3 + [window(4)] * 7)  # 7 = 3 + 2 + 2: two groups padded by one layer
    assert [(len(g.layers), g.padding) for g in odd] == [(3, 0), (3, 0), (2, 1), (2, 1)]
    cla = kv_groups([full(), shared(0), full(), shared(2)])  # shared layers own no blocks
    assert [g.layers for g in cla] == [(0, 2)]
    with pytest.raises(ValueError, match="latent"):
        kv_groups([latent(8), full()])


# -- random operations ------------------------------------------------------------------------------
PATTERNS = [
    [full()] * 2,
    repeat([window(3)] * 2 + [full()], 6),
    repeat([window(5, 2)] * 3 + [full()], 8),
    [window(2), window(6)],
    [chunked(4), full(), shared(1)],
    [window(1), full()],
]


@st.composite
def programs(draw):
    ops = []
    for _ in range(draw(st.integers(3, 25))):
        op = draw(st.sampled_from(["add", "add", "append", "append", "append", "fork", "free"]))
        tokens = draw(st.lists(st.integers(0, 2), min_size=0 if op == "add" else 1, max_size=14))
        ops.append((op, draw(st.integers(0, 9)), tokens))
    return ops


def run(pool: HybridBlockPool, ops, on_step=None) -> None:
    """Apply ops (the sequence picked by index among the live ones), checking after each."""
    for op, pick, tokens in ops:
        live = pool.sequences()
        sid = live[pick % len(live)] if live else None
        if op == "add" or sid is None:
            expect = brute_hit(pool, tokens)
            sid, cached = pool.add(tokens)
            assert cached == expect
            if tokens[cached:]:
                try:
                    pool.append(sid, tokens[cached:])
                except OutOfBlocks:
                    pool.free(sid)
        elif op == "append":
            before = (pool.block_tables(sid), pool.free_order())
            need = pool.blocks_needed(sid, len(tokens))
            try:
                pool.append(sid, tokens)
                assert need <= before[1].__len__()
            except OutOfBlocks:
                assert need > len(before[1])
                assert (pool.block_tables(sid), pool.free_order()) == before  # nothing changed
        elif op == "fork":
            pool.fork(sid)
        else:
            pool.free(sid)
        check_pool(pool)


@settings(max_examples=150, deadline=None)
@given(pattern=st.sampled_from(PATTERNS), bs=st.integers(1, 4), num_blocks=st.integers(4, 40),
       caching=st.booleans(), ops=programs())
def test_random_operations_match_brute_force(pattern, bs, num_blocks, caching, ops):
    pool = HybridBlockPool(pattern, num_blocks, bs, prefix_caching=caching)
    run(pool, ops)
    for sid in pool.sequences():
        pool.free(sid)
    check_pool(pool)
    assert pool.num_free == num_blocks  # nothing leaked


# -- prefix hits, by hand ---------------------------------------------------------------------------
def test_window_group_serves_a_prefix_whose_head_was_evicted():
    """Gemma-like: the window group gave back (and lost) the head of a long prompt, the full group
    kept it all; the prompt sent again still hits, because the window needs only its last blocks."""
    bs, prompt = 4, list(range(40))
    pool = HybridBlockPool([window(6), full()], num_blocks=24, block_size=bs)
    sid, _ = pool.add(prompt)
    for start in range(0, 40, 8):  # a chunked prefill: the window gives blocks back as it goes
        pool.append(sid, prompt[start : start + 8])
    assert [sum(b is not None for b in t) for t in pool.block_tables(sid)] == [2, 10]  # tokens 35..39, 0..39
    pool.free(sid)
    check_pool(pool)
    # 4 blocks were never used and go first; then the window's blocks, oldest first
    hog, _ = pool.add()
    pool.append(hog, [7] * (bs * 3))  # 3 blocks in each group: evicts the window's blocks 0 and 1
    assert pool.longest_hit(prompt + [1]) == 40 == brute_hit(pool, prompt + [1])  # needs window blocks 8, 9
    assert pool.longest_hit(prompt[:21]) == 20 == brute_hit(pool, prompt[:21])  # needs window blocks 3, 4
    assert pool.longest_hit(prompt[:13]) == 0 == brute_hit(pool, prompt[:13])  # 12 needs block 1, 8 block 0


def test_all_window_model_hits_from_the_right():
    bs, prompt = 2, list(range(20))
    pool = HybridBlockPool([window(3), window(3)], num_blocks=12, block_size=bs)
    sid, _ = pool.add(prompt)
    pool.append(sid, prompt)
    pool.free(sid)
    hog, _ = pool.add()
    pool.append(hog, [9] * 16)  # 8 blocks: every block of the prompt but its last two is gone
    assert pool.longest_hit(prompt + [5]) == 20
    assert pool.longest_hit(prompt[:12]) == 0  # needs blocks 4 and 5, evicted


def test_sink_blocks_stay():
    pool = HybridBlockPool([window(4, sinks=3)], num_blocks=20, block_size=2)
    sid, _ = pool.add()
    pool.append(sid, list(range(17)))
    assert pool.block_tables(sid)[0] == [0, 1] + [None] * 5 + [7, 8]  # sinks 0..2, window 14..16


def test_memory_saved_of_one_long_request():
    pool = HybridBlockPool(repeat([window(64)] * 5 + [full()], 30), num_blocks=600, block_size=16)
    sid, _ = pool.add()
    pool.append(sid, [1] * 1024)
    # 25 window layers keep ceil(64 / 16) + 1 = 5 blocks (tokens 961..1023 span blocks 60..63, and the
    # next token's block is 64, not yet allocated): 4 blocks; 5 full layers keep 64
    assert pool.used_by_group() == [4] * 5 + [64]
    assert pool.memory_saved() == 1 - (25 * 4 + 5 * 64) / (30 * 64)


def test_misuse_raises_clearly():
    pool = HybridBlockPool([window(4), full()], num_blocks=4, block_size=2)
    with pytest.raises(IndexError, match="no sequence"):
        pool.append(3, [1])
    sid, _ = pool.add([1, 2])
    with pytest.raises(TypeError, match="int ids"):
        pool.append(sid, [1.5])
    with pytest.raises(ValueError, match="at least one token"):
        pool.append(sid, [])
    with pytest.raises(OutOfBlocks, match="needs 6 blocks"):
        pool.append(sid, list(range(6)))
    assert pool.block_tables(sid) == [[], []]
    with pytest.raises(IndexError):
        pool.refcount(4)
    with pytest.raises(ValueError, match="no layer"):
        HybridBlockPool([], 4)
    with pytest.raises(ValueError, match="shared"):
        blocks_held(shared(0), 3, 2)
    with pytest.raises(TypeError, match="prefix_caching"):
        HybridBlockPool([full()], 4, prefix_caching=1)


# -- all full: the existing allocator ---------------------------------------------------------------
def paged_append(cache: PagedCache, sid: int, new: list[int]) -> None:
    k = torch.zeros(1, 1, len(new), 1)  # (B, H_kv, T, D): contents do not matter here
    with cache.step([sid], [new]) as batch:
        batch.update(k, k, 0)


@settings(max_examples=120, deadline=None)
@given(bs=st.integers(1, 4), num_blocks=st.integers(4, 30), ops=programs())
def test_all_full_is_the_paged_cache(bs, num_blocks, ops):
    """Every layer full: one group, and the same tables, hits and free list as PagedCache."""
    pool = HybridBlockPool([full()] * 3, num_blocks, bs)
    cache = PagedCache(1, 1, 1, num_blocks=num_blocks, block_size=bs)
    ids = {}  # pool sid -> cache sid
    for op, pick, tokens in ops:
        live = pool.sequences()
        sid = live[pick % len(live)] if live else None
        if op == "add" or sid is None:
            (sid, cached), (csid, ccached) = pool.add(tokens), cache.add(tokens)
            ids[sid] = csid
            assert cached == ccached
            op, tokens = "append", tokens[cached:]
        if op == "append" and tokens:
            try:
                pool.append(sid, tokens)
            except OutOfBlocks:
                with pytest.raises(OutOfBlocks):
                    paged_append(cache, ids[sid], tokens)
            else:
                paged_append(cache, ids[sid], tokens)
        elif op == "fork":
            ids[pool.fork(sid)] = cache.fork(ids[sid])
        elif op == "free":
            pool.free(sid)
            cache.free(ids.pop(sid))
        for s in pool.sequences():
            assert pool.block_tables(s) == [cache.block_table(ids[s])]
        assert pool.free_order() == cache.allocator.free_order()


def test_a_hash_collision_is_a_miss(monkeypatch):
    """Every prefix hashed alike: a window group that needs only block 1 must still compare
    the tokens before it, so [5, 6, 3, 4] does not reuse the block that ends [1, 2, 3, 4]."""
    monkeypatch.setattr("kvlib.paged.hybrid.chain_hash", lambda parent, tokens: 0)
    pool = HybridBlockPool([window(2)], num_blocks=8, block_size=2)
    sid, _ = pool.add()
    pool.append(sid, [1, 2, 3, 4])
    pool.free(sid)
    assert pool.longest_hit([1, 2, 3, 4, 9]) == 4
    assert pool.longest_hit([5, 6, 3, 4, 9]) == 0 == brute_hit(pool, [5, 6, 3, 4, 9])
