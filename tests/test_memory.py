import pytest
import torch

import kvlib
from kvlib import PRESETS, StaticCache, Transformer, memory

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


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-3-8b"])
def test_param_count_equals_a_real_model(name):
    model = Transformer(PRESETS[name], device="meta")  # shapes only, no memory
    assert memory.param_count(PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_llama2_7b_parameter_count_is_the_published_6_74b():
    # Touvron et al. 2023 / the HF checkpoint: 6,738,415,616 parameters (untied, vocab 32000).
    assert memory.param_count(PRESETS["llama-2-7b"]) == 6_738_415_616


def test_kv_cache_bytes_is_the_formula():
    c = PRESETS["llama-2-7b"]
    assert memory.kv_cache_bytes(c, 2048, dtype=2) == 2 * 32 * 1 * 32 * 2048 * 128 * 2 == 2**30  # 1 GiB
    cache = StaticCache.for_model(PRESETS["tiny"], 3, 10)
    assert memory.kv_cache_bytes(PRESETS["tiny"], 10, batch=3, dtype=4) == cache.nbytes


def test_dtype_bytes_takes_a_name_or_a_byte_count():
    assert [memory.dtype_bytes(d) for d in ("fp32", "fp16", "bf16", "fp8", "int8", 3)] == [4, 2, 2, 1, 1, 3]
    assert memory.kv_cache_bytes(PRESETS["gpt2"], 10, 2, "fp16") == memory.kv_cache_bytes(PRESETS["gpt2"], 10, 2, 2)
    for bad in ("fp12", 0, -2, True, 2.0, None, ["fp16"]):
        with pytest.raises(ValueError, match="dtype must be one of"):
            memory.dtype_bytes(bad)


def test_kv_cache_bytes_rejects_bad_sizes():
    with pytest.raises(ValueError, match="seq_len must be an int >= 0"):
        memory.kv_cache_bytes(PRESETS["gpt2"], -1)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        memory.kv_cache_bytes(PRESETS["gpt2"], 10, 0)
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        memory.param_count("llama-2-7b")
    assert memory.kv_cache_bytes(PRESETS["gpt2"], 0) == 0  # an empty cache is allowed


def test_published_parameter_counts():
    # independent figures: HF model cards / papers
    assert memory.param_count(PRESETS["gpt2"]) == 124_439_808
    assert memory.param_count(PRESETS["llama-2-7b"]) == 6_738_415_616
    assert memory.param_count(PRESETS["llama-3-8b"]) == 8_030_261_248
    assert memory.param_count(PRESETS["llama-3-70b"]) == 70_553_706_496
    assert memory.param_count(PRESETS["mistral-7b"]) == 7_241_732_096


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
    assert memory.param_count(cfg) == sum(p.numel() for p in Transformer(cfg, device="meta").parameters())


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
