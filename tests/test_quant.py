"""kvlib.quant: quantizers, int4/int2 packing, and the quantized KV cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.check import check_cache
from kvlib.quant import CastCache, QuantizedCache, pack, quantize, unpack


def scale_bound(q, x, dim, group_size):
    """Broadcast each group's scale / 2 back onto the elements of ``x`` it covers."""
    xm = x.movedim(dim, -1)
    g = xm.shape[-1] if group_size is None else group_size
    s = q.scale.float()[..., None].expand(*q.scale.shape, g).reshape(xm.shape)
    return (s / 2).movedim(-1, dim)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), dim=st.sampled_from([-1, -2]), symmetric=st.booleans(),
       grouped=st.booleans(), T=st.sampled_from([4, 8, 16]), D=st.sampled_from([8, 16]),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 10_000))
def test_round_trip_error_is_at_most_half_a_scale(bits, dim, symmetric, grouped, T, D, magnitude, seed):
    x = torch.randn(2, 3, T, D, generator=torch.Generator().manual_seed(seed)) * magnitude
    gs = (4 if grouped else None)
    q = quantize(x, bits, dim=dim, group_size=gs, symmetric=symmetric)
    err = (q.dequantize() - x).abs()
    bound = scale_bound(q, x, dim, gs)
    # |x - x̂| <= s/2, up to float32 rounding of the dequantization itself
    assert (err <= bound * (1 + 1e-5) + 1e-6 * magnitude).all(), float((err - bound).max())
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == x.dtype


def test_a_constant_group_is_exact():
    x = torch.full((1, 1, 4, 8), 0.37)
    for sym in (False, True):
        torch.testing.assert_close(quantize(x, 4, symmetric=sym).dequantize(), x, rtol=0, atol=1e-3)
    assert torch.equal(quantize(torch.zeros(1, 1, 4, 8), 2).dequantize(), torch.zeros(1, 1, 4, 8))


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), n=st.integers(1, 6), seed=st.integers(0, 1000))
def test_packing_round_trips_exactly(bits, n, seed):
    per = 8 // bits
    q = torch.randint(0, 2**bits, (3, n * per), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, n)
    assert torch.equal(unpack(packed, bits), q)


def test_int4_packing_layout():
    # code i of a byte sits in bits [4i, 4i + 4): codes (0x3, 0xA) pack to 0xA3
    assert pack(torch.tensor([[3, 10]], dtype=torch.uint8), 4).tolist() == [[0xA3]]
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def kv(T, seed=0, B=1, H=2, D=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def test_residual_window_longer_than_the_sequence_is_exact():
    q, d = QuantizedCache(2, 4, residual=100, block=32), kvlib.DynamicCache(2)
    for T in (5, 1, 1, 3):
        k, v = kv(T, seed=T)
        for layer in range(2):
            kq, vq = q.update(k, v, layer)
            kd, vd = d.update(k, v, layer)
            assert torch.equal(kq, kd) and torch.equal(vq, vd)
    assert q.seq_len == d.seq_len == 10 and q.nbytes == d.nbytes


def test_an_exact_quantized_cache_passes_the_protocol_checker():
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: QuantizedCache(n_layer, 8, residual=10**6))
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: CastCache(n_layer, dtype))


