import pytest
import torch

from kvlib import PRESETS, ModelConfig, StaticCache, Transformer, cost


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-3-8b"])
def test_param_count_equals_a_real_model(name):
    model = Transformer(PRESETS[name], device="meta")  # shapes only, no memory
    assert cost.param_count(PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_llama2_7b_parameter_count_is_the_published_6_74b():
    # Touvron et al. 2023 / the HF checkpoint: 6,738,415,616 parameters (untied, vocab 32000).
    assert cost.param_count(PRESETS["llama-2-7b"]) == 6_738_415_616


def test_kv_bytes_is_the_formula():
    c = PRESETS["llama-2-7b"]
    assert cost.kv_bytes(c, 2048, dtype_bytes=2) == 2 * 32 * 1 * 32 * 2048 * 128 * 2 == 2**30  # 1 GiB
    cache = StaticCache.for_model(PRESETS["tiny"], 3, 10)
    assert cost.kv_bytes(PRESETS["tiny"], 10, dtype_bytes=4, batch=3) == cache.nbytes


def test_decode_bytes_are_all_weights_plus_the_cache():
    c = PRESETS["tiny"].replace(tie_embeddings=True)
    model = Transformer(c, device="meta")
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert cost.decode_bytes_per_token(c, 0) == weights + cost.kv_bytes(c, 1)
    assert cost.decode_bytes_per_token(c, 100) - cost.decode_bytes_per_token(c, 0) == cost.kv_bytes(c, 100)


def brute_force_flops(c: ModelConfig, prompt: int, new: int, naive: bool) -> int:
    """Count position by position, exactly as the two loops run."""
    total = 0
    steps = [list(range(prompt + t)) for t in range(new)] if naive else [list(range(prompt))] + [[prompt + t - 1] for t in range(1, new)]
    for positions in steps:
        for p in positions:
            total += cost.flops_per_token(c, p + 1, lm_head=False)
        total += 2 * c.d_model * c.vocab_size  # lm_head on the last position only
    return total


@pytest.mark.parametrize("prompt,new", [(1, 1), (4, 3), (16, 9)])
def test_flop_totals_match_a_brute_force_count(prompt, new):
    c = PRESETS["smollm2-135m"]
    assert cost.naive_flops(c, prompt, new) == brute_force_flops(c, prompt, new, naive=True)
    assert cost.cached_flops(c, prompt, new) == brute_force_flops(c, prompt, new, naive=False)


def test_naive_work_grows_quadratically_and_cached_linearly():
    c = PRESETS["smollm2-135m"]
    r1 = cost.naive_flops(c, 64, 128) / cost.cached_flops(c, 64, 128)
    r2 = cost.naive_flops(c, 64, 256) / cost.cached_flops(c, 64, 256)
    assert 1.5 < r2 / r1 < 2.0  # doubling N nearly doubles the ratio


def test_bad_arguments():
    with pytest.raises(ValueError, match="context must be an int >= 0"):
        cost.decode_bytes_per_token(PRESETS["tiny"], -1)
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        cost.kv_bytes({"n_layer": 2}, 3)
    with pytest.raises(ValueError, match="Llama-family"):
        cost.layer_matrix_params(PRESETS["gpt2"])
