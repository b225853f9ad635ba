"""Sharing keys and values: GQA/MQA attention, KV-head conversion, and MLA."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import ModelConfig, Transformer
from kvlib.gqa import convert_kv_heads
from kvlib.mla import DEEPSEEK_V2, LatentCache, MLAAttention, MLAConfig, cost_per_cached_token

pytestmark = pytest.mark.device

TOL = dict(rtol=1e-5, atol=1e-5)


def per_head_mha(q, k, v, mask):
    """Textbook multi-head attention, one head at a time (no repeat_kv, no grouping)."""
    outs = []
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h].transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, Tq, Tk)
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(s, dim=-1) @ v[:, h])
    return torch.stack(outs, dim=1)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), H_kv=st.integers(1, 4), G=st.integers(1, 4), Tq=st.integers(1, 5), extra=st.integers(0, 5),
       seed=st.integers(0, 1000))
def test_grouped_einsum_equals_repeat_kv(B, H_kv, G, Tq, extra, seed, device):
    g = torch.Generator().manual_seed(seed)
    Tk, D = Tq + extra, 8
    q = torch.randn(B, H_kv * G, Tq, D, generator=g).to(device)
    k, v = torch.randn(B, H_kv, Tk, D, generator=g).to(device), torch.randn(B, H_kv, Tk, D, generator=g).to(device)
    mask = kvlib.causal_mask(Tq, Tk)[None, None]
    torch.testing.assert_close(kvlib.grouped_attention(q, k, v, mask), kvlib.attention(q, k, v, mask), **TOL)
    # and explicitly against repeat_kv followed by plain per-head attention
    ref = per_head_mha(q, kvlib.repeat_kv(k, G), kvlib.repeat_kv(v, G), mask[0, 0])
    torch.testing.assert_close(kvlib.grouped_attention(q, k, v, mask), ref, **TOL)


def test_gqa_with_as_many_kv_heads_as_query_heads_is_mha(device):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 5, 8, generator=g).to(device) for _ in range(3))
    mask = kvlib.causal_mask(5, 5)
    assert kvlib.repeat_kv(k, 1) is k
    torch.testing.assert_close(kvlib.attention(q, k, v, mask), per_head_mha(q, k, v, mask), **TOL)
    torch.testing.assert_close(kvlib.grouped_attention(q, k, v, mask), per_head_mha(q, k, v, mask), **TOL)


def toy(n_head=6, n_kv_head=2, seed=0, device="cpu"):
    cfg = ModelConfig(n_layer=2, n_head=n_head, n_kv_head=n_kv_head, d_model=n_head * 8, d_ff=64, vocab_size=61,
                      max_seq_len=64, name="toy")
    m = Transformer(cfg, device=device)
    m.reset_parameters(seed=seed, std=0.2)
    return m.eval()


@pytest.mark.parametrize("H, old, new", [(6, 2, 6), (6, 1, 3), (8, 2, 4), (8, 4, 8)])
def test_expanding_kv_heads_changes_no_output(H, old, new, device):
    model = toy(H, old, device=device)
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    big = convert_kv_heads(model, new)
    assert big.config.n_kv_head == new
    with torch.inference_mode():
        torch.testing.assert_close(big(tokens), model(tokens), rtol=0, atol=1e-5)
        c_small, c_big = kvlib.DynamicCache(2), kvlib.DynamicCache(2)
        model(tokens, c_small), big(tokens, c_big)
    assert c_big.nbytes == (new // old) * c_small.nbytes


@pytest.mark.parametrize("how", ["mean", "first"])
def test_merging_identical_heads_is_exact(how, device):
    model = toy(8, 4, device=device)
    H, D = 8, 8
    with torch.no_grad():
        for block in model.layers:  # make KV heads (0, 1) identical and (2, 3) identical
            w = block.attn.wqkv.weight  # columns [q (H D) | k (4 D) | v (4 D)]
            for base in (H * D, H * D + 4 * D):  # k section, then v section
                w[:, base + 1 * D: base + 2 * D] = w[:, base + 0 * D: base + 1 * D]
                w[:, base + 3 * D: base + 4 * D] = w[:, base + 2 * D: base + 3 * D]
    tokens = torch.randint(0, 61, (1, 10), generator=torch.Generator().manual_seed(2)).to(device)
    merged = convert_kv_heads(model, 2, how=how)
    with torch.inference_mode():
        torch.testing.assert_close(merged(tokens), model(tokens), rtol=0, atol=1e-5)


def test_merging_different_heads_changes_the_model_and_mean_is_the_average(device):
    model = toy(6, 2, device=device)
    merged = convert_kv_heads(model, 1)
    w_old, w_new = model.layers[0].attn.wqkv.weight, merged.layers[0].attn.wqkv.weight
    H, D = 6, 8
    k_old = w_old[:, H * D: H * D + 2 * D].reshape(-1, 2, D)
    torch.testing.assert_close(w_new[:, H * D: H * D + D], k_old.mean(1))
    tokens = torch.randint(0, 61, (1, 10), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        assert (merged(tokens) - model(tokens)).abs().max() > 1e-2
    assert merged.layers[0].attn.wqkv.weight.data_ptr() != w_old.data_ptr()  # a copy, not shared


def test_bad_groupings_are_clear_errors(device):
    model = toy(6, 2, device=device)
    with pytest.raises(ValueError, match="does not divide the 6 query heads"):
        convert_kv_heads(model, 4)
    with pytest.raises(ValueError, match="cannot regroup 2 KV heads into 3"):
        convert_kv_heads(model, 3)
    with pytest.raises(ValueError, match="positive int"):
        convert_kv_heads(model, 0)
    with pytest.raises(ValueError, match="how must be"):
        convert_kv_heads(model, 1, how="max")
    with pytest.raises(TypeError, match="kvlib Transformer"):
        convert_kv_heads("smollm2", 1)
    with pytest.raises(ValueError, match="divisible"):
        kvlib.grouped_attention(torch.randn(1, 6, 2, 8, device=device), torch.randn(1, 4, 2, 8, device=device), torch.randn(1, 4, 2, 8, device=device))


mla_configs = st.builds(
    MLAConfig, d_model=st.sampled_from([32, 48]), n_head=st.integers(1, 4), d_c=st.sampled_from([8, 16]),
    d_nope=st.sampled_from([4, 8]), d_rope=st.sampled_from([2, 4]), d_v=st.sampled_from([4, 6]),
    d_cq=st.sampled_from([None, 12]),
)


@settings(max_examples=30, deadline=None)
@given(cfg=mla_configs, T=st.integers(1, 6), steps=st.integers(0, 4), seed=st.integers(0, 100))
def test_mla_absorbed_equals_naive_with_and_without_cache(cfg, T, steps, seed, device):
    m = MLAAttention(cfg).reset_parameters(seed, std=0.3)
    x = torch.randn(2, T + steps, cfg.d_model, generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.inference_mode():
        naive = m(x)
        torch.testing.assert_close(m(x, absorbed=True), naive, **TOL)
        for absorbed in (False, True):  # prefill T tokens, then decode one at a time
            cache = LatentCache(1)
            outs = [m(x[:, :T], cache=cache, absorbed=absorbed)]
            outs += [m(x[:, t:t + 1], cache=cache, absorbed=absorbed) for t in range(T, T + steps)]
            torch.testing.assert_close(torch.cat(outs, 1), naive, **TOL)
            assert cache.nbytes == 2 * (T + steps) * (cfg.d_c + cfg.d_rope) * 4  # latent + rope key, fp32


def test_mla_cache_per_token_matches_the_deepseek_v2_paper():
    # DeepSeek-V2 paper, Table 1: MLA caches (d_c + d_h^R) * l elements per token, which with
    # d_c = 4 d_h and d_h^R = d_h / 2 is (9/2) d_h l: the cache of GQA with 2.25 groups.
    d_h, l = 128, DEEPSEEK_V2.n_layer
    assert DEEPSEEK_V2.d_c == 4 * d_h and DEEPSEEK_V2.d_rope == d_h // 2
    assert DEEPSEEK_V2.kv_elements_per_token() == 9 * d_h * l // 2
    assert DEEPSEEK_V2.kv_elements_per_token() == 2 * 2.25 * d_h * l


def test_mla_bad_input(device):
    with pytest.raises(ValueError, match="d_rope must be even"):
        MLAConfig(d_model=8, n_head=1, d_c=4, d_nope=4, d_rope=3, d_v=4)
    with pytest.raises(ValueError, match="must be a positive int"):
        MLAConfig(d_model=8, n_head=0, d_c=4, d_nope=4, d_rope=2, d_v=4)
    m = MLAAttention(MLAConfig(d_model=8, n_head=2, d_c=4, d_nope=4, d_rope=2, d_v=4))
    with pytest.raises(ValueError, match="d_model=8"):
        m(torch.randn(1, 3, 9, device=device))
    cache = LatentCache(1)
    with pytest.raises(ValueError, match=r"the same \(batch, kv_heads, new_tokens\)"):
        cache.update(torch.randn(1, 1, 2, 4, device=device), torch.randn(1, 1, 3, 2, device=device), 0)
    with pytest.raises(IndexError, match="out of range"):
        cache.update(torch.randn(1, 1, 2, 4, device=device), torch.randn(1, 1, 2, 2, device=device), 1)


@pytest.mark.parametrize("d_cq", [None, 12])
def test_absorbed_mla_is_multi_query_attention_over_the_latent(d_cq, device):
    """absorbed_qkv gives one shared KV head (keys d_c + d_rope wide, values the latent);
    PyTorch's own MQA kernel over it, then W_uv and w_o, equals the naive layer."""
    cfg = MLAConfig(d_model=32, n_head=4, d_c=16, d_nope=8, d_rope=4, d_v=6, d_cq=d_cq)
    m = MLAAttention(cfg).reset_parameters(seed=1, std=0.3)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        cache = LatentCache(1)
        m(x[:, :5], cache=cache)  # 5 tokens cached, then 2 more as queries
        q, k, v = m.absorbed_qkv(x[:, 5:], cache=cache)
        assert q.shape == (2, 4, 2, 16 + 4) and k.shape == (2, 1, 7, 16 + 4) and v.shape == (2, 1, 7, 16)
        mask = kvlib.causal_mask(2, 7)
        o_lat = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.scale,
                                                                 enable_gqa=True)  # (B, H, T, d_c)
        W_uv = m.w_ukv.weight.view(16, 4, 8 + 6)[..., 8:]  # (d_c, H, d_v)
        o = torch.einsum("bhtc,chv->bthv", o_lat, W_uv).reshape(2, 2, 4 * 6)
        torch.testing.assert_close(m.w_o(o), m(x)[:, 5:], **TOL)


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_mla_cost_per_cached_token_matches_counted_flops_and_cache_bytes(form, device):
    """FLOPs: what torch's FlopCounterMode counts in a decode step, per extra cached token.
    Bytes: what a LatentCache holds per token (fp32 here)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = MLAConfig(d_model=32, n_head=4, d_c=16, d_nope=8, d_rope=4, d_v=6)
    m = MLAAttention(cfg).reset_parameters(seed=0)
    x = torch.randn(1, 1, 32, device=device)
    flops = {}
    for S in (5, 13):
        cache = LatentCache(1)
        cache.update(torch.randn(1, 1, S, 16, device=device), torch.randn(1, 1, S, 4, device=device), 0)
        # no_grad, not inference_mode: torch 2.5's FlopCounterMode counts 0 FLOPs inside inference_mode
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            m(x, cache=cache, absorbed=form == "absorbed")
        flops[S] = counter.get_total_flops()
    cost = cost_per_cached_token(cfg, form, dtype_bytes=4)
    assert cost["flops"] == (flops[13] - flops[5]) / (13 - 5)
    assert cost["bytes"] == cache.nbytes / cache.seq_len  # batch 1, one layer
    assert cost["intensity"] == cost["flops"] / cost["bytes"]


def test_mla_cost_of_an_expanded_cache_is_multi_head_attention():
    """Caching the up-projected keys and values is MHA: 2 FLOPs per cached number and query
    head, so 1 FLOP per byte at 2 bytes a number, the intensity chapter 5 gives MHA attention."""
    cost = cost_per_cached_token(DEEPSEEK_V2, "expanded", dtype_bytes=2)
    assert cost["bytes"] == DEEPSEEK_V2.n_head * (128 + 64 + 128) * 2
    assert cost["intensity"] == 1.0
    with pytest.raises(ValueError, match="form must be one of"):
        cost_per_cached_token(DEEPSEEK_V2, "fused")
    with pytest.raises(ValueError, match="dtype_bytes must be a positive number"):
        cost_per_cached_token(DEEPSEEK_V2, dtype_bytes=0)
    with pytest.raises(TypeError, match="MLAConfig"):
        cost_per_cached_token(kvlib.PRESETS["tiny"])
