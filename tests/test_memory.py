import numpy as np
import pytest
import torch

import kvlib
from kvlib import PRESETS, StaticCache, Transformer, cost, memory

GiB = 2**30


def test_llama2_7b_2048_tokens_fp16_is_one_gib():
    # seed 002's figure: 2 * 32 layers * 2048 tokens * 32 heads * 128 dims * 2 bytes = 1 GiB
    assert memory.kv_cache_bytes(PRESETS["llama-2-7b"], 2048, 1, "fp16") == 1 * GiB


def test_one_layer_batch_32_context_4096_is_two_gib():
    one_layer = PRESETS["llama-2-7b"].replace(n_layer=1)
    assert memory.kv_cache_bytes(one_layer, 4096, 32, "fp16") == 2 * GiB


def test_gqa_shrinks_the_cache_by_the_group_size():
    # Llama-3-8B has the same layers and head_dim as Llama-2-7B but 8 KV heads instead of 32
    a = memory.kv_bytes_per_token(PRESETS["llama-2-7b"])
    b = memory.kv_bytes_per_token(PRESETS["llama-3-8b"])
    assert a == 4 * b == 512 * 1024  # 0.5 MiB per token for Llama-2-7B in fp16


def test_formula_equals_a_real_kvlib_cache():
    cfg = PRESETS["smollm2-135m"]
    cache = StaticCache.for_model(cfg, 2, 16, dtype=torch.float32)
    assert memory.kv_cache_bytes(cfg, 16, 2, "fp32") == cache.nbytes


@pytest.mark.smollm2
def test_formula_equals_smollm2_cache_after_generation(smollm2):
    import kvlib

    model, tok = smollm2
    cache = kvlib.DynamicCache(model.config.n_layer)
    ids = tok.encode("The cache grows by one token per step")
    kvlib.generate(model, ids, 5, cache=cache)
    assert cache.nbytes == memory.kv_cache_bytes(model.config, len(ids) + 4, 1, "fp32")


def test_published_parameter_counts():
    # independent figures: HF model cards / papers
    assert cost.param_count(PRESETS["gpt2"]) == 124_439_808
    assert cost.param_count(PRESETS["llama-2-7b"]) == 6_738_415_616
    assert cost.param_count(PRESETS["llama-3-8b"]) == 8_030_261_248
    assert cost.param_count(PRESETS["llama-3-70b"]) == 70_553_706_496
    assert cost.param_count(PRESETS["mistral-7b"]) == 7_241_732_096


def test_what_fits_on_an_80_gib_gpu():
    cfg = PRESETS["llama-2-7b"]
    per_seq = memory.kv_cache_bytes(cfg, 4096)  # 2 GiB per 4096-token sequence
    b = memory.max_batch(cfg, 80 * GiB, 4096)
    assert b * per_seq + memory.weight_bytes(cfg) <= 80 * GiB < (b + 1) * per_seq + memory.weight_bytes(cfg)
    with pytest.raises(ValueError, match="do not fit"):
        memory.max_tokens(PRESETS["llama-3-70b"], 80 * GiB)  # 141 GB of fp16 weights


def test_table_rows_and_bad_input():
    rows = memory.table(["llama-2-7b", "llama-3-8b"], seq_len=2048)
    assert rows[0]["kv_gib"] == 1.0 and rows[1]["kv_gib"] == 0.25
    with pytest.raises(ValueError, match="unknown preset"):
        memory.table(["gpt-5"])
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory.kv_cache_bytes(PRESETS["gpt2"], 10, dtype="fp12")
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        memory.max_batch(PRESETS["gpt2"], GiB, 0)


def test_param_count_matches_a_built_model():
    cfg = PRESETS["mistral-7b"]
    assert cost.param_count(cfg) == sum(p.numel() for p in Transformer(cfg, device="meta").parameters())


def test_vllm_papers_opt_13b_figures():
    # Kwon et al. 2023 (vLLM), section 3: "for the 13B parameter OPT model, the KV cache of a single
    # token demands 800 KB of space, calculated as 2 (key and value vectors) x 5120 (hidden state
    # size) x 40 (number of layers) x 2 (bytes per FP16)" and "up to 2048 tokens ... as much as 1.6 GB".
    # OPT-13B: 40 layers, 40 heads of 128 = 5120, multi-head attention, 2048-token context.
    opt13b = kvlib.ModelConfig(n_layer=40, n_head=40, n_kv_head=40, d_model=5120, d_ff=20480,
                               vocab_size=50272, max_seq_len=2048, family="gpt2", name="OPT-13B")
    assert memory.kv_bytes_per_token(opt13b, "fp16") == 800 * 1024  # "800 KB" is KiB
    per_request = memory.kv_cache_bytes(opt13b, 2048, 1, "fp16")
    assert per_request == 1600 * 2**20  # 1600 MiB: the paper's "1.6 GB" counts 1000 of its 1 MiB "MB" per GB


def test_gqa_papers_kv_head_counts_shrink_the_cache_by_the_group():
    # Ainslie et al. 2023: GQA-8 on a 64-head model keeps 8 KV heads, an 8x smaller cache than MHA.
    l70 = PRESETS["llama-3-70b"]
    mha = l70.replace(n_kv_head=l70.n_head)
    assert memory.kv_bytes_per_token(mha) == 8 * memory.kv_bytes_per_token(l70)


