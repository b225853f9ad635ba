import pytest
import torch

from kvlib import PRESETS, ModelConfig, Transformer, cost, memory

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")


def test_decode_bytes_are_all_weights_plus_the_cache():
    c = PRESETS["tiny"].replace(tie_embeddings=True)
    model = Transformer(c, device="meta")
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert cost.decode_bytes_per_token(c, 0) == weights + memory.kv_cache_bytes(c, 1)  # fp32, as the model
    assert cost.decode_bytes_per_token(c, 100) - cost.decode_bytes_per_token(c, 0) == memory.kv_cache_bytes(c, 100)


def test_decode_bytes_take_a_torch_dtype_a_dtype_name_or_a_byte_count():
    c = PRESETS["smollm2-135m"]
    f32 = cost.decode_bytes_per_token(c, 50, dtype="fp32")
    assert f32 == cost.decode_bytes_per_token(c, 50, dtype=4) == cost.decode_bytes_per_token(c, 50, dtype=torch.float32)
    assert f32 == cost.decode_bytes_per_token(c, 50) == 2 * cost.decode_bytes_per_token(c, 50, dtype=torch.bfloat16)
    assert cost.step_bytes(c, 2, 50, dtype=torch.float16) == cost.step_bytes(c, 2, 50, dtype="fp16")
    assert cost.kv_width(torch.float8_e4m3fn) == 1 and cost.kv_width(None) == 4


def test_memory_and_cost_take_batch_then_dtype_in_one_order_and_one_default():
    """decode_bytes_per_token took (context, dtype, batch) while kvlib.memory takes (seq_len, batch, dtype)."""
    import inspect

    c = PRESETS["llama-2-7b"]
    assert cost.decode_bytes_per_token(c, 40, batch=4, dtype="fp16") == cost.step_bytes(c, 4, 40, dtype="fp16")["total"]
    fns = (memory.weight_bytes, memory.kv_bytes_by_layer, memory.kv_cache_bytes, memory.kv_bytes_per_token,
           memory.kv_growth_per_token, memory.max_tokens, memory.max_batch, memory.pool_capacity, memory.table,
           cost.decode_bytes_per_token, cost.step_bytes, cost.intensity, cost.crossover_context)
    for fn in fns:
        params = list(inspect.signature(fn).parameters)
        assert inspect.signature(fn).parameters["dtype"].default is None, fn.__name__
        if "batch" in params:
            assert params.index("batch") < params.index("dtype"), fn.__name__
    # the old order still works for one version, read the old way (4 was bytes there), with a warning
    with pytest.warns(DeprecationWarning, match="pass batch= and dtype= by name"):
        old = cost.decode_bytes_per_token(c, 40, "fp16", 4)
    assert old == cost.decode_bytes_per_token(c, 40, batch=4, dtype="fp16")
    with pytest.warns(DeprecationWarning):
        assert cost.decode_bytes_per_token(c, 40, 2) == cost.decode_bytes_per_token(c, 40, dtype=2)
    with pytest.warns(DeprecationWarning):
        assert cost.decode_bytes_per_token(c, 40, "fp16", batch=3) == cost.decode_bytes_per_token(c, 40, batch=3,
                                                                                                   dtype="fp16")
    with pytest.raises(TypeError, match="by name"):
        cost.decode_bytes_per_token(c, 40, "fp16", dtype="fp32")


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
    with pytest.raises(ValueError, match="dtype must be one of .*, a torch.dtype"):
        cost.decode_bytes_per_token(PRESETS["tiny"], 1, dtype="fp12")
