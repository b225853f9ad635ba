"""kvlib.paged against contiguous references: the allocator's bookkeeping, the pools'
contents, copy-on-write, prefix caching, and whole generations through the engine."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib import DynamicCache, ModelConfig, Transformer
from kvlib.attention import attention_mask, grouped_attention
from kvlib.packed import packed_mask
from kvlib.paged import BlockAllocator, OutOfBlocks
from kvlib.engine import Engine
from kvlib.paged import PagedCache, gather, paged_attention_loop, slot_mapping

pytestmark = pytest.mark.device


# -- helpers ------------------------------------------------------------------------------------------
def paged_attention(  # the reference for paged reads: no chapter teaches with it, so it lives here
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


def prefix_values(tokens: list[int]) -> list[float]:
    """Stand-in K for a token: a function of the token and everything before it, like a real
    model's keys. Values stay below 2**16, so float32 holds them exactly."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1009 + t + 1) % 65521
        out.append(float(h))
    return out


def append(cache: PagedCache, sid: int, new: list[int]) -> None:
    """Append ``new`` tokens to one sequence through the Cache protocol (no model)."""
    vals = prefix_values(cache.tokens(sid) + new)[-len(new):]
    k = torch.tensor(vals, device=cache.keys[0].device).view(1, 1, len(new), 1).expand(1, cache.n_kv_head, len(new), cache.head_dim)
    with cache.step([sid], [new]) as batch:
        for layer in range(cache.n_layer):
            batch.update(k.contiguous(), -k.contiguous(), layer)


def append_many(cache: PagedCache, sids: list[int], new: list[int]) -> None:
    """One step that appends one token to each of several sequences."""
    vals = [prefix_values(cache.tokens(s) + [t])[-1] for s, t in zip(sids, new)]
    k = torch.tensor(vals, device=cache.keys[0].device).view(-1, 1, 1, 1).expand(len(sids), cache.n_kv_head, 1, cache.head_dim).contiguous()
    with cache.step(sids, [[t] for t in new]) as batch:
        for layer in range(cache.n_layer):
            batch.update(k, -k, layer)


def assert_holds(cache: PagedCache, sid: int) -> None:
    """The sequence's K/V, read back through its block table, are exactly what was written."""
    toks = cache.tokens(sid)
    if not toks:
        return
    want = torch.tensor(prefix_values(toks), device=cache.keys[0].device).view(1, 1, -1, 1).expand(1, cache.n_kv_head, len(toks), cache.head_dim)
    for layer in range(cache.n_layer):
        k, v = cache.layer_kv(sid, layer)
        assert torch.equal(k, want), f"sequence {sid} layer {layer}: keys corrupted"
        assert torch.equal(v, -want), f"sequence {sid} layer {layer}: values corrupted"


def start(cache: PagedCache, prompt: list[int]) -> int:
    """add + write whatever the prefix cache did not already hold."""
    sid, cached = cache.add(prompt)
    if cached < len(prompt):
        append(cache, sid, prompt[cached:])
    return sid


@pytest.fixture(scope="module")
def tiny(device):
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=128)
    m = Transformer(cfg, device=device)
    m.reset_parameters(seed=0, std=0.2)  # sharp logits: no argmax ties, so token equality is a fair test
    return m.eval()


