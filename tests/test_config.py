import pytest

from kvlib import PRESETS, ModelConfig

pytestmark = pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")


def test_head_dim_defaults_to_width_over_heads():
    cfg = ModelConfig(n_layer=1, n_head=8, n_kv_head=2, d_model=256, d_ff=512, vocab_size=100, max_seq_len=64)
    assert cfg.head_dim == 32 and cfg.n_rep == 4


@pytest.mark.parametrize("field", ["n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "max_seq_len"])
@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_sizes_are_rejected(field, bad):
    kw = dict(n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=100, max_seq_len=64)
    kw[field] = bad
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_sizes_must_be_ints():
    with pytest.raises(TypeError, match="n_layer"):
        ModelConfig(n_layer=2.0, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=100, max_seq_len=64)


def test_heads_must_divide_into_kv_groups():
    with pytest.raises(ValueError, match="n_head=6 is not divisible by n_kv_head=4"):
        ModelConfig(n_layer=1, n_head=6, n_kv_head=4, d_model=96, d_ff=128, vocab_size=100, max_seq_len=64)


def test_rope_needs_even_head_dim():
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig(n_layer=1, n_head=4, n_kv_head=4, d_model=60, d_ff=128, vocab_size=100, max_seq_len=64)


def test_width_must_split_over_heads_unless_head_dim_given():
    with pytest.raises(ValueError, match="d_model=100 is not divisible by n_head=8"):
        ModelConfig(n_layer=1, n_head=8, n_kv_head=8, d_model=100, d_ff=128, vocab_size=100, max_seq_len=64)
    cfg = ModelConfig(n_layer=1, n_head=8, n_kv_head=8, d_model=100, d_ff=128, vocab_size=100, max_seq_len=64, head_dim=16)
    assert cfg.head_dim == 16


# Independent reference values, read from each model's published config.json / paper,
# as (n_layer, n_head, n_kv_head, d_model, head_dim, vocab).
PUBLISHED = {
    "gpt2": (12, 12, 12, 768, 64, 50257),
    "smollm2-135m": (30, 9, 3, 576, 64, 49152),
    "llama-2-7b": (32, 32, 32, 4096, 128, 32000),
    "llama-3-8b": (32, 32, 8, 4096, 128, 128256),
    "llama-3-70b": (80, 64, 8, 8192, 128, 128256),
    "mistral-7b": (32, 32, 8, 4096, 128, 32000),
    "llama-3.1-8b": (32, 32, 8, 4096, 128, 128256),
    "gemma-3-1b": (26, 4, 1, 1152, 256, 262144),
    "gemma-3-27b": (62, 32, 16, 5376, 128, 262208),
    "gpt-oss-20b": (24, 64, 8, 2880, 64, 201088),
    "gpt-oss-120b": (36, 64, 8, 2880, 64, 201088),
    "llama-4-scout": (48, 40, 8, 5120, 128, 202048),
    "deepseek-v3": (61, 128, 128, 7168, 128, 129280),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_shapes(name):
    c = PRESETS[name]
    assert (c.n_layer, c.n_head, c.n_kv_head, c.d_model, c.head_dim, c.vocab_size) == PUBLISHED[name]


def test_smollm2_preset_matches_the_gguf_metadata():
    """The preset and the config read from the shipped weights must agree."""
    from gguf import GGUFReader

    from kvlib.pretrained import smollm2_gguf_path

    r = GGUFReader(str(smollm2_gguf_path()))
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith("llama.")}
    c = PRESETS["smollm2-135m"]
    assert (f["llama.block_count"], f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (
        c.n_layer, c.n_head, c.n_kv_head)
    assert (f["llama.embedding_length"], f["llama.feed_forward_length"], f["llama.vocab_size"]) == (
        c.d_model, c.d_ff, c.vocab_size)
    assert f["llama.rope.freq_base"] == c.rope_base and f["llama.context_length"] == c.max_seq_len


# Each hybrid preset's layer pattern, as its config.json's layer_types / sliding_window /
# attention_chunk_size / no_rope_layers / kv_lora_rank give it: {kind: (count, size)}, and the
# indices of the layers that keep every token.
PATTERNS = {
    "mistral-7b": ({"window": (32, 4096)}, []),
    "gemma-3-1b": ({"window": (22, 512), "full": (4, 0)}, [5, 11, 17, 23]),
    "gemma-3-27b": ({"window": (52, 1024), "full": (10, 0)}, [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]),
    "gpt-oss-20b": ({"window": (12, 128), "full": (12, 0)}, list(range(1, 24, 2))),
    "gpt-oss-120b": ({"window": (18, 128), "full": (18, 0)}, list(range(1, 36, 2))),
    "llama-4-scout": ({"chunked": (36, 8192), "full": (12, 0)}, list(range(3, 48, 4))),
    "deepseek-v3": ({"latent": (61, 576)}, []),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_hybrid_presets_have_their_published_patterns(name):
    kinds = PRESETS[name].layer_kinds()
    want, globals_ = PATTERNS[name]
    got = {}
    for k in kinds:
        n, sizes = got.get(k.kind, (0, set()))
        got[k.kind] = (n + 1, sizes | {k.size})
    assert {k: (n, s) for k, (n, s) in got.items()} == {k: (n, {s}) for k, (n, s) in want.items()}
    assert [i for i, k in enumerate(kinds) if k.kind == "full"] == globals_
    assert all(k.sinks == 0 for k in kinds)  # gpt-oss's sinks are learned logits, not kept tokens
    assert PRESETS[name].hybrid


def test_context_limits_and_families():
    assert PRESETS["llama-3.1-8b"].max_seq_len == 131072 and not PRESETS["llama-3.1-8b"].hybrid
    assert PRESETS["mistral-7b"].max_seq_len == 32768 and PRESETS["mistral-7b"].family == "llama"
    shapes = sorted(n for n, c in PRESETS.items() if c.family == "shapes")
    assert shapes == ["deepseek-v3", "gemma-3-1b", "gemma-3-27b", "gpt-oss-120b", "gpt-oss-20b", "llama-4-scout"]
    with pytest.raises(ValueError, match="family must be one of"):
        PRESETS["tiny"].replace(family="gemma")