# -- the fragmentation simulator -------------------------------------------------------------------
def test_simulate_by_hand():
    """Two requests of 2 + 2 tokens hold 8-slot reservations in a 16-slot pool while a third
    waits. Step 0: 2 tokens each held, 2 more to come, 4 never used; step 1: 3, 1, 4.
    Averaged over those two saturated steps: token states 5/16, reserved 3/16, internal 8/16."""
    trace = [memory.TraceRequest(2, 2)] * 3
    r = memory.simulate(trace, "max", memory_slots=16, max_len=8)
    assert r.saturated_steps == 2
    assert r.fractions == {"token states": 5 / 16, "reserved": 3 / 16, "internal fragmentation": 8 / 16,
                           "external fragmentation": 0.0, "free": 0.0}
    assert r.waste == pytest.approx(11 / 16)
    assert r.mean_batch == 2 and r.steps == 4


def test_external_fragmentation_by_hand():
    """Oracle reservations of 3, 3 and 2 slots fill 8 of 10 slots. The next request needs 4
    contiguous slots, so the 2 free slots at the end are unusable: external fragmentation.
    After one step the 2-slot request finishes, its gap joins them, and the waiter fits."""
    trace = [memory.TraceRequest(1, 2), memory.TraceRequest(1, 2), memory.TraceRequest(1, 1), memory.TraceRequest(2, 2)]
    r = memory.simulate(trace, "oracle", memory_slots=10, max_len=8)
    # step 0: the first three are admitted (slots 0-2, 3-5, 6-7); gap 8-9 (2 slots) < 4 needed
    m = r.memory_map
    assert r.snapshot_step == 0
    assert (m[8:] == memory.EXTERNAL).all() and (m[:8] != memory.EXTERNAL).all()
    assert r.saturated_steps == 1 and r.fractions["external fragmentation"] == pytest.approx(2 / 10)


def test_a_pool_that_never_fills_is_averaged_over_every_step():
    trace = [memory.TraceRequest(2, 2)] * 2  # both fit at once: nobody ever waits
    r = memory.simulate(trace, "max", memory_slots=16, max_len=8)
    assert r.saturated_steps == 0 and r.steps == 2
    assert r.fractions["token states"] == pytest.approx((4 + 6) / 2 / 16) and r.fractions["free"] == 0
    assert r.mean_batch == 2


def test_paging_with_one_slot_blocks_wastes_nothing():
    trace = memory.request_trace(60, seed=1, max_len=512)
    r = memory.simulate(trace, "paged", memory_slots=4096, max_len=512, block_size=1)
    assert r.fractions["reserved"] == r.fractions["internal fragmentation"] == r.fractions["external fragmentation"] == 0
    assert r.waste == 0


@pytest.mark.parametrize("policy", memory.POLICIES)
def test_simulate_accounts_for_every_slot(policy):
    trace = memory.request_trace(80, seed=2, max_len=512)
    r = memory.simulate(trace, policy, memory_slots=4096, max_len=512, block_size=16)
    assert sum(r.fractions.values()) == pytest.approx(1.0)
    assert all(v >= 0 for v in r.fractions.values())
    assert r.memory_map.shape == (4096,) and set(np.unique(r.memory_map)) <= set(range(5))
    if policy == "oracle":
        assert r.fractions["internal fragmentation"] == 0  # it reserves exactly what each request will use
    if policy in ("max", "paged"):
        assert r.fractions["external fragmentation"] == 0  # equal-size reservations / blocks always fit
    if policy == "paged":
        # the last block of each request is the only slack: under one block per running request
        slack = r.fractions["reserved"] + r.fractions["internal fragmentation"]
        assert slack * 4096 < r.peak_batch * 16


def test_paging_beats_max_reservation_on_a_chat_trace():
    trace = memory.request_trace(150, seed=0)
    contiguous = memory.simulate(trace, "max", memory_slots=16384)
    paged = memory.simulate(trace, "paged", memory_slots=16384, block_size=16)
    assert contiguous.waste > 0.6 and paged.waste < 0.04
    assert paged.mean_batch > 2 * contiguous.mean_batch


def test_a_watermark_trades_batch_size_for_fewer_preemptions():
    trace = memory.request_trace(150, seed=0)
    greedy = memory.simulate(trace, "paged", memory_slots=16384, watermark=0.0)
    careful = memory.simulate(trace, "paged", memory_slots=16384, watermark=0.2)
    assert greedy.preemptions > careful.preemptions and greedy.mean_batch > careful.mean_batch
    with pytest.raises(ValueError, match="watermark must lie in"):
        memory.simulate(trace, "paged", memory_slots=16384, watermark=1.0)


def test_request_trace():
    a = memory.request_trace(2000, seed=3, max_len=1024)
    assert a == memory.request_trace(2000, seed=3, max_len=1024)
    assert all(r.prompt >= 1 and r.output >= 1 and r.total <= 1024 for r in a)
    assert np.median([r.prompt for r in a]) == pytest.approx(160, rel=0.1)  # the stated median


def test_simulate_rejects_bad_input():
    trace = [memory.TraceRequest(10, 10)]
    with pytest.raises(ValueError, match="policy must be one of"):
        memory.simulate(trace, "best", memory_slots=64)
    with pytest.raises(ValueError, match="exceed max_len=16"):
        memory.simulate(trace, "max", memory_slots=64, max_len=16)
    with pytest.raises(ValueError, match="needs 2048 slots but the pool has 64"):
        memory.simulate(trace, "max", memory_slots=64)
    with pytest.raises(ValueError, match="empty"):
        memory.simulate([], "max", memory_slots=64)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        memory.simulate(trace, "paged", memory_slots=64, block_size=0)
    with pytest.raises(ValueError, match="contiguous policy"):
        memory.reservation("paged", trace[0], 64)
    with pytest.raises(ValueError, match="n must be a positive int"):
        memory.request_trace(0)