# -- the allocator --------------------------------------------------------------------------------------
def test_allocator_hands_out_every_block_once_then_runs_out():
    a = BlockAllocator(4, 2)
    got = [a.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and a.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 4 blocks"):
        a.allocate()
    a.free(got[2])
    assert a.allocate() == got[2]
    a.check()


def test_allocator_refcounts_and_errors():
    a = BlockAllocator(3, 2)
    b = a.allocate()
    a.share(b)
    assert a.refcount[b] == 2
    a.free(b)
    assert a.refcount[b] == 1 and a.num_free == 2  # still owned once
    a.free(b)
    assert a.refcount[b] == 0 and a.num_free == 3
    with pytest.raises(ValueError, match="double free: block"):
        a.free(b)
    with pytest.raises(IndexError, match="not in this pool of 3"):
        a.free(7)
    with pytest.raises(IndexError, match="not in this pool"):
        a.free(-1)
    with pytest.raises(TypeError, match="block id is an int"):
        a.free(1.0)
    with pytest.raises(ValueError, match="cannot share block .* free"):
        a.share(b)
    with pytest.raises(ValueError, match="positive int"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="positive int"):
        BlockAllocator(4, 0)
    a.check()


def test_seal_and_lookup_errors():
    a = BlockAllocator(4, 2)
    b = a.allocate()
    with pytest.raises(ValueError, match="exactly block_size=2"):
        a.seal(b, None, [1, 2, 3])
    with pytest.raises(ValueError, match="not sealed"):
        a.seal(b, a.allocate(), [1, 2])
    a.seal(b, None, [1, 2])
    with pytest.raises(ValueError, match="already sealed"):
        a.seal(b, None, [1, 2])
    with pytest.raises(ValueError, match="cannot seal block .* free"):
        a.seal(3, None, [1, 2])


# -- block tables and gathering -------------------------------------------------------------------------
def test_slot_mapping_by_hand():
    # table [5, 2]: tokens 0-3 live in block 5 (slots 20-23), tokens 4-7 in block 2 (slots 8-11)
    assert slot_mapping([5, 2], 2, 6, 4) == [22, 23, 8, 9]
    with pytest.raises(IndexError, match="do not fit"):
        slot_mapping([5, 2], 6, 9, 4)


@given(
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous(block_size, lengths, chunk, seed, device):
    """Random K/V written through the paged cache in chunks read back bit for bit, in a
    scrambled pool; and paged attention equals attention over the contiguous tensors."""
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 3
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache = PagedCache(1, H, D, num_blocks=num_blocks, block_size=block_size, prefix_caching=False)
    # scramble the free list so block tables are not 0, 1, 2, ...
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    cache.allocator.reorder_free(order)
    ref = [torch.randn(1, H, n, D, generator=g).to(device) for n in lengths]
    sids = [cache.add()[0] for _ in lengths]
    for sid, kv, n in zip(sids, ref, lengths):
        for s in range(0, n, chunk):
            piece = kv[:, :, s : s + chunk]
            with cache.step([sid], [[0] * piece.shape[2]]) as batch:
                batch.update(piece, 2 * piece, 0)
    for sid, kv in zip(sids, ref):
        k, v = cache.layer_kv(sid, 0)
        assert torch.equal(k, kv) and torch.equal(v, 2 * kv)
    cache.check()

    # paged attention for the last T tokens of every sequence at once
    T = min(lengths)
    q = torch.randn(len(lengths), 2 * H, T, D, generator=g).to(device)
    n_max = max(-(-n // block_size) for n in lengths)
    tables = torch.tensor([cache.block_table(s) + [0] * (n_max - len(cache.block_table(s))) for s in sids])
    got = paged_attention(q, cache.keys[0], cache.values[0], tables, torch.tensor(lengths, device=device))
    for b, kv in enumerate(ref):
        n = lengths[b]
        want = grouped_attention(q[b : b + 1], kv, 2 * kv, attention_mask(T, n))
        torch.testing.assert_close(got[b : b + 1], want, rtol=1e-5, atol=1e-6)


@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    length=st.integers(1, 50),
    groups=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_loop_equals_contiguous_attention(block_size, length, groups, seed, device):
    """The per-block loop (online softmax over blocks read in place) against attention over the
    contiguous keys, in a pool whose blocks are scrambled and hold other data around them."""
    g = torch.Generator().manual_seed(seed)
    H_kv, D = 2, 8
    n = -(-length // block_size)
    table = random.Random(seed).sample(range(n + 5), n)  # blocks in no particular order
    k_pool = torch.randn(n + 5, block_size, H_kv, D, generator=g).to(device) * 3  # sharp scores: a real softmax test
    v_pool = torch.randn(n + 5, block_size, H_kv, D, generator=g).to(device)
    q = torch.randn(groups * H_kv, D, generator=g).to(device)
    got = paged_attention_loop(q, k_pool, v_pool, table, length)
    k = gather(k_pool, torch.tensor([table], device=device), length)  # (1, H_kv, length, D)
    v = gather(v_pool, torch.tensor([table], device=device), length)
    want = grouped_attention(q[None, :, None], k, v)[0, :, 0]  # (H, D): one query sees every key
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_paged_attention_loop_rejects_bad_input(device):
    pool = torch.zeros(4, 2, 2, 3, device=device)
    with pytest.raises(ValueError, match="need q"):
        paged_attention_loop(torch.zeros(4, 5, device=device), pool, pool, [0], 1)
    with pytest.raises(ValueError, match="cannot share 2 KV heads"):
        paged_attention_loop(torch.zeros(3, 3, device=device), pool, pool, [0], 1)
    with pytest.raises(ValueError, match="does not fit a table of 2 blocks of 2"):
        paged_attention_loop(torch.zeros(4, 3, device=device), pool, pool, [0, 1], 5)


def test_gather_rejects_bad_shapes(device):
    pool = torch.zeros(4, 2, 1, 3, device=device)
    with pytest.raises(ValueError, match="pool must be"):
        gather(pool[0], torch.zeros(1, 1, dtype=torch.long, device=device), 1)
    with pytest.raises(ValueError, match="block_tables must be"):
        gather(pool, torch.zeros(3, dtype=torch.long, device=device), 1)
    with pytest.raises(ValueError, match="does not fit 2 blocks of 2"):
        gather(pool, torch.zeros(1, 2, dtype=torch.long, device=device), 5)


# -- copy-on-write ----------------------------------------------------------------------------------------
def test_fork_shares_blocks_then_copies_only_the_partial_one():
    cache = PagedCache(2, 1, 2, num_blocks=16, block_size=4, prefix_caching=False)
    parent = start(cache, list(range(10)))  # blocks: 4 + 4 + 2 (partial)
    child = cache.fork(parent)
    assert cache.block_table(child) == cache.block_table(parent)
    assert all(cache.allocator.refcount[b] == 2 for b in cache.block_table(parent))
    used = cache.allocator.num_used
    append(cache, child, [40, 41])  # writes into the shared partial block: copied first
    append(cache, parent, [30])
    append(cache, parent, [31, 32, 33])
    assert cache.copies == 1
    assert cache.block_table(child)[:2] == cache.block_table(parent)[:2]  # full blocks stay shared
    assert cache.block_table(child)[2] != cache.block_table(parent)[2]
    assert cache.allocator.num_used == used + 2  # one copy, one new block for the parent's growth
    for sid in (parent, child):
        assert_holds(cache, sid)
    assert cache.tokens(child) == list(range(10)) + [40, 41]
    cache.free(parent)
    assert_holds(cache, child)
    cache.check()
    cache.free(child)
    assert cache.allocator.num_free == cache.num_blocks


def test_fork_of_a_block_aligned_sequence_copies_nothing():
    cache = PagedCache(1, 1, 1, num_blocks=8, block_size=4, prefix_caching=False)
    a = start(cache, list(range(8)))
    b = cache.fork(a)
    append(cache, a, [1])
    append(cache, b, [2])
    assert cache.copies == 0
    assert_holds(cache, a)
    assert_holds(cache, b)


def test_truncate_frees_blocks_and_never_touches_a_sharer():
    cache = PagedCache(1, 1, 1, num_blocks=16, block_size=4)
    a = start(cache, list(range(10)))
    b = cache.fork(a)
    used = cache.allocator.num_used
    cache.truncate(b, 5)  # b keeps blocks 0-1; its table drops block 2
    assert cache.block_table(b) == cache.block_table(a)[:2] and cache.allocator.num_used == used
    append(cache, b, [20, 21, 22])  # writes into block 1, sealed and shared with a: copied first
    assert cache.block_table(b)[1] != cache.block_table(a)[1]
    assert_holds(cache, a)
    assert_holds(cache, b)
    cache.truncate(a, 0)
    assert cache.block_table(a) == [] and cache.num_tokens(a) == 0
    with pytest.raises(IndexError, match="cannot truncate sequence"):
        cache.truncate(b, 99)
    cache.check()


def test_many_forks_diverge_independently():
    cache = PagedCache(1, 2, 2, num_blocks=64, block_size=3, prefix_caching=False)
    root = start(cache, [7, 8, 9, 10])
    kids = [cache.fork(root) for _ in range(5)]
    rng = random.Random(0)
    for _ in range(20):
        sid = rng.choice(kids + [root])
        append(cache, sid, [rng.randrange(50) for _ in range(rng.randint(1, 4))])
    for sid in kids + [root]:
        assert_holds(cache, sid)
    cache.check()


# -- prefix caching -----------------------------------------------------------------------------------------
def test_prefix_hits_misses_and_partial_hits():
    cache = PagedCache(1, 1, 1, num_blocks=32, block_size=4)
    prompt = list(range(11))  # two full blocks + 3 tokens
    a = start(cache, prompt)
    assert cache.allocator.hits == 0
    b, cached = cache.add(prompt)
    assert cached == 8 and cache.allocator.hits == 2  # both full blocks reused
    assert cache.block_table(b)[:2] == cache.block_table(a)[:2]
    append(cache, b, prompt[8:])
    assert_holds(cache, b)
    c, cached = cache.add([0, 1, 2, 3, 99, 5, 6, 7])  # first block equal, second differs
    assert cached == 4
    d, cached = cache.add([1, 2, 3, 4])  # the same tokens at another offset are another block
    assert cached == 0
    e, cached = cache.add(list(range(4, 8)))  # block 2's tokens, without block 1 before them: a miss
    assert cached == 0
    cache.check()


def test_fully_cached_prompt_recomputes_its_last_token_in_a_copy():
    cache = PagedCache(1, 1, 1, num_blocks=16, block_size=4)
    prompt = list(range(8))
    a = start(cache, prompt)
    b, cached = cache.add(prompt)
    assert cached == 7  # the last token is run again: its logits give the next token
    sealed = cache.block_table(b)[1]
    append(cache, b, prompt[7:])
    assert cache.block_table(b)[1] != sealed and cache.copies == 1  # the sealed block is never written
    assert_holds(cache, a)
    assert_holds(cache, b)
    append(cache, b, [50, 51])
    assert_holds(cache, b)


def test_freed_prefix_blocks_are_revived_until_evicted():
    cache = PagedCache(1, 1, 1, num_blocks=6, block_size=2)
    a = start(cache, [1, 2, 3, 4, 5])  # 3 blocks, 2 of them full and sealed
    cache.free(a)
    assert cache.allocator.num_free == 6 and cache.allocator.num_cached_free == 2
    b, cached = cache.add([1, 2, 3, 4, 9])
    assert cached == 4 and cache.allocator.hits == 2  # revived from the free list
    append(cache, b, [9])
    assert_holds(cache, b)
    cache.free(b)
    # fill the pool with other tokens: uncached free blocks go first, then the LRU cached ones
    c = cache.add()[0]
    append(cache, c, [20, 21, 22, 23])
    assert cache.allocator.evictions == 0  # two uncached blocks were free: nothing evicted yet
    append(cache, c, [24, 25, 26, 27, 28, 29, 30, 31])
    assert cache.allocator.evictions == 2
    cache.free(c)
    d, cached = cache.add([1, 2, 3, 4, 9])
    assert cached == 0  # evicted: a miss, recomputed
    cache.check()


def test_hash_collisions_are_misses_not_wrong_kv():
    cache = PagedCache(1, 1, 1, num_blocks=32, block_size=2, hash_fn=lambda parent, tokens: 0)  # everything collides
    a = start(cache, [1, 2, 3, 4, 5])
    b, cached = cache.add([7, 8, 3, 4, 5])
    assert cached == 0  # same hash, different tokens
    append(cache, b, [7, 8, 3, 4, 5])
    c, cached = cache.add([1, 2, 9, 9])
    assert cached == 2  # the indexed block really holds [1, 2]
    append(cache, c, [9, 9])
    for sid in (a, b, c):
        assert_holds(cache, sid)


def test_a_stale_parent_never_matches():
    """A child sealed after block P must not match once P has been evicted and refilled,
    even when the hash cannot tell (this one ignores the parent entirely)."""
    a = BlockAllocator(3, 2, hash_fn=lambda parent, tokens: hash(tokens))
    p = a.allocate()
    a.seal(p, None, [1, 2])
    c = a.allocate()
    a.seal(c, p, [3, 4])  # [3, 4]'s K/V were computed after [1, 2]
    a.free(p)
    a.allocate()  # the unsealed free block goes first...
    assert a.allocate() == p and a.evictions == 1  # ...then P is evicted and handed out again
    a.seal(p, None, [5, 6])
    assert a.lookup(p, [3, 4]) is None  # same tokens, same hash, but a different parent
    a.free(p)
    assert a.lookup(None, [5, 6]) == p  # the new contents do hit
    a.check()


# -- the fuzz ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size,prefix", [(1, True), (3, True), (4, False)])
def test_fuzz_alloc_append_fork_free(block_size, prefix):
    """≥ 1e5 random operations in all (three runs): contents stay exact, reference counts equal
    the number of block tables holding each block, and the pool is whole at the end."""
    rng = random.Random(block_size)
    cache = PagedCache(1, 1, 1, num_blocks=40, block_size=block_size, prefix_caching=prefix)
    ops = {"add": 0, "append": 0, "fork": 0, "truncate": 0, "free": 0, "out_of_blocks": 0}
    prompts = [[rng.randrange(4) for _ in range(rng.randint(1, 12))] for _ in range(6)]  # few: hits happen
    for i in range(35_000):
        live = list(cache.seqs)
        r = rng.random()
        try:
            if r < 0.15 or not live:
                sid = start(cache, list(rng.choice(prompts)))
                ops["add"] += 1
            elif r < 0.55:
                sid = rng.choice(live)
                append(cache, sid, [rng.randrange(4) for _ in range(rng.choice([1, 1, 1, 2, 5]))])
                ops["append"] += 1
            elif r < 0.65:  # one step for several sequences (forks often share the block they write)
                group = rng.sample(live, min(len(live), rng.randint(2, 4)))
                append_many(cache, group, [rng.randrange(4) for _ in group])
                ops["append"] += 1
                sid = None
                for g in group:
                    assert_holds(cache, g)
            elif r < 0.75:
                sid = cache.fork(rng.choice(live))
                ops["fork"] += 1
            elif r < 0.8:
                sid = rng.choice(live)
                cache.truncate(sid, rng.randint(0, cache.num_tokens(sid)))
                ops["truncate"] += 1
            else:
                sid = rng.choice(live)
                cache.free(sid)
                ops["free"] += 1
                sid = None
        except OutOfBlocks:
            ops["out_of_blocks"] += 1
            victim = rng.choice(list(cache.seqs))  # a scheduler would preempt one
            if victim in cache.seqs:
                cache.free(victim)
            continue
        if sid is not None and sid in cache.seqs:
            assert_holds(cache, sid)
        if i % 500 == 0:
            cache.check()
            for s in cache.seqs:
                assert_holds(cache, s)
    assert min(ops.values()) > 100, ops  # every kind of operation really happened
    cache.check()
    for s in cache.seqs:
        assert_holds(cache, s)
    for s in list(cache.seqs):
        cache.free(s)
    cache.check()
    assert cache.allocator.num_free == cache.num_blocks and not any(cache.allocator.refcount)
    if prefix:
        assert cache.allocator.hits > 100 and cache.allocator.evictions > 10


def test_a_failed_step_changes_nothing():
    cache = PagedCache(1, 1, 1, num_blocks=2, block_size=2, prefix_caching=False)
    a = start(cache, [1, 2, 3])
    table = cache.block_table(a)
    with pytest.raises(OutOfBlocks, match="needs 1 blocks but only 0"):
        cache.step([a], [[4, 5]])
    assert cache.block_table(a) == table and cache.num_tokens(a) == 3
    append(cache, a, [4])
    assert_holds(cache, a)
    cache.check()


def test_one_step_for_a_sequence_and_its_fork_needs_one_copy():
    """Both owners of a shared partial block write in one step: the first copies it, the
    second is then alone and writes in place. One free block is enough."""
    cache = PagedCache(1, 1, 1, num_blocks=2, block_size=4, prefix_caching=False)
    a = start(cache, [1, 2])
    b = cache.fork(a)
    assert cache.blocks_needed([a, b], 1) == 1
    append_many(cache, [a, b], [3, 4])
    assert cache.copies == 1 and cache.allocator.num_free == 0
    assert_holds(cache, a)
    assert_holds(cache, b)


def test_fully_cached_prompt_with_one_token_blocks_copies_the_sealed_block():
    cache = PagedCache(1, 1, 1, num_blocks=16, block_size=1)
    a = start(cache, [5, 6, 7])
    b, cached = cache.add([5, 6, 7])
    assert cached == 2 and len(cache.block_table(b)) == 3  # the third block is a's sealed one
    append(cache, b, [7])
    assert cache.copies == 1 and cache.block_table(b)[2] != cache.block_table(a)[2]
    assert_holds(cache, a)
    assert_holds(cache, b)


def test_an_unfinished_step_then_fork_shares_nothing_unwritten():
    """A step whose forward never ran reserves nothing; a fork shares only written blocks."""
    cache = PagedCache(1, 1, 1, num_blocks=8, block_size=4, prefix_caching=False)
    a = start(cache, [1, 2, 3, 4])
    cache.step([a], [[5]])  # the forward "fails" before update: the batch is dropped by the next change
    b = cache.fork(a)
    assert len(cache.block_table(b)) == 1
    append(cache, a, [5])
    append(cache, b, [7])
    assert_holds(cache, a)
    assert_holds(cache, b)
    cache.check()


def test_a_stale_batch_refuses_to_write(device):
    cache = PagedCache(1, 1, 1, num_blocks=8, block_size=2, prefix_caching=False)
    a = start(cache, [1, 2, 3])
    stale = cache.step([a], [[4]])
    other = start(cache, [9])  # the tables changed after `stale` was made
    with pytest.raises(ValueError, match="stale"):
        stale.update(torch.ones(1, 1, 1, 1, device=device), torch.ones(1, 1, 1, 1, device=device), 0)
    cache.free(a)
    assert_holds(cache, other)
    cache.check()


def test_a_step_commits_only_when_every_layer_is_written_and_commit_is_called(device):
    cache = PagedCache(2, 1, 1, num_blocks=4, block_size=2)
    a, _ = cache.add()
    batch = cache.step([a], [[1, 2]])
    batch.update(torch.ones(1, 1, 2, 1, device=device), torch.ones(1, 1, 2, 1, device=device), 1)  # the last layer first
    with pytest.raises(ValueError, match=r"layers \[0\] were never written"):
        batch.commit()
    assert cache.num_tokens(a) == 0 and cache.block_table(a) == [] and cache.allocator.num_used == 0
    batch.update(torch.ones(1, 1, 2, 1, device=device), torch.ones(1, 1, 2, 1, device=device), 0)
    assert cache.num_tokens(a) == 0 and cache.allocator.num_used == 0  # every layer ran, nothing stored yet
    with pytest.raises(ValueError, match="never committed"):
        cache.fork(a)  # a finished but uncommitted step is not silently lost
    batch.commit()
    assert cache.num_tokens(a) == 2 and cache.allocator.is_sealed(cache.block_table(a)[0])
    with pytest.raises(ValueError, match="already committed"):
        batch.commit()


def test_a_forward_that_raises_halfway_leaves_the_cache_as_it_was(tiny, device):
    """The model fails in its second layer, inside the step's `with` block: no block is
    reserved or copied, nothing is written or sealed, and the next step works."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    a, _ = cache.add()
    with cache.step([a], torch.tensor([[1, 2, 3, 4, 5, 6]], device=device)) as batch:
        tiny(torch.tensor([[1, 2, 3, 4, 5, 6]], device=device), batch)
    b = cache.fork(a)  # shares a partial block: the next write to it must copy
    before = ([cache.block_table(s) for s in (a, b)], cache.allocator.free_order(), cache.copies,
              [cache.layer_kv(a, layer) for layer in range(2)], cache.allocator.hits, cache.version)
    pools = [t.clone() for t in cache.keys + cache.values]
    real = tiny.layers[1].forward
    tiny.layers[1].forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("layer 1 failed"))
    try:
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            with cache.step([a, b], torch.tensor([[7, 8, 9], [7, 8, 9]], device=device)) as batch:
                tiny(torch.tensor([[7, 8, 9], [7, 8, 9]], device=device), batch)
    finally:
        tiny.layers[1].forward = real
    after = ([cache.block_table(s) for s in (a, b)], cache.allocator.free_order(), cache.copies,
             [cache.layer_kv(a, layer) for layer in range(2)], cache.allocator.hits, cache.version)
    assert after[:3] == before[:3] and after[4:] == before[4:]
    for (k0, v0), (k1, v1) in zip(before[3], after[3]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert all(torch.equal(p, q) for p, q in zip(pools, cache.keys + cache.values))  # not one byte written
    cache.check()
    with cache.step([a], torch.tensor([[7]], device=device)) as batch:  # and the cache works on
        got = tiny(torch.tensor([[7]], device=device), batch)[0, -1]
    ref = DynamicCache(2)
    tiny(torch.tensor([[1, 2, 3, 4, 5, 6]], device=device), ref)
    torch.testing.assert_close(got, tiny(torch.tensor([[7]], device=device), ref)[0, -1], rtol=1e-5, atol=1e-5)


def test_duplicate_prefix_blocks_stay_findable_after_one_is_evicted():
    cache = PagedCache(1, 1, 1, num_blocks=5, block_size=2)
    a, _ = cache.add()
    append(cache, a, [1, 2, 3])  # seals [1, 2] in block X
    b, _ = cache.add()
    append(cache, b, [1, 2, 4])  # computed again (not looked up): a second sealed copy, block Y
    cache.free(a)  # X is freed (cached); then reuse the pool until X is evicted
    c, _ = cache.add()
    append(cache, c, [8, 8, 8, 8, 8])  # three blocks: the two uncached free ones, then X
    assert cache.allocator.evictions == 1
    d, cached = cache.add([1, 2, 5])
    assert cached == 2 and cache.block_table(d)[0] == cache.block_table(b)[0]  # Y, still in use, is found
    cache.check()


# -- bad inputs ---------------------------------------------------------------------------------------------------
def test_bad_inputs_to_the_cache(device):
    cache = PagedCache(2, 1, 2, num_blocks=8, block_size=2)
    a = start(cache, [1, 2, 3])
    with pytest.raises(IndexError, match="no sequence 9"):
        cache.step([9], [[1]])
    with pytest.raises(IndexError, match="no sequence 9"):
        cache.free(9)
    with pytest.raises(ValueError, match="appears twice"):
        cache.step([a, a], [[1], [2]])
    with pytest.raises(ValueError, match=r"tokens must be \(batch=1, T >= 1\)"):
        cache.step([a], [[1], [2]])
    with pytest.raises(ValueError, match="at least one sequence"):
        cache.step([], [])
    with pytest.raises(TypeError, match="tokens must be int ids, got torch.float32"):
        cache.step([a], torch.ones(1, 1, device=device))
    with pytest.raises(TypeError, match="int ids"):
        cache.step([a], [[1.5]])
    batch = cache.step([a], [[4]])
    with pytest.raises(ValueError, match="reserved 1 tokens per sequence but update got 2"):
        batch.update(torch.zeros(1, 1, 2, 2, device=device), torch.zeros(1, 1, 2, 2, device=device), 0)
    with pytest.raises(ValueError, match="kv_heads=1 but update"):
        batch.update(torch.zeros(1, 3, 1, 2, device=device), torch.zeros(1, 3, 1, 2, device=device), 0)
    with pytest.raises(IndexError, match="out of range"):
        batch.update(torch.zeros(1, 1, 1, 2, device=device), torch.zeros(1, 1, 1, 2, device=device), 5)
    batch.update(torch.zeros(1, 1, 1, 2, device=device), torch.zeros(1, 1, 1, 2, device=device), 0)
    with pytest.raises(ValueError, match="layer 0 was already written"):
        batch.update(torch.zeros(1, 1, 1, 2, device=device), torch.zeros(1, 1, 1, 2, device=device), 0)
    with pytest.raises(ValueError, match="positive int"):
        PagedCache(2, 1, 2, num_blocks=0)
    with pytest.raises(TypeError, match="dtype"):
        PagedCache(2, 1, 2, num_blocks=4, dtype="fp16")


def test_bad_inputs_to_the_engine(tiny):
    cache = PagedCache.for_model(tiny, num_blocks=8, block_size=4)
    eng = Engine(tiny, cache)
    with pytest.raises(ValueError, match="non-empty prompt"):
        eng.add([], 4)
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        eng.add([1, 50], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        eng.add([1], 0)
    with pytest.raises(ValueError, match="need 10 blocks: more than the pool's 8 blocks"):
        eng.add([1] * 30, 11)
    with pytest.raises(ValueError, match="max_seq_len=128"):
        eng.add([1] * 100, 40)
    with pytest.raises(ValueError, match="temperature"):
        eng.add([1], 4, temperature=-1)
    with pytest.raises(ValueError, match="n=3 samples cannot run at once with max_batch=2"):
        Engine(tiny, cache, max_batch=2).add([1], 4, n=3)
    eng.add([1] * 20, 13)  # 32 tokens, of which 31 are ever stored: exactly the pool's 8 blocks of 4
    with pytest.raises(TypeError, match="PagedCache"):
        Engine(tiny, DynamicCache(2))
    with pytest.raises(ValueError, match="cache is shaped"):
        Engine(tiny, PagedCache(3, 2, 8, num_blocks=4))


def test_model_checks_an_explicit_mask(tiny, device):
    ids = torch.tensor([[1, 2, 3]], device=device)
    with pytest.raises(ValueError, match=r"mask must be bool \(1 or 1, 1, 3, 3\)"):
        tiny(ids, mask=torch.ones(1, 1, 3, 4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="either mask or key_valid"):
        tiny(ids, mask=torch.ones(1, 1, 3, 3, dtype=torch.bool, device=device), key_valid=torch.ones(1, 3, dtype=torch.bool, device=device))
    causal = torch.ones(3, 3, dtype=torch.bool, device=device).tril()[None, None]
    torch.testing.assert_close(tiny(ids, mask=causal), tiny(ids), rtol=0, atol=1e-6)


# -- through a model -------------------------------------------------------------------------------------------
def test_paged_batch_logits_equal_contiguous_cache(tiny, device):
    """Three sequences of different lengths, decoded together through one PagedBatch,
    give the logits each gets alone with a DynamicCache."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50, (1, n), generator=g).to(device) for n in (3, 9, 6)]
    cache = PagedCache.for_model(tiny, num_blocks=32, block_size=4)
    sids, refs = [], []
    for p in prompts:
        sid, _ = cache.add(p[0].tolist())
        with cache.step([sid], p) as b:
            got = tiny(p, b)  # the batch supplies positions and mask
        ref_cache = DynamicCache(2)
        torch.testing.assert_close(got, tiny(p, ref_cache), rtol=1e-5, atol=1e-5)
        sids.append(sid)
        refs.append(ref_cache)
    for step in range(3):
        new = torch.randint(0, 50, (3, 1), generator=g).to(device)
        with cache.step(sids, new) as b:  # ragged: 3, 9 and 6 tokens held, T = 1
            got = tiny(new, b)[:, -1]  # (3, vocab), no positions= or mask= needed
        for i, rc in enumerate(refs):
            torch.testing.assert_close(got[i], tiny(new[i : i + 1], rc)[0, -1], rtol=1e-5, atol=1e-5)
    # a ragged multi-token step: two new tokens each after different lengths
    new = torch.randint(0, 50, (3, 2), generator=g).to(device)
    with cache.step(sids, new) as b:
        got = tiny(new, b)
    for i, rc in enumerate(refs):
        torch.testing.assert_close(got[i], tiny(new[i : i + 1], rc)[0], rtol=1e-5, atol=1e-5)
    # explicit arguments still win, and are checked against the step's shape
    new = torch.randint(0, 50, (3, 1), generator=g).to(device)
    with cache.step(sids, new) as b:
        got = tiny(new, b, positions=b.positions(), mask=b.mask())[:, -1]
    for i, rc in enumerate(refs):
        torch.testing.assert_close(got[i], tiny(new[i : i + 1], rc)[0, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"mask must be bool \(3 or 1, 1, 1, 16\)"):
        tiny(new, cache.step(sids, new), mask=torch.ones(3, 1, 1, 4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=r"positions must be \(B, T\)=\(3, 1\)"):
        tiny(new, cache.step(sids, new), positions=torch.zeros(2, 1, dtype=torch.long, device=device))
    cache.check()


# -- a packed step: ragged rows in one forward ---------------------------------------------------------
PACKED_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same sums in other shapes round differently, as above


def _filled(tiny, lengths, seed=0, num_blocks=32, block_size=4):
    """A cache (its free list scrambled) holding prompts of ``lengths``, and a DynamicCache per prompt."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedCache.for_model(tiny, num_blocks=num_blocks, block_size=block_size)  # on the model's device
    cache.allocator.reorder_free(random.Random(seed).sample(range(num_blocks), num_blocks))
    sids, refs = [], []
    for n in lengths:
        p = torch.randint(0, 50, (1, n), generator=g).to(tiny.device)
        sid, _ = cache.add(p[0].tolist())
        with cache.step([sid], p) as b:
            tiny(p, b)
        ref = DynamicCache(2)
        tiny(p, ref)
        sids.append(sid)
        refs.append(ref)
    return cache, sids, refs


@pytest.mark.parametrize("varlen", [True, False])
def test_packed_paged_step_equals_contiguous_attention_and_the_rectangular_step(tiny, device, varlen):
    """Sequences holding 3, 9 and 6 tokens bring 1, 4 and 2 new ones (a decode token and two
    prompt chunks) in ONE packed forward ``(1, 7)``: each sequence's logits and stored K/V equal
    a DynamicCache's for it alone. Then a decode step for all three, packed, equals the
    rectangular PagedBatch's on the same cache. Tolerance: PACKED_TOL (fp32, rtol = atol = 1e-5).
    Both ways of attending: sequence by sequence (varlen), and the row under the mask."""
    cache, sids, refs = _filled(tiny, (3, 9, 6))
    rows = [[7], [1, 2, 3, 4], [5, 6]]
    ids = torch.tensor([[t for r in rows for t in r]], device=device)  # (1, 7): no pad anywhere
    with cache.step(sids, rows, packed=True, varlen=varlen) as b:
        assert b.positions().tolist() == [[3, 9, 10, 11, 12, 6, 7]]  # each continues from its own length
        assert b.cu_seqlens_q.tolist() == [0, 1, 5, 7] and b.cu_seqlens_k.tolist() == [0, 4, 17, 25]
        assert b.block_mask().shape == (1, 1, 7, 25) and b.get_seq_length() == 18
        assert (b.mask() is None) == varlen  # a varlen step attends by itself: the model passes no mask
        assert torch.equal(b.block_mask()[0, 0], packed_mask(b.cu_seqlens_q, b.cu_seqlens_k))  # kvlib.packed's
        got = tiny(ids, b)[0]  # (7, vocab); the batch supplies positions and mask
    starts = [0, 1, 5]
    for r, rc, s0, sid in zip(rows, refs, starts, sids):
        torch.testing.assert_close(got[s0 : s0 + len(r)], tiny(torch.tensor([r], device=device), rc)[0], **PACKED_TOL)
        for layer in range(2):
            torch.testing.assert_close(cache.layer_kv(sid, layer), rc.layer_kv(layer), **PACKED_TOL)
    new = [[11], [12], [13]]
    with cache.step(sids, new) as b:  # rectangular (3, 1)
        rect = tiny(torch.tensor(new, device=device), b)[:, -1]  # (3, vocab)
    for sid in sids:
        cache.truncate(sid, cache.num_tokens(sid) - 1)  # roll the step back, and run it packed
    with cache.step(sids, new, packed=True, varlen=varlen) as b:
        packed = tiny(torch.tensor([[11, 12, 13]], device=device), b, logits_at=[0, 1, 2])[0]  # (3, vocab)
    torch.testing.assert_close(packed, rect, **PACKED_TOL)
    cache.check()


def test_a_packed_row_may_hold_more_tokens_than_max_seq_len(tiny, device):
    """max_seq_len bounds each sequence, not the packed row: three sequences of 60 hold 180 keys."""
    cache, sids, refs = _filled(tiny, (59, 59, 59), num_blocks=64, block_size=16)
    with cache.step(sids, [[1], [2], [3]], packed=True) as b:
        assert b.get_seq_length() == 177 > tiny.config.max_seq_len
        got = tiny(torch.tensor([[1, 2, 3]], device=device), b)[0]
    for i, rc in enumerate(refs):
        torch.testing.assert_close(got[i], tiny(torch.tensor([[i + 1]], device=device), rc)[0, -1], **PACKED_TOL)
    cache, sids, _ = _filled(tiny, (120, 5), num_blocks=64, block_size=16)
    with pytest.raises(ValueError, match="a sequence of 130 tokens exceeds max_seq_len=128"):
        tiny(torch.tensor([[1] * 10 + [2]], device=device), cache.step(sids, [[1] * 10, [2]], packed=True))


def test_a_packed_step_writes_each_sequence_its_own_number_of_tokens(device):
    """One packed step appends 1, 3, 5 and 2 tokens to four sequences (one empty, one a fork
    sharing a partial block): each reads back exactly its tokens' K/V through its table, the
    fork's shared block is copied once, and the step takes exactly blocks_needed blocks."""
    cache = PagedCache(2, 2, 3, num_blocks=24, block_size=4, prefix_caching=False)
    cache.allocator.reorder_free(random.Random(1).sample(range(24), 24))
    a, b = start(cache, [1, 2, 3]), start(cache, list(range(10)))
    c, f = cache.add()[0], cache.fork(a)
    sids, rows = [a, b, c, f], [[4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    before = {s: cache.tokens(s) for s in sids}
    need, free = cache.blocks_needed(sids, [1, 3, 5, 2]), cache.allocator.num_free
    vals = [prefix_values(before[s] + r)[-len(r):] for s, r in zip(sids, rows)]
    k = torch.tensor([v for vs in vals for v in vs], device=device).view(1, 1, -1, 1).expand(1, 2, 11, 3).contiguous()
    with cache.step(sids, rows, packed=True) as batch:
        for layer in range(2):
            batch.update(k, -k, layer)
    assert need == 5 and cache.allocator.num_free == free - need and cache.copies == 1  # 1 copy, 4 new blocks
    for s, r in zip(sids, rows):
        assert cache.tokens(s) == before[s] + r
        assert_holds(cache, s)
    assert cache.block_table(f)[0] != cache.block_table(a)[0]  # a and its fork no longer share the partial block
    cache.check()


def test_a_refused_packed_step_changes_nothing(tiny, device):
    """OutOfBlocks at step(), a forward that fails in its second layer, an incomplete commit,
    a second commit and a stale batch: the tables, the free list and every pool byte stay."""
    cache, sids, _ = _filled(tiny, (3, 9), num_blocks=6, block_size=4)  # 4 blocks held, 2 free
    f = cache.fork(sids[0])  # shares a partial block: a write to it must copy
    sids = sids + [f]

    def state():
        return ([cache.block_table(s) for s in sids], [cache.tokens(s) for s in sids], cache.allocator.free_order(),
                cache.copies, cache.version, [t.clone() for t in cache.keys + cache.values])

    def same(x, y):
        return x[:5] == y[:5] and all(torch.equal(p, q) for p, q in zip(x[5], y[5]))

    before = state()
    with pytest.raises(OutOfBlocks, match="needs 3 blocks but only 2 are free"):  # a copy and 2 new blocks
        cache.step(sids, [[1], [2] * 8, [5]], packed=True)
    assert same(state(), before)
    real = tiny.layers[1].forward
    tiny.layers[1].forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("layer 1 failed"))
    try:
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            with cache.step(sids, [[1], [2], [5]], packed=True) as batch:
                tiny(torch.tensor([[1, 2, 5]], device=device), batch)
    finally:
        tiny.layers[1].forward = real
    assert same(state(), before)
    batch = cache.step(sids, [[1], [2], [5]], packed=True)
    batch.update(torch.ones(1, 2, 3, 8, device=device), torch.ones(1, 2, 3, 8, device=device), 1)
    with pytest.raises(ValueError, match=r"layers \[0\] were never written"):
        batch.commit()
    assert same(state(), before)
    stale = cache.step(sids, [[1], [2], [5]], packed=True)
    cache.fork(sids[1])  # the tables change after it was made
    before = state()
    with pytest.raises(ValueError, match="PackedPagedBatch is stale"):
        stale.update(torch.ones(1, 2, 3, 8, device=device), torch.ones(1, 2, 3, 8, device=device), 0)
    assert same(state(), before)
    with cache.step(sids, [[1], [2], [5]], packed=True) as batch:
        tiny(torch.tensor([[1, 2, 5]], device=device), batch)
    with pytest.raises(ValueError, match="PackedPagedBatch was already committed"):
        batch.commit()
    cache.check()


def test_bad_inputs_to_a_packed_step(tiny, device):
    cache, (a, b), _ = _filled(tiny, (3, 5))
    with pytest.raises(ValueError, match=r"one non-empty token list per sequence \(2\), got lengths \[1, 0\]"):
        cache.step([a, b], [[1], []], packed=True)
    with pytest.raises(ValueError, match=r"per sequence \(1\), got lengths \[1, 1\]"):
        cache.step([a], [[1], [2]], packed=True)
    with pytest.raises(TypeError, match="tokens must be int ids, got float 1.5"):
        cache.step([a], [[1.5]], packed=True)
    with pytest.raises(TypeError, match="must each be True or False, got packed='yes'"):
        cache.step([a], [[1]], packed="yes")
    with pytest.raises(ValueError, match=r"got \[1, 2\]; steps of different lengths go in one packed step"):
        cache.step([a, b], [[1], [2, 3]])
    with pytest.raises(ValueError, match="1 token counts for 2 sequences"):
        cache.blocks_needed([a, b], [1])
    batch = cache.step([a, b], [[1], [2, 3]], packed=True)
    with pytest.raises(ValueError, match=r"holds 3 new tokens \(\[1, 2\] per sequence\) as one row \(1, 3\), "
                                         r"got tokens of shape \(2, 2\)"):
        tiny(torch.tensor([[1, 2], [2, 3]], device=device), batch)
    with pytest.raises(ValueError, match=r"holds 3 new tokens \(\[1, 2\] per sequence\) but update got 2"):
        batch.update(torch.zeros(1, 2, 2, 8, device=device), torch.zeros(1, 2, 2, 8, device=device), 0)
    with pytest.raises(ValueError, match="batch=1 but update"):
        batch.update(torch.zeros(2, 2, 3, 8, device=device), torch.zeros(2, 2, 3, 8, device=device), 0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_blocks", [None, "tight"])
def test_engine_tokens_equal_generate(tiny, block_size, num_blocks, device):
    """Greedy tokens from the batched paged engine equal kvlib.generate run on each prompt
    alone, with a roomy pool and with one so tight that sequences are preempted."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(50) for _ in range(n)] for n in (5, 17, 33, 8, 2)]
    ref = [kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    blocks = 400 // block_size if num_blocks is None else -(-45 // block_size) + 1  # the longest needs 45 slots
    cache = PagedCache.for_model(tiny, num_blocks=blocks, block_size=block_size)
    eng = Engine(tiny, cache)
    for p in prompts:
        eng.add(p, 12)
    out = eng.run()
    assert [out[i][0] for i in range(len(prompts))] == ref
    assert eng.stats.peak_batch >= 2  # sequences of different lengths really shared a step
    if num_blocks == "tight":
        assert eng.stats.preemptions > 0
    assert cache.allocator.num_used == 0 and not cache.seqs
    cache.check()


def test_engine_parallel_sampling_shares_the_prompt(tiny):
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks of 4 and a partial one
    cache = PagedCache.for_model(tiny, num_blocks=64, block_size=4)
    eng = Engine(tiny, cache, generator=torch.Generator().manual_seed(0))
    eng.add(prompt, 6, n=4, temperature=1.0)
    eng.step()  # prefill once and fork
    assert len(cache.seqs) == 4 and cache.allocator.num_used == 8  # one copy of the prompt for four samples
    eng.run()
    outs = eng.requests[0].outputs
    assert len(outs) == 4 and all(len(o) == 6 for o in outs)
    assert len({tuple(o) for o in outs}) > 1  # sampled, so the samples differ
    assert cache.copies == 3  # three forks copied the shared partial block; the last writer kept it


def test_engine_greedy_forks_stay_identical(tiny, device):
    """Four greedy samples share a prompt copy-on-write; if one fork's writes leaked into
    another's blocks, their tokens would drift apart from plain generation."""
    prompt = list(range(1, 31))
    ref = kvlib.generate(tiny, torch.tensor([prompt], device=device), max_new_tokens=10)[0, 30:].tolist()
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=64, block_size=4))
    eng.add(prompt, 10, n=4)
    assert eng.run()[0] == [ref] * 4


def test_engine_reuses_a_shared_system_prompt(tiny, device):
    system = list(range(1, 33))  # 32 tokens = 8 full blocks of 4
    cache = PagedCache.for_model(tiny, num_blocks=64, block_size=4)
    eng = Engine(tiny, cache)
    for q in ([40, 41], [42, 43, 44], [45]):
        eng.add(system + q, 4)
    out = eng.run()
    assert eng.stats.cached_tokens == 2 * 32  # the second and third requests skip the system prompt
    for i, q in enumerate(([40, 41], [42, 43, 44], [45])):
        ids = torch.tensor([system + q], device=device)
        assert out[i][0] == kvlib.generate(tiny, ids, max_new_tokens=4)[0, ids.shape[1]:].tolist()


def test_engine_requeues_a_request_whose_prefill_fails(tiny, device):
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache)
    eng.add([1, 2, 3, 4, 5], 3)
    real = tiny.forward
    tiny.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            eng.step()
    finally:
        del tiny.forward  # back to the class's forward
    assert len(eng.scheduler.waiting) == 1 and not cache.seqs and cache.allocator.num_used == 0
    ref = kvlib.generate(tiny, torch.tensor([[1, 2, 3, 4, 5]], device=device), max_new_tokens=3)[0, 5:].tolist()
    assert eng.run()[0][0] == ref


def test_engine_sampling_under_preemption_and_stop_tokens(tiny):
    """n > 1, temperature > 0, a tight pool, stop tokens, prefix caching on and off: every
    request finishes, nothing leaks, and the bookkeeping stays consistent."""
    for prefix in (True, False):
        cache = PagedCache.for_model(tiny, num_blocks=12, block_size=2, prefix_caching=prefix)
        eng = Engine(tiny, cache, stop=[0, 1], generator=torch.Generator().manual_seed(1), max_batch=6)
        rng = random.Random(0)
        for _ in range(6):
            eng.add([rng.randrange(50) for _ in range(rng.randint(1, 6))], 8, n=rng.randint(1, 3), temperature=1.0)
        steps = 0
        while not eng.finished:
            eng.step()
            cache.check()
            steps += 1
            assert steps < 500
        for req in eng.requests.values():
            assert all(req.done) and all(1 <= len(o) <= 8 for o in req.outputs)
            assert all(len(o) == 8 or o[-1] in (0, 1) for o in req.outputs)
        assert cache.allocator.num_used == 0 and eng.stats.preemptions > 0


def test_engine_stop_token(tiny, device):
    prompt = [3, 1, 4, 1, 5]
    ref = kvlib.generate(tiny, torch.tensor([prompt], device=device), max_new_tokens=10)[0, 5:].tolist()
    stop = ref[3]
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=16, block_size=4), stop=[stop])
    eng.add(prompt, 10)
    got = eng.run()[0][0]
    assert got == ref[: ref.index(stop) + 1]


@pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")
def test_engine_on_smollm2_matches_generate(smollm2, device):
    """The real model: three prompts of different lengths decoded in one batch over 16-token
    blocks give exactly the tokens kvlib.generate gives each prompt alone."""
    model, tok = smollm2
    texts = ["The capital of France is", "Water boils at a temperature of one hundred", "1, 2, 3,"]
    prompts = [tok.encode(t) for t in texts]
    ref = [kvlib.generate(model, torch.tensor([p], device=device), max_new_tokens=8)[0, len(p):].tolist() for p in prompts]
    cache = PagedCache.for_model(model, num_blocks=16, block_size=16, device=device)
    eng = Engine(model, cache)
    for p in prompts:
        eng.add(p, 8)
    out = eng.run()
    assert [out[i][0] for i in range(3)] == ref
    assert eng.stats.peak_batch == 3


# -- issue 45: commit inside `with`, the copy-on-write bytes, for_model, no import cycle -----------------
@torch.inference_mode()
def test_commit_inside_the_with_block_stores_the_step_once(tiny, device):
    """0.4: batch.commit() inside `with` stored the step, then the `with`'s exit raised "already
    committed", so a caller who retried appended the tokens twice."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    a, _ = cache.add()
    ids = torch.tensor([[1, 2, 3]], device=device)
    with cache.step([a], ids) as batch:
        tiny(ids, batch)
        batch.commit()  # allowed: the end of the block stores nothing more
        assert batch.committed and cache.tokens(a) == [1, 2, 3]
    assert cache.tokens(a) == [1, 2, 3] and cache.open_step is None
    cache.check()
    with pytest.raises(ValueError, match="already committed"):
        batch.commit()  # and never twice
    assert cache.tokens(a) == [1, 2, 3]
    with cache.step([a], torch.tensor([[4]], device=device)) as batch:  # the cache goes on
        tiny(torch.tensor([[4]], device=device), batch)
    assert cache.tokens(a) == [1, 2, 3, 4]


@torch.inference_mode()
def test_an_error_after_a_commit_inside_the_block_keeps_the_stored_step(tiny, device):
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    a, _ = cache.add()
    with pytest.raises(RuntimeError, match="after the commit"):
        with cache.step([a], [[1, 2]]) as batch:
            tiny(torch.tensor([[1, 2]], device=device), batch)
            batch.commit()
            raise RuntimeError("after the commit")
    assert cache.tokens(a) == [1, 2] and cache.open_step is None
    cache.check()


@torch.inference_mode()
@pytest.mark.parametrize("packed", [False, True])
def test_bytes_written_counts_the_copy_on_write_block(tiny, packed, device):
    """0.4: a step that wrote into a shared block reported only its new K/V: the block copy
    (block_size slots of every layer, keys and values) was missing from bytes_written."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    a, _ = cache.add()
    with cache.step([a], [[1, 2, 3, 4, 5, 6]]) as batch:
        tiny(torch.tensor([[1, 2, 3, 4, 5, 6]], device=device), batch)
    b = cache.fork(a)  # shares the partial block 1: b's next token copies it
    ids = torch.tensor([[7]], device=device)
    with cache.step([b], [[7]], packed=packed) as batch:
        tiny(ids, batch)
    cfg = tiny.config
    new_kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4  # one token, fp32, K and V, every layer
    assert cache.copies == 1
    assert batch.bytes_written == new_kv + cache.block_bytes, (batch.bytes_written, new_kv, cache.block_bytes)
    with cache.step([a], [[8]], packed=packed) as batch:  # a is alone in its block again: written in place
        tiny(ids, batch)
    assert cache.copies == 1 and batch.bytes_written == new_kv


def test_for_model_takes_a_model_or_a_config_and_follows_the_models_dtype(device):
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=64)
    model = Transformer(cfg, dtype=torch.bfloat16)
    from_model = PagedCache.for_model(model, num_blocks=4, block_size=4)
    assert from_model.dtype == torch.bfloat16 and from_model.device == model.device
    assert PagedCache.for_model(cfg, num_blocks=4, device=device).dtype == torch.float32  # a config: fp32 on the CPU
    assert PagedCache.for_model(model, 4, dtype=torch.float16, prefix_caching=False).dtype == torch.float16
    assert (from_model.n_layer, from_model.n_kv_head, from_model.head_dim) == (2, 2, 8)
    with pytest.raises(TypeError, match="Transformer or a kvlib.ModelConfig"):
        PagedCache.for_model("tiny", num_blocks=4)


def test_the_batch_module_does_not_import_the_cache_module():
    """0.4: paged.batch imported paged.cache for a type hint and called its privates, and the cache
    called the batch's: the step's checks now live in the batch, which asks the cache only to store."""
    import ast
    from pathlib import Path

    import kvlib.paged.batch as batch_module
    import kvlib.paged.cache as cache_module

    tree = ast.parse(Path(batch_module.__file__).read_text(encoding="utf-8"))
    imported = {(n.level, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert (1, "cache") not in imported, imported  # `from .cache import ...` (kvlib.paged.cache): the cycle
    cache_src = Path(cache_module.__file__).read_text(encoding="utf-8")
    assert "._check_fresh" not in cache_src and "batch.committed = " not in cache_src