def test_quantized_model_logits_equal_fp_when_nothing_is_quantized():
    model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    model.reset_parameters(seed=0, std=0.2)
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = model(tokens, QuantizedCache(2, 2, residual=64))
        b = model(tokens)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nbytes_formula():
    # 4-bit KIVI: keys per channel in blocks of 32 tokens, values per token in groups of 4 channels.
    B, H, D, block, res = 1, 2, 8, 32, 16
    cache = QuantizedCache(1, 4, key_dim="channel", value_dim="token", group_size=4, residual=res, block=block)
    k, v = kv(100, B=B, H=H, D=D)
    cache.update(k, v, 0)
    n_blocks = (100 - res) // block  # 2 blocks quantized, 36 tokens left in the window
    assert cache.seq_len == 100 and n_blocks == 2
    codes = 2 * n_blocks * B * H * block * D // 2  # K and V, half a byte per number
    key_params = n_blocks * B * H * D * 2 * 2  # per block: a scale and a minimum per channel, fp16
    value_params = n_blocks * B * H * block * (D // 4) * 2 * 2  # per token: one per group of 4 channels
    residual = 2 * B * H * (100 - n_blocks * block) * D * 4  # fp32 window
    assert cache.nbytes == codes + key_params + value_params + residual


def test_symmetric_stores_no_minimum():
    x = torch.randn(1, 1, 4, 8)
    assert quantize(x, 8, symmetric=True).nbytes == 32 + 4 * 2  # codes + one fp16 scale per token
    assert quantize(x, 8).nbytes == 32 + 4 * 2 * 2


def test_crop_keeps_the_first_tokens():
    cache = QuantizedCache(1, 8, residual=4, block=4)
    k, v = kv(13)
    full_k, _ = cache.update(k, v, 0)
    cache.crop(6)
    assert cache.seq_len == 6
    torch.testing.assert_close(cache.layer_kv(0)[0], full_k[:, :, :6])


def test_generation_runs_with_a_quantized_cache():
    model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    model.reset_parameters(seed=1, std=0.2)
    prompt = [5, 9, 2, 7, 1, 3]
    cache = QuantizedCache(2, 4, residual=4, block=4)
    out = kvlib.generate(model, prompt, 20, cache=cache)
    assert out.shape == (1, 26) and cache.seq_len == 25
    assert sum(q.shape[2] for q in cache.qk[0]) == (25 - 4) // 4 * 4  # whole blocks left the residual window


@pytest.mark.smollm2
def test_smollm2_int8_cache_generates_the_same_tokens(smollm2):
    # int8 per-token keeps every number within 1/255 of its token's range, far below the
    # margins between SmolLM2's top logits on this prompt; the greedy text must not change.
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three planets of the solar system."}])
    fp = kvlib.generate(model, ids, 16)
    q8 = kvlib.generate(model, ids, 16, cache=QuantizedCache(model.config.n_layer, 8, key_dim="token", residual=0, block=1))
    assert torch.equal(fp, q8)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"bits": 3}, ValueError, "bits must be one of"),
    ({"key_dim": "head"}, ValueError, "key_dim must be"),
    ({"residual": -1}, ValueError, "residual must be"),
    ({"block": 3}, ValueError, "block must be a positive multiple of 2"),
])
def test_bad_cache_settings(kwargs, err, match):
    args = {"bits": 4} | kwargs
    with pytest.raises(err, match=match):
        QuantizedCache(1, **args)


def test_bad_quantize_input():
    x = torch.randn(1, 1, 4, 6)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(x, 5)
    with pytest.raises(ValueError, match="group_size=4 must be a positive int dividing the axis length 6"):
        quantize(x, 4, group_size=4)
    with pytest.raises(ValueError, match="multiple of 4 to pack 2-bit"):
        quantize(x, 2, group_size=6)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, 2, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="multiple of 2 to pack"):
        pack(torch.zeros(1, 3, dtype=torch.uint8), 4)
    cache = QuantizedCache(1, 4, group_size=3, key_dim="token", block=2)
    with pytest.raises(ValueError, match="group_size 3 does not divide head_dim 8"):
        cache.update(*kv(2), 0)


@pytest.mark.parametrize("keep", [0, 5, 32, 40, 64, 70, 100])
def test_crop_with_keys_and_values_split_differently(keep):
    # per-channel keys are stored one block at a time, per-token values one flush at a time
    cache = QuantizedCache(1, 8, key_dim="channel", value_dim="token", residual=4, block=32)
    k, v = kv(100)
    full_k, full_v = cache.update(k, v, 0)
    cache.crop(keep)
    ck, cv = cache.layer_kv(0) if keep else (full_k[:, :, :0], full_v[:, :, :0])
    assert cache.seq_len == keep and ck.shape[2] == cv.shape[2] == keep
    torch.testing.assert_close(ck, full_k[:, :, :keep])
    torch.testing.assert_close(cv, full_v[:, :, :keep])
    k2, v2 = kv(3, seed=9)
    nk, nv = cache.update(k2, v2, 0)  # and it keeps working
    assert nk.shape[2] == nv.shape[2] == keep + 3
    torch.testing.assert_close(nk[:, :, keep:], k2)
