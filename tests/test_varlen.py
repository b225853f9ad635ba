"""Varlen attention of a packed paged step (`kvlib.paged.varlen`): each sequence over its own keys.

References: `kvlib.packed.packed_attention` (one segment at a time over contiguous keys) and
SDPA over the whole row under the block-diagonal mask (`varlen=False`, the step before 0.6).
Every block no sequence of the step owns holds large garbage, so a query that saw a key
outside its own sequence (another's, or a padding slot) would move far past the tolerance.
Tolerance: fp32, rtol = 1e-5, atol = 1e-6 (different summation orders), widened on CUDA by `tol`.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.attention import attention
from kvlib.engine import Engine
from kvlib.packed import cu_seqlens, packed_attention
from kvlib.paged import PagedCache
from kvlib.paged.varlen import VarlenPlan, paged_varlen_attention
from devices import tol

pytestmark = pytest.mark.device
TOL = dict(rtol=1e-5, atol=1e-6)


def _step(lengths, counts, block_size, H, H_kv, D, seed, device):
    """A random pool, each sequence's blocks scattered through it, garbage everywhere else;
    returns the inputs of `paged_varlen_attention` and the contiguous keys of each sequence."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(n + c) // block_size) for n, c in zip(lengths, counts)]
    num_blocks = sum(need) + 3
    k_pool = torch.full((num_blocks, block_size, H_kv, D), 1e4)  # garbage: seen, it swamps the softmax
    v_pool = torch.full((num_blocks, block_size, H_kv, D), -1e4)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, ks, vs = [], [], []
    for n, blocks in zip(lengths, need):
        table = [free.pop() for _ in range(blocks)]
        k, v = torch.randn(n, H_kv, D, generator=g), torch.randn(n, H_kv, D, generator=g)
        for t in range(n):
            k_pool[table[t // block_size], t % block_size] = k[t]
            v_pool[table[t // block_size], t % block_size] = v[t]
        # a decode's or chunk's new blocks are not reserved until the commit: the step sees only the held ones
        tables.append(table[: -(-n // block_size)])
        ks.append(k)
        vs.append(v)
    N = sum(counts)
    q = torch.randn(1, H, N, D, generator=g)
    k_new, v_new = torch.randn(1, H_kv, N, D, generator=g), torch.randn(1, H_kv, N, D, generator=g)
    kv_bytes = 2 * H_kv * D * 4
    plan = VarlenPlan.build(tables, lengths, counts, block_size, kv_bytes, torch.device(device))
    to = dict(device=device)
    return ([x.to(**to) for x in (q, k_new, v_new, k_pool, v_pool)], plan, ks, vs)


def _reference(q, k_new, v_new, ks, vs, lengths, counts):
    """`packed_attention` over each sequence's keys laid out contiguously: cached, then new."""
    rows_k, rows_v, at = [], [], 0
    for k, v, c in zip(ks, vs, counts):
        rows_k += [k.to(q.device), k_new[0, :, at:at + c].transpose(0, 1)]
        rows_v += [v.to(q.device), v_new[0, :, at:at + c].transpose(0, 1)]
        at += c
    totals = [n + c for n, c in zip(lengths, counts)]
    y = packed_attention(q[0].transpose(0, 1), torch.cat(rows_k), torch.cat(rows_v),
                         cu_seqlens(counts, device=q.device), cu_seqlens(totals, device=q.device))
    return y.transpose(0, 1)[None]  # (1, H, N, D)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 1, 1, 2, 5, 9])), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    heads=st.sampled_from([(4, 4), (6, 2), (4, 1)]),
    seed=st.integers(0, 10**6),
)
def test_varlen_attention_equals_each_sequence_alone(seqs, block_size, heads, seed, device):
    """Any mix of decodes (1 new token) and chunks (several), with or without cached keys, any
    block size, MHA/GQA/MQA: equal to `packed_attention` over each sequence's own keys."""
    lengths = [n if c > 1 else max(n, 1) for n, c in seqs]  # a decode row continues a sequence
    counts = [c for _, c in seqs]
    H, H_kv = heads
    (q, k_new, v_new, k_pool, v_pool), plan, ks, vs = _step(lengths, counts, block_size, H, H_kv, 8, seed, device)
    got = paged_varlen_attention(q, k_new, v_new, k_pool, v_pool, plan)
    torch.testing.assert_close(got, _reference(q, k_new, v_new, ks, vs, lengths, counts), **tol(device, **TOL))


def test_the_plan_splits_decodes_from_chunks_and_counts_what_it_copies(device):
    """Rows: a decode (5 held), a chunk of 3 with 6 held, a fresh chunk of 4, a decode (1 held),
    blocks of 4. Decodes gather their keys' slots padded to the longest (5 held + the new key:
    6 each); the held chunk gathers its 6 keys; the fresh chunk attends where its keys lie."""
    tables = [[3, 7], [1, 2], [], [5]]
    plan = VarlenPlan.build(tables, [5, 6, 0, 1], [1, 3, 4, 1], 4, 10, torch.device(device))
    assert plan.decode_at.tolist() == [0, 8] and plan.decode_cols.tolist() == [5, 1]
    # block 3 holds slots 12..15, block 7 slots 28..31, block 5 slots 20..23; slot 0 pads (masked)
    assert plan.decode_slots.tolist() == [12, 13, 14, 15, 28, 0, 20, 0, 0, 0, 0, 0]
    assert plan.decode_mask[:, 0, 0].tolist() == [[True] * 6, [True, True] + [False] * 4]
    assert [(a, c, None if s is None else s.tolist()) for a, c, s in plan.chunks] == [
        (1, 3, [4, 5, 6, 7, 8, 9]), (4, 4, None)]
    assert plan.bytes_copied_per_layer == (2 * 6 + 6) * 10


def _engine_run(model, prompts, budget, block_size, varlen, device):
    cache = PagedCache.for_model(model, num_blocks=400 // block_size + 8, block_size=block_size)
    eng = Engine(model, cache, token_budget=budget, varlen=varlen)
    rids = [eng.add(p, 6) for p in prompts]
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out.detach().clone()))
    try:
        out = eng.run()
    finally:
        hook.remove()
    return [out[r][0] for r in rids], logits, eng


@settings(max_examples=12, deadline=None)
@given(
    budget=st.sampled_from([None, 3, 8, 40]),
    block_size=st.sampled_from([1, 4, 16]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
)
def test_the_engine_gives_the_masked_steps_logits_sequence_by_sequence(tiny_model, budget, block_size, lengths,
                                                                        device):
    """Whatever the budget (chunked or not), block size and prompt lengths: the varlen Engine's
    scored logits equal the masked row's, step for step, and so do the tokens."""
    rng = random.Random(sum(lengths))
    prompts = [[rng.randrange(50) for _ in range(n)] for n in lengths]
    a, la, _ = _engine_run(tiny_model, prompts, budget, block_size, True, device)
    b, lb, _ = _engine_run(tiny_model, prompts, budget, block_size, False, device)
    assert a == b and len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **tol(device, rtol=1e-5, atol=1e-5))


def test_what_a_packed_step_copies_out_of_the_pool(tiny_model, device):
    """Four prompts of 12 tokens, then a decode step: the masked row gathers every cached key once
    per layer; the varlen step gathers each decode's 12 keys and the slot its new key takes."""
    c = tiny_model.config
    copied = {}
    for varlen in (False, True):
        cache = PagedCache.for_model(tiny_model, num_blocks=32, block_size=8)
        sids = [cache.add([1] * 12)[0] for _ in range(4)]
        with cache.step(sids, [[1] * 12] * 4, packed=True, varlen=varlen) as b:
            tiny_model(torch.tensor([[1] * 48], device=device), b)
        assert b.bytes_copied == 0  # fresh prompts: their keys are attended where they lie (or not held)
        with cache.step(sids, [[2]] * 4, packed=True, varlen=varlen) as b:
            tiny_model(torch.tensor([[2] * 4], device=device), b)
        copied[varlen] = b.bytes_copied
    token = 2 * c.n_kv_head * c.head_dim * 4 * c.n_layer  # K and V, fp32, every layer
    assert copied[False] == 4 * 12 * token  # the 48 cached keys, once per layer
    assert copied[True] == 4 * 13 * token  # 12 keys and the new key's place, for each of the 4


def test_a_kernel_of_your_own_gets_the_row_and_the_block_mask(tiny_model, device):
    """`set_attention_impl` with a function: a varlen step hands it the whole row and the
    block-diagonal mask (it cannot know the segments), and the result is the same."""
    seen = []

    def mine(q, k, v, mask):
        seen.append(tuple(mask.shape))
        return attention(q, k, v, mask)

    cache = PagedCache.for_model(tiny_model, num_blocks=16, block_size=4)
    sids = [cache.add([1, 2, 3])[0], cache.add([4, 5])[0]]
    with cache.step(sids, [[1, 2, 3], [4, 5]], packed=True) as b:
        want = tiny_model(torch.tensor([[1, 2, 3, 4, 5]], device=device), b)
    cache.free(sids[0]), cache.free(sids[1])
    sids = [cache.add([1, 2, 3])[0], cache.add([4, 5])[0]]
    tiny_model.set_attention_impl(mine)
    try:
        with cache.step(sids, [[1, 2, 3], [4, 5]], packed=True) as b:
            got = tiny_model(torch.tensor([[1, 2, 3, 4, 5]], device=device), b)
    finally:
        tiny_model.set_attention_impl("sdpa")
    assert seen == [(1, 1, 5, 5)] * tiny_model.config.n_layer
    torch.testing.assert_close(got, want, **tol(device, rtol=1e-5, atol=1e-5))


def test_bad_varlen_flags_are_refused(tiny_model):
    cache = PagedCache.for_model(tiny_model, num_blocks=4, block_size=4)
    with pytest.raises(TypeError, match="varlen must be True or False, got 1"):
        Engine(tiny_model, cache, varlen=1)
    sid, _ = cache.add([1])
    with pytest.raises(TypeError, match="must each be True or False, got packed=True, varlen='yes'"):
        cache.step([sid], [[1]], packed=True, varlen="yes")
