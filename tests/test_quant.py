"""kvlib.quant: quantizers, int4/int2 packing, and the quantized KV cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.check import check_cache
from kvbook.requires import missing
from kvlib.hf import HFQuantizedCache
from kvlib.quant import (
    FP8, FP8_MAX, CastCache, FP8Cache, QuantizedCache, fp8_scale, pack_codes, quantize,
    quantize_fp8, unpack_codes,
)

pytestmark = pytest.mark.device


def scale_bound(q, x, dim, group_size):
    """Broadcast each group's scale / 2 back onto the elements of ``x`` it covers."""
    xm = x.movedim(dim, -1)
    g = xm.shape[-1] if group_size is None else group_size
    s = q.scale.float()[..., None].expand(*q.scale.shape, g).reshape(xm.shape)
    return (s / 2).movedim(-1, dim)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), dim=st.sampled_from([-1, -2]), symmetric=st.booleans(),
       grouped=st.booleans(), T=st.sampled_from([4, 8, 16]), D=st.sampled_from([8, 16]),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0, 1e5]), seed=st.integers(0, 10_000))
def test_round_trip_error_is_at_most_half_a_scale(bits, dim, symmetric, grouped, T, D, magnitude, seed, device):
    x = torch.randn(2, 3, T, D, generator=torch.Generator().manual_seed(seed)).to(device) * magnitude
    gs = (4 if grouped else None)
    q = quantize(x, bits, dim=dim, group_size=gs, symmetric=symmetric)
    err = (q.dequantize() - x).abs()
    bound = scale_bound(q, x, dim, gs)
    # |x - x̂| <= s/2, up to float32 rounding of the dequantization itself
    assert (err <= bound * (1 + 1e-5) + 1e-6 * magnitude).all(), float((err - bound).max())
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == x.dtype


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_numbers_past_fp16s_range_keep_fp32_scales_never_nan(bits, symmetric, device):
    """Scales and minimums were rounded to fp16, which overflows past 65,504: 1e5 dequantized to NaN.
    Now they stay fp32 where fp16 cannot hold them, and the s/2 bound holds."""
    x = torch.tensor([[1e5, -1e5, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], device=device)
    q = quantize(x, bits, symmetric=symmetric)
    got = q.dequantize()
    assert got.isfinite().all(), got
    assert ((got - x).abs() <= q.scale.float() / 2 * (1 + 1e-5) + 0.1).all()  # (2, 1) scales: one per row
    overflows = not symmetric or 1e5 / (2 ** (bits - 1) - 1) > 65504  # the minimum, or the scale itself
    assert q.scale.dtype == (torch.float32 if overflows else torch.float16)
    per_group = (4 if overflows else 2) * (1 if symmetric else 2)  # a scale, and a minimum if asymmetric
    assert q.nbytes == q.codes.nbytes + q.scale.numel() * per_group  # nbytes counts the wider scales
    small = quantize(x / 1e4, bits, symmetric=symmetric)  # within fp16's range: fp16, as before
    assert small.scale.dtype == torch.float16


def test_a_quantized_cache_holds_activations_past_fp16s_range(device):
    cache = QuantizedCache(1, bits=2, residual=0, block=4)
    k = torch.randn(1, 2, 8, 8, device=device) * 1e5  # (B, H, T, D)
    keys, values = cache.update(k, k.clone(), 0)
    assert keys.isfinite().all() and values.isfinite().all()
    assert (keys - k).abs().max() < (k.abs().max() * 2)  # 2 bits: coarse, but numbers, not NaN


def test_a_constant_group_is_exact(device):
    x = torch.full((1, 1, 4, 8), 0.37, device=device)
    for sym in (False, True):
        torch.testing.assert_close(quantize(x, 4, symmetric=sym).dequantize(), x, rtol=0, atol=1e-3)
    assert torch.equal(quantize(torch.zeros(1, 1, 4, 8, device=device), 2).dequantize(), torch.zeros(1, 1, 4, 8, device=device))


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), n=st.integers(1, 6), seed=st.integers(0, 1000))
def test_packing_round_trips_exactly(bits, n, seed, device):
    per = 8 // bits
    q = torch.randint(0, 2**bits, (3, n * per), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).to(device)
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, n)
    assert torch.equal(unpack_codes(packed, bits), q)


