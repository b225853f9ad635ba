import pytest

from kvlib import PRESETS, ModelConfig, Transformer, cost, memory


def test_decode_bytes_are_all_weights_plus_the_cache():
    c = PRESETS["tiny"].replace(tie_embeddings=True)
    model = Transformer(c, device="meta")
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert cost.decode_bytes_per_token(c, 0, "fp32") == weights + memory.kv_cache_bytes(c, 1, dtype="fp32")
    assert cost.decode_bytes_per_token(c, 100, "fp32") - cost.decode_bytes_per_token(c, 0, "fp32") == memory.kv_cache_bytes(
        c, 100, dtype="fp32")


def test_decode_bytes_take_a_dtype_name_or_a_byte_count():
    c = PRESETS["smollm2-135m"]
    assert cost.decode_bytes_per_token(c, 50, "fp32") == cost.decode_bytes_per_token(c, 50, 4)
    assert cost.decode_bytes_per_token(c, 50, "fp32") == 2 * cost.decode_bytes_per_token(c, 50, "fp16")


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
        memory.kv_cache_bytes({"n_layer": 2}, 3)
    with pytest.raises(ValueError, match="Llama-family"):
        memory.layer_matrix_params(PRESETS["gpt2"])
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        cost.flops_per_token({"n_layer": 2}, 3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        cost.decode_bytes_per_token(PRESETS["tiny"], 1, "fp12")
