"""Tensor parallelism and disaggregated prefill/decode (`kvlib.distributed`), on processes.

References: one process running the whole model (tokens, logits, cache bytes), the
cache-size formula (`kvlib.memory.kv_cache_bytes`), and the all-reduce formula. Worker
processes are started by `kvlib.distributed.launch`, which stops them by their ids; every
launch here is checked to leave none running.
"""

import multiprocessing
import time

import pytest
import torch

import kvlib
from kvlib.distributed import disagg, tp
from kvlib.distributed.launch import Launch, launch

pytestmark = pytest.mark.cpu_only("torch.distributed over gloo processes on the CPU")

TINY = kvlib.ModelConfig(n_layer=2, n_head=8, n_kv_head=2, d_model=64, d_ff=128, vocab_size=128,
                         max_seq_len=64, name="tiny")


# -- the split itself, no processes -----------------------------------------------------------------
def test_plan_splits_heads_and_replicates_kv_heads_when_ranks_outnumber_them():
    smol = kvlib.PRESETS["smollm2-135m"]
    three = tp.plan(smol, 3)
    assert [s.q_heads for s in three] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert [s.kv_heads for s in three] == [(0,), (1,), (2,)] and {s.replicas for s in three} == {1}
    assert [s.ff for s in three] == [(0, 512), (512, 1024), (1024, 1536)]
    four = tp.plan(TINY, 4)  # 2 KV heads, 4 ranks: each KV head on 2 ranks
    assert [s.kv_heads for s in four] == [(0,), (0,), (1,), (1,)] and {s.replicas for s in four} == {2}
    for size in (1, 2, 4, 8):
        shards = tp.plan(TINY, size)
        group = TINY.n_head // TINY.n_kv_head
        assert sorted(h for s in shards for h in s.q_heads) == list(range(TINY.n_head))
        assert all(h // group in s.kv_heads for s in shards for h in s.q_heads)  # reads only what it holds


@pytest.mark.parametrize("config, size, words", [
    (kvlib.PRESETS["smollm2-135m"], 2, "9 query heads do not divide among 2"),
    (kvlib.PRESETS["smollm2-135m"], 4, "9 query heads do not divide among 4"),
    (kvlib.PRESETS["smollm2-135m"], 9, "d_ff=1536 does not divide among 9"),
    (TINY.replace(n_head=12, n_kv_head=4), 6, "size 6 exceeds the 4 KV heads but is not a multiple"),
])
def test_sizes_vllm_refuses_are_refused_with_the_rule(config, size, words):
    with pytest.raises(ValueError, match=words):
        tp.plan(config, size)
    with pytest.raises(ValueError, match="positive"):
        tp.plan(config, 0)


def test_a_ranks_cache_is_its_share_of_the_formula():
    smol = kvlib.PRESETS["smollm2-135m"]
    whole = kvlib.memory.kv_cache_bytes(smol, 1000, dtype="bf16")
    assert 3 * kvlib.memory.kv_cache_bytes(tp.local_config(smol, 3), 1000, dtype="bf16") == whole
    tiny4 = kvlib.memory.kv_cache_bytes(tp.local_config(TINY, 4), 1000)
    assert 2 * tiny4 == kvlib.memory.kv_cache_bytes(TINY, 1000)  # replicated: half, not a quarter


def test_the_ranks_partial_outputs_sum_to_the_whole_layer():
    """Each rank's attention and MLP without its all-reduce; their sum is the full block's."""
    model = kvlib.Transformer(TINY)
    model.reset_parameters(seed=1, std=0.2)
    x = torch.randn(1, 5, TINY.d_model)
    pos = torch.arange(5)[None]
    cos, sin = (t[:, :, None] for t in kvlib.model.rope_cos_sin(pos, TINY.head_dim, TINY.rope_base))
    full = model.layers[0]
    for size in (2, 4, 8):
        attn = mlp = 0
        for rank in range(size):
            mine = tp.shard(model, rank, size).layers[0]
            mine.attn.wo, mine.mlp.w_down = mine.attn.wo.linear, mine.mlp.w_down.linear  # no all-reduce
            attn = attn + mine.attn(x, cos, sin, None, None)
            mlp = mlp + mine.mlp(x)
        torch.testing.assert_close(attn, full.attn(x, cos, sin, None, None), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mlp, full.mlp(x), atol=1e-5, rtol=1e-5)


# -- on processes -----------------------------------------------------------------------------------
def reference(source, prompts, n_new):
    model = tp.build(source)
    runs = []
    for prompt in prompts:
        cache = kvlib.StaticCache.for_model(model.config, 1, len(prompt) + n_new)
        runs.append((*tp.greedy(model, prompt, n_new, cache), cache.nbytes))
    return model.config, runs


@pytest.mark.parametrize("source, size, prompts", [
    ((TINY, 0), 4, [[1, 2, 3, 4, 5], [9, 8, 7]]),  # KV heads replicated
    ("smollm2", 3, [[1, 504, 3458, 282, 253, 2736], [504, 1142, 314, 253, 1686, 30, 378, 2630, 314]]),
], ids=["tiny-size4-replicated", "smollm2-size3"])
def test_tensor_parallel_tokens_bytes_and_all_reduces_equal_one_process(source, size, prompts):
    n_new = 12
    config, runs = reference(source, prompts, n_new)
    run = launch(tp.generate_worker, size, source, prompts, n_new, timeout=240)
    assert run.stopped()
    rank0 = run.results[0]
    for i, (tokens, logits, nbytes) in enumerate(runs):
        # The all-reduce adds the ranks' partial sums in another order than one matmul does:
        # last bits differ (chapter 2b), within fp32's rounding over d_ff and H*D terms.
        torch.testing.assert_close(rank0["logits"][i], logits, atol=1e-3, rtol=1e-4)
        assert all(r["tokens"][i] == tokens for r in run.results)  # every rank, the same greedy tokens
        held = [r["cache_bytes"][i] * config.n_kv_head // len(r["shard"].kv_heads) for r in run.results]
        assert held == [nbytes] * size  # each rank: its KV heads' share of one process's cache
    replicas = max(1, size // config.n_kv_head)
    assert sum(r["cache_bytes"][0] for r in run.results) == replicas * runs[0][2]
    steps = sum(len(p) + n_new - 1 for p in prompts)  # positions run: each prompt, then n_new - 1 decodes
    for r in run.results:
        assert r["allreduce_calls"] == 2 * config.n_layer * n_new * len(prompts)  # two per block per forward
        assert r["allreduce_bytes"] == tp.allreduce_bytes(config, steps)


def test_disaggregated_decode_continues_with_identical_tokens_and_the_formulas_bytes(smollm2):
    model, tok = smollm2
    prompt = tok.encode(kvlib.data.tiny_shakespeare("val")[:400])[:48]
    n_new = 10
    with kvlib.timing.threads(1):  # as the workers run: the same program and thread count, the same bits
        single = kvlib.generate(model, prompt, n_new)[0, len(prompt):].tolist()
    trials = [(True, None), (False, 2.0)]
    run = launch(disagg.worker, 2, "smollm2", prompt, n_new, trials, timeout=240)
    assert run.stopped()
    sent, got = run.results
    formula = kvlib.memory.kv_cache_bytes(model.config, len(prompt), dtype="fp32")
    for (overlap, _), p, d in zip(trials, sent, got):
        assert d["tokens"] == single  # the keys and values arrive bit for bit: the same greedy run
        assert p["sent_bytes"] == d["received_bytes"] == formula
        assert len(p["layer_sent_s"]) == model.config.n_layer
        if not overlap:  # every send starts once the prefill is done
            assert min(p["layer_sent_s"]) >= p["prefill_s"]


def test_overlap_hands_each_layer_over_before_the_next_layer_runs(tiny_model):
    """The hook fires per attention layer, in order, while later layers are still to run."""
    ran = []
    for block in tiny_model.layers:
        block.mlp.register_forward_hook(lambda m, i, o, layer=block.attn.layer: ran.append(("mlp", layer)))

    class Recorder:
        def put(self, layer, k, v):
            ran.append(("sent", layer, tuple(k.shape)))

    cache = kvlib.StaticCache.for_model(tiny_model.config, 1, 8)
    handles = disagg._hooks(tiny_model, cache, Recorder())
    try:
        tiny_model(torch.tensor([[1, 2, 3]]), cache)
    finally:
        for h in handles:
            h.remove()
        for block in tiny_model.layers:
            block.mlp._forward_hooks.clear()
    shape = (1, tiny_model.config.n_kv_head, 3, tiny_model.config.head_dim)
    assert ran == [("sent", 0, shape), ("mlp", 0), ("sent", 1, shape), ("mlp", 1)]


# -- the launcher -----------------------------------------------------------------------------------
def fails_on_rank_one(rank, size):
    if rank == 1:
        raise ArithmeticError("rank one's own error")
    torch.distributed.barrier()  # rank 0 would wait here for ever: the launch must stop it


def sleeps(rank, size):
    time.sleep(600)


def test_a_failing_worker_stops_the_launch_and_every_process():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*rank one's own error"):
        launch(fails_on_rank_one, 2, timeout=60)
    with pytest.raises(TimeoutError, match="did not finish in 8 s"):
        launch(sleeps, 2, timeout=8)
    assert not multiprocessing.active_children()  # both launches stopped every worker they started
    with pytest.raises(TypeError, match="module-level function"):
        launch(lambda rank, size: None, 2)
    with pytest.raises(ValueError, match="size"):
        launch(sleeps, 0)


def test_stopped_waits_for_the_workers_and_says_whether_any_is_left():
    import os
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert Launch([], [gone.pid], 0.0).stopped(grace=1.0)
    assert not Launch([], [os.getpid()], 0.0).stopped(grace=0.2)  # this process is running
