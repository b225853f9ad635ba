import pytest
import torch

import kvlib
from kvlib import PRESETS, StaticCache, Transformer, memory

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

GiB = 2**30


def test_llama2_7b_2048_tokens_fp16_is_one_gib():
    # seed 002's figure: 2 * 32 layers * 2048 tokens * 32 heads * 128 dims * 2 bytes = 1 GiB
    assert memory.kv_cache_bytes(PRESETS["llama-2-7b"], 2048, 1, "fp16") == 1 * GiB


def test_one_layer_batch_32_context_4096_is_two_gib():
    one_layer = PRESETS["llama-2-7b"].replace(n_layer=1)
    assert memory.kv_cache_bytes(one_layer, 4096, 32, "fp16") == 2 * GiB


def test_gqa_shrinks_the_cache_by_the_group_size():
    # Llama-3-8B has the same layers and head_dim as Llama-2-7B but 8 KV heads instead of 32
    a = memory.kv_bytes_per_token(PRESETS["llama-2-7b"], dtype="fp16")
    b = memory.kv_bytes_per_token(PRESETS["llama-3-8b"], dtype="fp16")
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


def test_dtype_bytes_takes_a_torch_dtype_a_name_or_a_byte_count():
    assert [memory.dtype_bytes(d) for d in ("fp32", "fp16", "bf16", "fp8", "int8", 3)] == [4, 2, 2, 1, 1, 3]
    torch_dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
    assert [memory.dtype_bytes(d) for d in torch_dtypes] == [4, 2, 2, 1, 1]  # as tensors take them
    assert memory.dtype_bytes(None) == memory.dtype_bytes() == 4  # a kvlib model's fp32
    assert memory.kv_cache_bytes(PRESETS["gpt2"], 10, 2, "fp16") == memory.kv_cache_bytes(PRESETS["gpt2"], 10, 2, 2) \
        == memory.kv_cache_bytes(PRESETS["gpt2"], 10, 2, torch.float16)
    for bad in ("fp12", 0, -2, True, 2.0, torch.bool, ["fp16"]):
        with pytest.raises(ValueError, match="dtype must be one of .*, a torch.dtype"):
            memory.dtype_bytes(bad)


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])
def test_the_default_dtype_is_a_kvlib_models_so_the_formula_is_its_caches_nbytes(preset):
    """The default was fp16, half of what a default (fp32) kvlib model's cache holds."""
    config = PRESETS[preset].replace(max_seq_len=64)
    model = Transformer(config)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    for cache in (kvlib.DynamicCache(config.n_layer), StaticCache.for_model(config, 2, 24)):
        model(ids, cache)
        assert memory.kv_cache_bytes(config, 24, 2) == cache.nbytes
        assert memory.kv_cache_bytes(config, 24, 2, model.dtype) == cache.nbytes  # the model's dtype, as is
    half = Transformer(config).to(torch.bfloat16)
    cache = kvlib.DynamicCache(config.n_layer)
    half(ids, cache)
    assert memory.kv_cache_bytes(config, 24, 2, half.dtype) == cache.nbytes == memory.kv_cache_bytes(config, 24, 2) // 2
    assert memory.weight_bytes(config) == sum(p.nbytes for p in model.parameters())


def test_kv_cache_bytes_rejects_bad_sizes():
    with pytest.raises(ValueError, match="seq_len must be an int >= 0"):
        memory.kv_cache_bytes(PRESETS["gpt2"], -1, dtype="fp16")
    with pytest.raises(ValueError, match="batch must be a positive int"):
        memory.kv_cache_bytes(PRESETS["gpt2"], 10, 0, dtype="fp16")
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        memory.param_count("llama-2-7b")
    assert memory.kv_cache_bytes(PRESETS["gpt2"], 0, dtype="fp16") == 0  # an empty cache is allowed