def test_int4_packing_layout(device):
    # code i of a byte sits in bits [4i, 4i + 4): codes (0x3, 0xA) pack to 0xA3
    assert pack_codes(torch.tensor([[3, 10]], dtype=torch.uint8, device=device), 4).tolist() == [[0xA3]]
    assert pack_codes(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8, device=device), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def kv(T, seed=0, B=1, H=2, D=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved
    return torch.randn(B, H, T, D, generator=g).to(device), torch.randn(B, H, T, D, generator=g).to(device)


def test_residual_window_longer_than_the_sequence_is_exact(device):
    q, d = QuantizedCache(2, 4, residual=100, block=32), kvlib.DynamicCache(2)
    for T in (5, 1, 1, 3):
        k, v = kv(T, seed=T, device=device)
        for layer in range(2):
            kq, vq = q.update(k, v, layer)
            kd, vd = d.update(k, v, layer)
            assert torch.equal(kq, kd) and torch.equal(vq, vd)
    assert q.seq_len == d.seq_len == 10 and q.nbytes == d.nbytes


def test_an_exact_quantized_cache_passes_the_protocol_checker():
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: QuantizedCache(n_layer, 8, residual=10**6))
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: CastCache(n_layer, dtype))


def test_quantized_model_logits_equal_fp_when_nothing_is_quantized(device):
    model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    model.reset_parameters(seed=0, std=0.2)
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        a = model(tokens, QuantizedCache(2, 2, residual=64))
        b = model(tokens)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nbytes_formula(device):
    # 4-bit KIVI: keys per channel in blocks of 32 tokens, values per token in groups of 4 channels.
    B, H, D, block, res = 1, 2, 8, 32, 16
    cache = QuantizedCache(1, 4, key_dim="channel", value_dim="token", group_size=4, residual=res, block=block)
    k, v = kv(100, B=B, H=H, D=D, device=device)
    cache.update(k, v, 0)
    n_blocks = (100 - res) // block  # 2 blocks quantized, 36 tokens left in the window
    assert cache.seq_len == 100 and n_blocks == 2
    codes = 2 * n_blocks * B * H * block * D // 2  # K and V, half a byte per number
    key_params = n_blocks * B * H * D * 2 * 2  # per block: a scale and a minimum per channel, fp16
    value_params = n_blocks * B * H * block * (D // 4) * 2 * 2  # per token: one per group of 4 channels
    residual = 2 * B * H * (100 - n_blocks * block) * D * 4  # fp32 window
    assert cache.nbytes == codes + key_params + value_params + residual


def test_symmetric_stores_no_minimum(device):
    x = torch.randn(1, 1, 4, 8, device=device)
    assert quantize(x, 8, symmetric=True).nbytes == 32 + 4 * 2  # codes + one fp16 scale per token
    assert quantize(x, 8).nbytes == 32 + 4 * 2 * 2


def test_crop_keeps_the_first_tokens(device):
    cache = QuantizedCache(1, 8, residual=4, block=4)
    k, v = kv(13, device=device)
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
    assert sum(q.shape[2] for q in cache.keys[0]) == (25 - 4) // 4 * 4  # whole blocks left the residual window


@pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")
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


def test_bad_quantize_input(device):
    x = torch.randn(1, 1, 4, 6, device=device)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(x, 5)
    with pytest.raises(ValueError, match="group_size=4 must be a positive int dividing the axis length 6"):
        quantize(x, 4, group_size=4)
    with pytest.raises(ValueError, match="multiple of 4 to pack 2-bit"):
        quantize(x, 2, group_size=6)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, 2, dtype=torch.long, device=device), 8)
    with pytest.raises(ValueError, match=r"finite numbers; x \(2, 2\) holds inf or NaN"):
        quantize(torch.tensor([[1.0, float("inf")], [float("nan"), 0.0]], device=device), 8)
    with pytest.raises(ValueError, match="overflows fp32"):
        quantize(torch.tensor([3e38, -3e38], device=device), 8)
    with pytest.raises(ValueError, match="multiple of 2 to pack"):
        pack_codes(torch.zeros(1, 3, dtype=torch.uint8, device=device), 4)
    cache = QuantizedCache(1, 4, group_size=3, key_dim="token", block=2)
    with pytest.raises(ValueError, match="group_size 3 does not divide head_dim 8"):
        cache.update(*kv(2, device=device), 0)


