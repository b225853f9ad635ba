"""The teaching kernels (kvlib.kernels), each against an independent computation.

- online_softmax_attention and split_kv_attention equal torch's scaled_dot_product_attention
  (enable_gqa=True, the same bool mask) over query/key lengths, block sizes, split counts,
  GQA groups, padding masks and fp32/bf16 inputs.
- partial_attention's lse is torch.logsumexp of the masked scores; merging the partial
  results of disjoint key slices equals SDPA over all the keys; empty slices add nothing.
- A model running split_kv(3) gives the SDPA model's logits, prefill and cached decode.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from devices import tol
from kvlib import DynamicCache, ModelConfig, Transformer
from kvlib.attention import attention_mask, causal_mask, repeat_kv
from kvlib.kernels import merge_partials, online_softmax_attention, partial_attention, split_kv, split_kv_attention

pytestmark = pytest.mark.device

# Tolerances. fp32: both sides sum the same terms in a different order, ~1e-7 apart; 1e-5 leaves
# room. bf16: the kernels accumulate in fp32 and round the result once to bf16 (a step of
# 2**-8 ~ 0.4% of the value), so against SDPA in fp32 on the same bf16 inputs the difference
# is at most about one bf16 step: rtol 1e-2 (with atol 1e-3 for outputs near zero).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=1e-2)}


def qkv(B, H, H_kv, Tq, Tk, D, seed, dtype=torch.float32, device="cpu"):
    """Drawn on the CPU (a CPU generator: the same numbers on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g)
    k = torch.randn(B, H_kv, Tk, D, generator=g)
    v = torch.randn(B, H_kv, Tk, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def sdpa(q, k, v, mask):
    """The reference: torch's SDPA in fp32 (on the same, possibly bf16-rounded, inputs)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def padding_mask(B, Tq, Tk, seed, device="cpu"):
    """Bottom-right causal + random padding; every query sees at least one key (its own slot)."""
    g = torch.Generator().manual_seed(seed)
    key_valid = torch.rand(B, Tk, generator=g) < 0.6
    key_valid[torch.arange(B), torch.randint(0, Tk, (B,), generator=g)] = True  # >= 1 valid key per row
    return attention_mask(Tq, Tk, key_valid.to(device), pads_see_themselves=True)  # (B, 1, Tq, Tk)


cases = st.fixed_dictionaries(dict(
    B=st.sampled_from([1, 2]),
    heads=st.sampled_from([(4, 1), (4, 2), (4, 4), (8, 2), (8, 4)]),  # (H, H_kv): MQA, GQA, MHA
    Tq=st.sampled_from([1, 1, 2, 3, 7]),
    extra=st.integers(0, 40),  # Tk = Tq + extra
    D=st.sampled_from([4, 16]),
    padded=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 10_000),
))


def build(c, device):
    H, H_kv = c["heads"]
    Tq, Tk = c["Tq"], c["Tq"] + c["extra"]
    q, k, v = qkv(c["B"], H, H_kv, Tq, Tk, c["D"], c["seed"], c["dtype"], device)
    mask = (padding_mask(c["B"], Tq, Tk, c["seed"], device) if c["padded"]
            else causal_mask(Tq, Tk, device=device)[None, None])
    return q, k, v, mask, Tk


@settings(max_examples=60, deadline=None)
@given(c=cases, n_splits=st.integers(1, 50), mask_none=st.booleans())
def test_split_kv_attention_equals_sdpa(c, n_splits, mask_none, device):
    q, k, v, mask, Tk = build(c, device)
    use_none = mask_none and not c["padded"]  # None means the bottom-right causal mask built above
    got = split_kv_attention(q, k, v, None if use_none else mask, n_splits=n_splits)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), sdpa(q, k, v, mask), **tol(device, **TOL[q.dtype]))


@settings(max_examples=60, deadline=None)
@given(c=cases, block_size=st.integers(1, 50), mask_none=st.booleans())
def test_online_softmax_attention_equals_sdpa(c, block_size, mask_none, device):
    q, k, v, mask, Tk = build(c, device)
    use_none = mask_none and not c["padded"]
    got = online_softmax_attention(q, k, v, None if use_none else mask, block_size=block_size)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), sdpa(q, k, v, mask), **tol(device, **TOL[q.dtype]))


@pytest.mark.parametrize("shape", ["2d", "per_head"])
def test_masks_of_other_shapes_match_sdpa(shape, device):
    B, H, H_kv, Tq, Tk = 2, 8, 2, 3, 13
    q, k, v = qkv(B, H, H_kv, Tq, Tk, 8, seed=1, device=device)
    if shape == "2d":
        mask = causal_mask(Tq, Tk, device=device)  # (Tq, Tk)
    else:  # a different random mask for every (batch, query head): checks the GQA grouping
        mask = torch.rand(B, H, Tq, Tk, generator=torch.Generator().manual_seed(2)).to(device) < 0.5
        mask[..., 0] = True  # every row sees a key, so SDPA has no NaN
    want = sdpa(q, k, v, mask)
    torch.testing.assert_close(split_kv_attention(q, k, v, mask, n_splits=4), want, **tol(device, **TOL[torch.float32]))
    torch.testing.assert_close(online_softmax_attention(q, k, v, mask, block_size=5), want, **tol(device, **TOL[torch.float32]))


def test_partial_attention_lse_and_empty_rows(device):
    B, H, H_kv, Tq, Tk = 2, 4, 2, 3, 9
    q, k, v = qkv(B, H, H_kv, Tq, Tk, 8, seed=3, device=device)
    mask = padding_mask(B, Tq, Tk, seed=3, device=device).expand(B, 1, Tq, Tk).clone()
    mask[1, :, 2] = False  # batch row 1, query 2 sees no key at all
    out, lse = partial_attention(q, k, v, mask)
    scores = q @ repeat_kv(k, H // H_kv).transpose(-2, -1) / math.sqrt(8)  # (B, H, Tq, Tk)
    want_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, Tq)
    torch.testing.assert_close(lse, want_lse, **tol(device, **TOL[torch.float32]))
    assert lse.dtype == torch.float32 and torch.isneginf(lse[1, :, 2]).all()
    assert not out.isnan().any() and (out[1, :, 2] == 0).all()
    seen = mask.expand(B, H, Tq, Tk).any(-1)  # rows SDPA can answer without NaN
    torch.testing.assert_close(out[seen], sdpa(q, k, v, mask)[seen], **tol(device, **TOL[torch.float32]))


@pytest.mark.parametrize("stacked", [False, True])
def test_merging_two_halves_equals_attention_over_all_keys(stacked, device):
    B, H, H_kv, Tq, Tk, cut = 2, 8, 4, 4, 17, 6
    q, k, v = qkv(B, H, H_kv, Tq, Tk, 16, seed=4, device=device)
    mask = padding_mask(B, Tq, Tk, seed=4, device=device)
    a = partial_attention(q, k[:, :, :cut], v[:, :, :cut], mask[..., :cut])
    b = partial_attention(q, k[:, :, cut:], v[:, :, cut:], mask[..., cut:])
    outs, lses = [a[0], b[0]], [a[1], b[1]]
    if stacked:
        outs, lses = torch.stack(outs), torch.stack(lses)  # (2, B, H, Tq, D), (2, B, H, Tq)
    torch.testing.assert_close(merge_partials(outs, lses), sdpa(q, k, v, mask), **tol(device, **TOL[torch.float32]))


def test_an_all_masked_slice_contributes_nothing(device):
    B, H, Tq, Tk = 1, 4, 2, 10
    q, k, v = qkv(B, H, 2, Tq, Tk, 8, seed=5, device=device)
    full = partial_attention(q, k, v, torch.ones(Tq, Tk, dtype=torch.bool, device=device))
    empty = partial_attention(q, k, v, torch.zeros(Tq, Tk, dtype=torch.bool, device=device))
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    want = sdpa(q, k, v, None)  # every key visible
    torch.testing.assert_close(merge_partials([full[0], empty[0]], [full[1], empty[1]]), want, **tol(device, **TOL[torch.float32]))
    junk = torch.full_like(full[0], 1e6)  # an -inf slice weighs 0 whatever its output holds
    torch.testing.assert_close(merge_partials([junk, full[0]], [empty[1], full[1]]), want, **tol(device, **TOL[torch.float32]))


def test_all_slices_empty_gives_zeros_not_nan(device):
    outs = torch.randn(3, 2, 4, 5, 8, device=device)  # (n, B, H, Tq, D)
    lses = torch.full((3, 2, 4, 5), float("-inf"), device=device)
    out = merge_partials(outs, lses)
    assert out.shape == (2, 4, 5, 8) and not out.isnan().any() and (out == 0).all()


def test_a_model_with_split_kv_gives_the_sdpa_logits(device):
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=96, vocab_size=97, max_seq_len=64)
    model = Transformer(cfg, device=device)
    model.reset_parameters(seed=0, std=0.2)
    model.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6)).to(device)
    chunks = [6, 1, 1, 2, 1]  # a prefill, decode steps and a chunk into a non-empty cache

    @torch.no_grad()
    def run():
        cache, out, t = DynamicCache(cfg.n_layer), [], 0
        for c in chunks:
            out.append(model(tokens[:, t:t + c], cache))
            t += c
        return torch.cat(out, dim=1)  # (B, 11, vocab)

    want = run()
    model.set_attention_impl(split_kv(3))
    try:
        got = run()
    finally:
        model.set_attention_impl("sdpa")
    torch.testing.assert_close(got, want, **tol(device, atol=1e-5, rtol=1e-5))
    assert split_kv(3).__name__ == "split_kv(3)"


# ----------------------------------------------------------------------------- bad input
def test_bad_n_splits(device):
    q, k, v = qkv(1, 4, 2, 1, 8, 8, seed=0, device=device)
    with pytest.raises(ValueError, match="n_splits must be >= 1, got 0"):
        split_kv_attention(q, k, v, n_splits=0)
    with pytest.raises(ValueError, match="n_splits must be >= 1, got -2"):
        split_kv(-2)
    with pytest.raises(TypeError, match="n_splits must be an int, got float 2.0"):
        split_kv(2.0)


def test_bad_block_size(device):
    q, k, v = qkv(1, 4, 2, 1, 8, 8, seed=0, device=device)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        online_softmax_attention(q, k, v, block_size=0)


def test_bad_mask_shape(device):
    q, k, v = qkv(2, 4, 2, 3, 8, 8, seed=0, device=device)
    bad = torch.ones(2, 1, 3, 7, dtype=torch.bool, device=device)  # 7 keys for 8
    for fn in (split_kv_attention, online_softmax_attention, partial_attention):
        with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 3, 7\) does not broadcast to .* \(2, 4, 3, 8\)"):
            fn(q, k, v, bad)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        split_kv_attention(q, k, v, torch.ones(3, 8, device=device))


def test_mismatched_k_and_v(device):
    q, k, v = qkv(1, 4, 2, 1, 8, 8, seed=0, device=device)
    with pytest.raises(ValueError, match=r"k and v must have the same shape, got \(1, 2, 8, 8\) and \(1, 2, 7, 8\)"):
        split_kv_attention(q, k, v[:, :, :7])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        online_softmax_attention(q, k, v[:, :, :7])