def test_published_parameter_counts():
    # independent figures: HF model cards / papers
    assert memory.param_count(PRESETS["gpt2"]) == 124_439_808
    assert memory.param_count(PRESETS["llama-2-7b"]) == 6_738_415_616
    assert memory.param_count(PRESETS["llama-3-8b"]) == 8_030_261_248
    assert memory.param_count(PRESETS["llama-3-70b"]) == 70_553_706_496
    assert memory.param_count(PRESETS["mistral-7b"]) == 7_241_732_096


def test_what_fits_on_an_80_gib_gpu():
    cfg = PRESETS["llama-2-7b"]
    per_seq = memory.kv_cache_bytes(cfg, 4096, dtype="fp16")  # 2 GiB per 4096-token sequence
    b = memory.max_batch(cfg, 80 * GiB, 4096, dtype="fp16")
    w = memory.weight_bytes(cfg, dtype="fp16")
    assert b * per_seq + w <= 80 * GiB < (b + 1) * per_seq + w
    with pytest.raises(ValueError, match="do not fit"):
        memory.max_tokens(PRESETS["llama-3-70b"], 80 * GiB, dtype="fp16")  # 141 GB of fp16 weights


def test_table_rows_and_bad_input():
    rows = memory.table(["llama-2-7b", "llama-3-8b"], seq_len=2048, dtype="fp16")
    assert rows[0]["kv_gib"] == 1.0 and rows[1]["kv_gib"] == 0.25
    with pytest.raises(ValueError, match="unknown preset"):
        memory.table(["gpt-5"], dtype="fp16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory.kv_cache_bytes(PRESETS["gpt2"], 10, dtype="fp12")
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        memory.max_batch(PRESETS["gpt2"], GiB, 0, dtype="fp16")


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
    assert memory.kv_bytes_per_token(mha, dtype="fp16") == 8 * memory.kv_bytes_per_token(l70, dtype="fp16")


# -- the per-layer formula: hybrid layer patterns (kvlib.layers) -----------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlib import layers as L  # noqa: E402


def brute_cache_bytes(cfg, seq_len, batch, width):
    """Decode token by token, each layer keeping a list of positions and dropping every position its
    newest query cannot see (`kvlib.layers.visible`); then count the numbers those positions hold,
    written out by hand per kind. Shares no code with `tokens_held` or `kv_bytes_by_layer`."""
    total = 0
    for kind in cfg.layer_kinds():
        if kind.kind == "shared":
            continue  # reads its source's cache: stores nothing
        kept = []
        for q in range(seq_len):
            kept.append(q)
            seen = L.visible(kind, torch.tensor([q]), torch.tensor(kept))[0]
            kept = [k for k, s in zip(kept, seen.tolist()) if s]
        per_token = kind.size if kind.kind == "latent" else 2 * cfg.n_kv_head * cfg.head_dim
        total += batch * len(kept) * per_token * width
    return total


@st.composite
def hybrid_configs(draw):
    n_layer = draw(st.integers(1, 6))
    kinds = []
    for i in range(n_layer):
        own = [j for j in range(i) if kinds[j].kind != "shared"]
        options = [st.just(L.full()), st.builds(L.window, st.integers(1, 7), st.integers(0, 3)),
                   st.builds(L.chunked, st.integers(1, 7)), st.builds(L.latent, st.integers(1, 40))]
        if own:
            options.append(st.sampled_from(own).map(L.shared))
        kinds.append(draw(st.one_of(options)))
    heads = draw(st.sampled_from([(4, 1), (4, 2), (4, 4)]))
    return PRESETS["tiny"].replace(n_layer=n_layer, n_head=heads[0], n_kv_head=heads[1], layers=kinds)


@settings(max_examples=80, deadline=None)
@given(cfg=hybrid_configs(), seq_len=st.integers(0, 30), batch=st.integers(1, 3), width=st.sampled_from([1, 2, 4]))
def test_per_layer_bytes_equal_a_brute_force_decode(cfg, seq_len, batch, width):
    want = brute_cache_bytes(cfg, seq_len, batch, width)
    assert memory.kv_cache_bytes(cfg, seq_len, batch, width) == want
    assert sum(memory.kv_bytes_by_layer(cfg, seq_len, batch, width)) == want
    assert len(memory.kv_bytes_by_layer(cfg, seq_len, batch, width)) == cfg.n_layer


@pytest.mark.parametrize("name", [n for n in PRESETS if not PRESETS[n].hybrid])
def test_an_all_full_model_is_the_product_formula(name):
    """Every layer full: each function gives what the one-line formula gives."""
    c = PRESETS[name]
    L_, H, D = c.n_layer, c.n_kv_head, c.head_dim
    for S, B, b in ((0, 1, 2), (1, 1, 2), (777, 3, 4), (4096, 8, 1)):
        assert memory.kv_cache_bytes(c, S, B, b) == 2 * L_ * B * H * S * D * b
        assert memory.kv_bytes_by_layer(c, S, B, b) == [2 * B * H * S * D * b] * L_
    assert memory.kv_bytes_per_token(c, "fp16") == memory.kv_growth_per_token(c, "fp16") == 2 * L_ * H * D * 2
    if c.family == "llama":  # what fits: the old token budget, cut into sequences
        mem = memory.weight_bytes(c, dtype="fp16") + 3 * GiB + 12345
        budget = (mem - memory.weight_bytes(c, dtype="fp16")) // (2 * L_ * H * D * 2)
        assert memory.max_tokens(c, mem, dtype="fp16") == budget
        assert memory.max_batch(c, mem, 1000, dtype="fp16") == budget // 1000


def test_hybrid_presets_against_their_all_full_selves():
    """The same shapes with every layer full give the product formula; the pattern only ever saves."""
    for name, c in PRESETS.items():
        if not c.hybrid:
            continue
        dense = c.replace(layers=None)
        for S in (1, 100, 5000, 131072):
            assert memory.kv_cache_bytes(dense, S, dtype="fp16") == 2 * c.n_layer * c.n_kv_head * S * c.head_dim * 2
            assert memory.kv_cache_bytes(c, S, dtype="fp16") <= memory.kv_cache_bytes(dense, S, dtype="fp16"), (name, S)


def test_mistral_window_saves_8x_at_32k():
    # Jiang et al. 2023 (Mistral 7B), section 2: with W = 4096, "for a sequence length of 32k tokens,
    # this reduces the cache memory usage by 8x, without impacting the model quality".
    mis = PRESETS["mistral-7b"]
    assert memory.kv_cache_bytes(mis.replace(layers=None), 32768) == 8 * memory.kv_cache_bytes(mis, 32768)
    assert memory.kv_cache_bytes(mis, 32768, dtype="fp16") == memory.kv_cache_bytes(mis, 4096, dtype="fp16") == GiB // 2


def test_deepseek_v3_caches_576_numbers_per_token_per_layer():
    # DeepSeek-V2 paper, section 2.1.3 and Table 1: MLA caches (d_c + d_h^R) * l = (512 + 64) * l numbers
    # per token, against 2 * n_h * d_h * l for MHA; V3 has l = 61 layers and n_h = 128 heads of d_h = 128.
    v3 = PRESETS["deepseek-v3"]
    assert memory.kv_bytes_per_token(v3, "bf16") == (512 + 64) * 61 * 2 == 70_272
    assert memory.kv_cache_bytes(v3, 1000, 2, 1) == 2 * 1000 * 576 * 61
    mha = memory.kv_bytes_per_token(v3.replace(layers=None), 1)
    assert mha == 2 * 128 * 128 * 61  # the paper's MHA baseline for the same model


def test_gemma3_27b_at_128k():
    """52 window layers of 1024 tokens and 10 global layers: the global layers alone grow."""
    g = PRESETS["gemma-3-27b"]
    per_layer_token = 2 * 16 * 128 * 2  # K and V, 16 KV heads of 128, bf16
    want = (10 * 131072 + 52 * 1024) * per_layer_token
    assert memory.kv_cache_bytes(g, 131072, 1, "bf16") == want
    assert memory.kv_growth_per_token(g, "bf16") == 10 * per_layer_token
    # past every window the cache grows by exactly the growth per token
    assert (memory.kv_cache_bytes(g, 5001) - memory.kv_cache_bytes(g, 5000)) == memory.kv_growth_per_token(g)
    # below every window, by the bytes of one token in every layer
    assert (memory.kv_cache_bytes(g, 501) - memory.kv_cache_bytes(g, 500)) == memory.kv_bytes_per_token(g)


def test_what_fits_for_a_hybrid_model():
    mis = PRESETS["mistral-7b"]
    mem = 80 * GiB
    free = mem - memory.weight_bytes(mis, dtype="fp16")
    b = memory.max_batch(mis, mem, 16384, dtype="fp16")
    assert b == free // memory.kv_cache_bytes(mis, 4096, dtype="fp16")  # a 16k sequence holds 4096 tokens per layer
    per_seq = memory.kv_cache_bytes(mis, 16384, dtype="fp16")
    assert b * per_seq <= free < (b + 1) * per_seq
    with pytest.raises(ValueError, match=r"max_tokens assumes every token costs the same.*window\(4096\)"):
        memory.max_tokens(mis, mem, dtype="fp16")
    with pytest.raises(ValueError, match=r"pool_capacity assumes every token costs the same.*chunked\(8192\)"):
        memory.pool_capacity(PRESETS["llama-4-scout"], GiB, 2048, dtype="fp16")
    # latent layers grow by the same bytes with every token: a token budget holds
    v3 = PRESETS["deepseek-v3"]
    assert memory.max_tokens(v3, 80 * GiB, weights=False, dtype="fp16") == 80 * GiB // (576 * 61 * 2)
    assert memory.pool_capacity(v3, GiB, 1024, 16, dtype="fp16")[0] == GiB // (16 * 576 * 61 * 2)


def test_table_takes_the_pattern_into_account():
    mis, gem = memory.table(["mistral-7b", "gemma-3-27b"], seq_len=8192, dtype="fp16")
    assert mis["kv_kib_per_token"] * 1024 * 8192 == memory.kv_cache_bytes(PRESETS["mistral-7b"], 8192, dtype="fp16")
    assert mis["kv_kib_per_token"] * 1024 == memory.kv_bytes_per_token(PRESETS["mistral-7b"], dtype="fp16") / 2
    assert gem["params"] is None and gem["weights_gib"] is None  # a "shapes" preset: not counted
    assert gem["kv_gib"] * GiB == memory.kv_cache_bytes(PRESETS["gemma-3-27b"], 8192, dtype="fp16")


@pytest.mark.parametrize("name", [n for n in PRESETS if PRESETS[n].family == "shapes"])
def test_shapes_presets_refuse_weight_counts(name):
    c = PRESETS[name]
    for f in (memory.param_count, memory.weight_bytes, memory.layer_matrix_params):
        with pytest.raises(ValueError, match=r"shapes|Llama-family"):
            f(c)
    with pytest.raises(ValueError, match="Llama-family"):
        Transformer(c, device="meta")
    assert memory.kv_cache_bytes(c, 4096, dtype="fp16") > 0  # the cache is what they are for


def test_per_layer_bad_input():
    c = PRESETS["gemma-3-1b"]
    for bad in (-1, 26, 1.0, True):
        with pytest.raises(IndexError, match="layer must be an int in 0..25"):
            memory.numbers_per_token(c, bad)
    with pytest.raises(ValueError, match="seq_len must be an int >= 0"):
        memory.kv_bytes_by_layer(c, -1, dtype="fp16")
    with pytest.raises(ValueError, match="batch must be a positive int"):
        memory.kv_bytes_by_layer(c, 10, 0, dtype="fp16")
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        memory.kv_bytes_by_layer("gemma-3-1b", 10, dtype="fp16")
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        memory.table(["gemma-3-1b"], seq_len=0, dtype="fp16")