@pytest.mark.parametrize("keep", [0, 5, 32, 40, 64, 70, 100])
def test_crop_with_keys_and_values_split_differently(keep, device):
    # per-channel keys are stored one block at a time, per-token values one flush at a time
    cache = QuantizedCache(1, 8, key_dim="channel", value_dim="token", residual=4, block=32)
    k, v = kv(100, device=device)
    full_k, full_v = cache.update(k, v, 0)
    cache.crop(keep)
    ck, cv = cache.layer_kv(0) if keep else (full_k[:, :, :0], full_v[:, :, :0])
    assert cache.seq_len == keep and ck.shape[2] == cv.shape[2] == keep
    torch.testing.assert_close(ck, full_k[:, :, :keep])
    torch.testing.assert_close(cv, full_v[:, :, :keep])
    k2, v2 = kv(3, seed=9, device=device)
    nk, nv = cache.update(k2, v2, 0)  # and it keeps working
    assert nk.shape[2] == nv.shape[2] == keep + 3
    torch.testing.assert_close(nk[:, :, keep:], k2)


# -- FP8 (e4m3) ----------------------------------------------------------------------------------------
def nearest_e4m3(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every finite e4m3 number listed from its bit patterns, and the nearest one to
    each element of ``y`` (saturated to ±448); plus a mask of elements with no tie between two."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float().to(y.device)
    grid = grid[grid.isfinite()].unique()  # the 253 distinct finite values, -448 .. 448
    d = (y.clamp(-448, 448)[..., None] - grid).abs()  # (..., 253)
    two = d.topk(2, dim=-1, largest=False).values
    return grid[d.argmin(dim=-1)], two[..., 0] < two[..., 1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), per_head=st.booleans(), fixed=st.sampled_from([None, 1.0, 0.01]))
def test_fp8_rounds_to_the_nearest_e4m3_number(seed, per_head, fixed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 16, 8, generator=g).to(device) * torch.exp(3 * torch.randn(2, 3, 16, 8, generator=g).to(device))  # many binades
    q = quantize_fp8(x, fixed, per_head=per_head)
    assert q.data.dtype == FP8 and q.data.shape == x.shape
    want, clean = nearest_e4m3(x / q.scale)  # a fixed scale of 0.01 saturates many elements at ±448
    assert clean.float().mean() > 0.99
    assert torch.equal(q.data.float()[clean], want[clean])
    torch.testing.assert_close(q.dequantize(), want * q.scale, rtol=0, atol=0)


def test_fp8_error_is_relative_in_the_normal_range():
    x = torch.logspace(-12, 8.8, 8001, base=2)  # 2^-12 .. about 446, just under e4m3's largest, 448
    x = torch.cat([x, -x])
    y = quantize_fp8(x, 1.0).dequantize()
    normal = x.abs() >= 2**-6  # e4m3's smallest normal number; below it the step is a fixed 2^-9
    err = (y - x).abs()
    assert (err[normal] <= x.abs()[normal] / 16).all()  # 3 mantissa bits: half a step is 1/16 of the binade
    assert (err[~normal] <= 2**-10).all()
    assert float(err[normal].div(x.abs()[normal]).max()) > 0.055  # and the bound is nearly reached


