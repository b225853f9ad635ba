import pytest

from kvlib import PRESETS, ModelConfig


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