def test_fp8_scales_per_tensor_and_per_head(device):
    x = torch.randn(1, 3, 5, 4, device=device) * torch.tensor([1.0, 10.0, 100.0], device=device).view(1, 3, 1, 1)
    assert fp8_scale(x).shape == () and fp8_scale(x, per_head=True).shape == (1, 3, 1, 1)
    torch.testing.assert_close(fp8_scale(x), x.abs().max() / 448)
    q = quantize_fp8(x, per_head=True)
    top = q.data.float().abs().amax(dim=(0, 2, 3))
    assert torch.equal(top, torch.full((3,), FP8_MAX, device=device))  # each head's largest number maps onto 448
    assert q.nbytes == x.numel() + 3 * 4  # 1 byte a number, one fp32 scale per head


def test_fp8_cache_nbytes_crop_and_saturation(device):
    cache = FP8Cache(2)
    k, v = kv(10, H=3, D=8, device=device)
    for layer in range(2):
        cache.update(k, v, layer)
    assert cache.seq_len == 10 and cache.nbytes == 2 * 2 * 3 * 10 * 8 + 2 * 2 * 4  # codes + 2 scales a layer
    big = torch.full((1, 3, 1, 8), 1e6, device=device)  # far past the range calibrated on the first update
    keys, _ = cache.update(big, big, 0)
    torch.testing.assert_close(keys[:, :, -1], torch.full((1, 3, 8), FP8_MAX, device=device) * cache.keys[0].scale)  # saturated
    cache.crop(4)
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == 4
    torch.testing.assert_close(cache.layer_kv(1)[0], quantize_fp8(k).dequantize()[:, :, :4], rtol=0, atol=0)
    cache.reset()
    assert cache.seq_len == 0 and cache.layer_kv(0) is None and cache.nbytes == 0


def test_fp8_cache_appends_without_a_float8_cat(monkeypatch, device):
    """torch 2.5, kvlib's floor, has no CPU ``cat`` for float8, so FP8Cache joins its codes as bytes. Here
    ``torch.cat`` refuses float8 as 2.5's does, on any torch: a second update must still store and return
    exactly the codes one quantization of the whole sequence gives."""
    real_cat = torch.cat

    def cat_without_float8(tensors, *args, **kwargs):
        if any(t.dtype == FP8 for t in tensors):
            raise RuntimeError("\"cat_serial_kernel\" not implemented for 'Float8_e4m3fn'")  # torch 2.5's words
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", cat_without_float8)
    k, v = kv(7, H=3, D=8, device=device)
    for per_head in (False, True):
        cache = FP8Cache(2, per_head=per_head)
        for layer in range(2):
            cache.update(k[:, :, :4], v[:, :, :4], layer)  # the prompt: calibrates and freezes the scales
            keys, values = cache.update(k[:, :, 4:], v[:, :, 4:], layer)  # a later update: an append
            for got, x, held in ((keys, k, cache.keys[layer]), (values, v, cache.values[layer])):
                assert held.data.dtype == FP8 and held.data.shape == (1, 3, 7, 8)
                torch.testing.assert_close(got, quantize_fp8(x, held.scale).dequantize(), rtol=0, atol=0)
        cache.crop(5)
        assert cache.get_seq_length(1) == 5 and cache.keys[1].data.dtype == FP8


def test_fp8_cache_equals_hugging_face_fp8_layer(device):
    """The reference implementation: transformers' QuantizedCache(backend="fp8") layer, fed the same updates.
    HF returns the first update's inputs unrounded; every later update returns identical numbers."""
    hf_layers = pytest.importorskip("transformers.cache_utils")
    if not hasattr(hf_layers, "Fp8QuantizedLayer"):
        pytest.skip("this transformers has no fp8 quantized cache")
    hf, ours = hf_layers.Fp8QuantizedLayer(), FP8Cache(1)
    g = torch.Generator().manual_seed(0)
    for i, T in enumerate((7, 1, 1, 3)):
        k, v = torch.randn(1, 2, T, 8, generator=g).to(device) * (i + 1), torch.randn(1, 2, T, 8, generator=g).to(device)
        hk, hv = hf.update(k, v)
        ok, ov = ours.update(k, v, 0)
        if i == 0:
            assert torch.equal(hk, k)  # HF's first update is not rounded; ours is
            torch.testing.assert_close(ok, quantize_fp8(k).dequantize(), rtol=0, atol=0)
        else:
            torch.testing.assert_close(ok, hk, rtol=0, atol=0)
            torch.testing.assert_close(ov, hv, rtol=0, atol=0)


def test_hf_quantized_cache_runs_a_kvlib_model(device):
    pytest.importorskip("transformers")
    lacking = missing("transformers>=5.21")
    if lacking:  # the dependency floors' 4.56: QuantizedCache has no "fp8" backend there
        pytest.skip(f"HFQuantizedCache(backend='fp8') needs {lacking[0]}: Fp8QuantizedLayer first appears in 5.21.0")
    model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    model.reset_parameters(seed=2, std=0.2)
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    hf, ours = HFQuantizedCache(2, "fp8"), FP8Cache(2)
    with torch.inference_mode():
        first = model(tokens[:, :8], hf)
        torch.testing.assert_close(first, model(tokens[:, :8]), rtol=0, atol=0)  # HF: the prompt unrounded
        model(tokens[:, :8], ours)
        for t in range(8, 12):
            model(tokens[:, t:t + 1], hf), model(tokens[:, t:t + 1], ours)
    assert hf.seq_len == ours.seq_len == 12 and hf.nbytes == ours.nbytes  # the same bytes stored
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        hf.crop(4)
    hf.reset()
    assert hf.seq_len == 0 and hf.layer_kv(0) is None


def test_bad_fp8_input(device):
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="per-head scales need"):
        quantize_fp8(torch.randn(3, 4, device=device), per_head=True)
    with pytest.raises(ValueError, match="positive and finite"):
        quantize_fp8(torch.randn(3, 4, device=device), 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        quantize_fp8(torch.randn(0, 4, device=device))
    with pytest.raises(ValueError, match="scale must be a positive number"):
        FP8Cache(1, scale=-1.0)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantized_nbytes_is_what_quantize_stores(bits, symmetric, device):
    """The formula (codes, plus a 2-byte scale and minimum per group) equals QTensor.nbytes on every
    axis and group size; by hand: 64 numbers at 4 bits with one group are 32 + 2 + 2 bytes."""
    from kvlib.quant import quantized_nbytes

    x = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(bits)).to(device)
    for dim, sizes in ((-1, (8, 16, 32, 64)), (-2, (8, 16, 32))):
        for g in sizes:
            want = quantize(x, bits, dim=dim, group_size=g, symmetric=symmetric).nbytes
            assert quantized_nbytes(x.numel(), bits, g, symmetric) == want, (dim, g)
    assert quantized_nbytes(64, 4, 64) == 36 and quantized_nbytes(64, 4, 64, symmetric=True) == 34
    assert quantized_nbytes(128, 2, 16) == 32 + 8 * 4


def test_quantized_nbytes_refuses_what_quantize_refuses():
    from kvlib.quant import quantized_nbytes

    with pytest.raises(ValueError, match="bits must be one of"):
        quantized_nbytes(64, 3, 8)
    with pytest.raises(ValueError, match="group_size=24 must divide numbers=64"):
        quantized_nbytes(64, 4, 24)
    with pytest.raises(ValueError, match="multiple of 4 to pack 2-bit codes"):
        quantized_nbytes(6, 2, 2)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        quantized_nbytes(64, 8, 0)
