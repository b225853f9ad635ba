import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import tol
from kvlib import attention, attention_mask, causal_mask, repeat_kv, softmax

pytestmark = pytest.mark.device

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, different summation orders


def naive_attention(q, k, v, mask):
    """Loop-level definition: one query, one head at a time, with math.exp."""
    B, H, Tq, D = q.shape
    n_rep = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // n_rep], v[b, h // n_rep]
            for i in range(Tq):
                allowed = [j for j in range(kh.shape[0]) if mask is None or bool(mask[b if mask.shape[0] > 1 else 0, 0, i, j])]
                s = [float(q[b, h, i] @ kh[j]) / math.sqrt(D) for j in allowed]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                z = sum(w)
                out[b, h, i] = sum((wi / z) * vh[j] for wi, j in zip(w, allowed))
    return out


def test_causal_mask_is_the_lower_triangle_when_square(device):
    assert torch.equal(causal_mask(4, 4, device=device), torch.ones(4, 4, dtype=torch.bool, device=device).tril())


def test_causal_mask_is_bottom_right_aligned(device):
    # 2 new queries after 3 cached keys: query 0 is position 3, query 1 is position 4.
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool, device=device)
    assert torch.equal(causal_mask(2, 5, device=device), expected)
    # a decode step sees every key
    assert causal_mask(1, 7, device=device).all()


def test_torch_is_causal_is_top_left_aligned_which_is_why_we_build_our_own(device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, 8, device=device) for T in (1, 5, 5))
    ours = attention(q, k, v, causal_mask(1, 5, device=device))
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(top_left, v[:, :, :1])  # sees only the first key
    assert not torch.allclose(ours, top_left)


@given(q_len=st.integers(1, 6), extra=st.integers(0, 6), seed=st.integers(0, 1000))
def test_padding_free_mask_reduces_to_causal(q_len, extra, seed, device):
    k_len = q_len + extra
    all_valid = torch.ones(3, k_len, dtype=torch.bool, device=device)
    m = attention_mask(q_len, k_len, all_valid)
    assert m.shape == (3, 1, q_len, k_len)
    assert torch.equal(m, causal_mask(q_len, k_len, device=device).expand(3, 1, q_len, k_len))


def test_padding_mask_hides_pad_keys(device):
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]], device=device)
    m = attention_mask(1, 4, valid)
    assert m[0, 0, 0].tolist() == [False, False, True, True]
    assert m[1, 0, 0].all()


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), n_rep=st.integers(1, 3), Tq=st.integers(1, 4),
       extra=st.integers(0, 4), seed=st.integers(0, 10_000))
def test_attention_matches_loop_definition(B, H_kv, n_rep, Tq, extra, seed, device):
    g = torch.Generator().manual_seed(seed)
    D, Tk = 8, Tq + extra
    q = torch.randn(B, H_kv * n_rep, Tq, D, generator=g).to(device)
    k, v = torch.randn(B, H_kv, Tk, D, generator=g).to(device), torch.randn(B, H_kv, Tk, D, generator=g).to(device)
    mask = attention_mask(Tq, Tk, device=device)
    torch.testing.assert_close(attention(q, k, v, mask), naive_attention(q, k, v, mask), **tol(device, **TOL))


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), n_rep=st.integers(1, 4), T=st.integers(1, 5), seed=st.integers(0, 999))
def test_repeat_kv_equals_grouped_einsum(B, H_kv, n_rep, T, seed, device):
    g = torch.Generator().manual_seed(seed)
    D = 4
    q = torch.randn(B, H_kv * n_rep, T, D, generator=g).to(device)
    k = torch.randn(B, H_kv, T, D, generator=g).to(device)
    scores_repeat = q @ repeat_kv(k, n_rep).transpose(-2, -1)
    qg = q.view(B, H_kv, n_rep, T, D)  # query heads grouped under their KV head
    scores_group = torch.einsum("bgrqd,bgkd->bgrqk", qg, k).reshape(B, H_kv * n_rep, T, T)
    torch.testing.assert_close(scores_repeat, scores_group, **tol(device, **TOL))
    for h in range(H_kv * n_rep):  # head h reads KV head h // n_rep
        assert torch.equal(repeat_kv(k, n_rep)[:, h], k[:, h // n_rep])


def test_softmax_is_stable_for_huge_logits(device):
    x = torch.tensor([[1000.0, 1001.0, 1002.0]], device=device)
    expected = torch.softmax(x - 1002.0, dim=-1)
    torch.testing.assert_close(softmax(x), expected)
    assert torch.isfinite(softmax(x)).all()
    naive = torch.exp(x) / torch.exp(x).sum()  # overflows to inf/inf = nan
    assert torch.isnan(naive).any()


def test_fully_masked_row_gives_zeros_not_nan(device):
    x = torch.full((1, 3), float("-inf"), device=device)
    assert torch.equal(softmax(x), torch.zeros(1, 3, device=device))


def test_attention_matches_torch_sdpa_with_gqa(device):
    torch.manual_seed(1)
    q, k, v = (torch.randn(*shape, device=device) for shape in ((2, 6, 3, 16), (2, 2, 7, 16), (2, 2, 7, 16)))
    mask = attention_mask(3, 7, device=device)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v, mask), ref, **tol(device, **TOL))


@pytest.mark.parametrize(
    "q_shape,k_shape,match",
    [
        ((1, 4, 2, 8), (1, 3, 2, 8), "4 query heads cannot be split evenly over 3 KV heads"),
        ((1, 4, 2, 8), (1, 2, 2, 4), "disagree on batch or head_dim"),
        ((4, 2, 8), (1, 2, 2, 8), "must be 4-D"),
    ],
)
def test_bad_attention_shapes(q_shape, k_shape, match, device):
    with pytest.raises(ValueError, match=match):
        attention(*(torch.randn(shape, device=device) for shape in (q_shape, k_shape, k_shape)))


def test_bad_mask_arguments(device):
    with pytest.raises(ValueError, match="q_len=5 queries cannot be the last tokens of only k_len=3"):
        causal_mask(5, 3, device=device)
    with pytest.raises(ValueError, match="key_valid must be a"):
        attention_mask(1, 4, torch.ones(2, 3, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="n_rep must be >= 1"):
        repeat_kv(torch.randn(1, 1, 1, 1, device=device), 0)


def test_the_mask_is_decided_per_layer_so_mixed_kernels_each_get_what_they_need(device):
    """Layer 0 keeps SDPA's fast path, layer 1 runs a kernel of one's own that needs an explicit
    mask: a prefill into a non-empty cache and a decode step both match all-reference logits."""
    import kvlib

    cfg = kvlib.ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=64)
    model = kvlib.Transformer(cfg, device=device)
    model.reset_parameters(seed=1, std=0.2)
    seen = []

    def mine(q, k, v, mask):
        seen.append(None if mask is None else tuple(mask.shape))
        return kvlib.attention(q, k, v, mask)

    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0)).to(device)
    ref_cache, mix_cache = kvlib.DynamicCache(2), kvlib.DynamicCache(2)
    for chunk in (ids[:, :4], ids[:, 4:8], ids[:, 8:]):  # fresh prefill, chunk into a cache, decode
        model.set_attention_impl("reference")
        want = model(chunk, ref_cache)
        model.layers[1].attn.impl = mine
        got = model(chunk, mix_cache)
        torch.testing.assert_close(got, want, **tol(device, rtol=1e-5, atol=1e-5))
    assert seen == [(1, 1, 4, 4), (1, 1, 4, 8), (1, 1, 1, 9)]  # the learner's kernel always gets a mask
    model.set_attention_impl("sdpa")


def test_only_a_query_that_sees_nothing_is_let_see_itself(device):
    """Left pads see no key and get their own slot (no NaN); a right-padded row whose new token
    is not in the last column keeps exactly its own keys: the empty last slot stays masked."""
    from kvlib.attention import attention_mask

    left = torch.tensor([[False, False, True, True]], device=device)
    m = attention_mask(4, 4, left, pads_see_themselves=True)[0, 0]
    assert m[0].tolist() == [True, False, False, False] and m[1].tolist() == [False, True, False, False]
    assert m[3].tolist() == [False, False, True, True]
    right = torch.tensor([[True, True, False, False]], device=device)  # a decode query at column 1 of a wider cache
    m = attention_mask(1, 4, right, pads_see_themselves=True)[0, 0]
    assert m.tolist() == [[True, True, False, False]]


# -- decode_attention: a KV head read once for all the query heads it serves ----------------------
from kvlib import decode_attention  # noqa: E402
from kvlib.attention import attend  # noqa: E402

DECODE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6),  # fp32, another summation order
              torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}  # bf16: 8 significant bits


@given(B=st.integers(1, 3), H_kv=st.integers(1, 4), G=st.integers(1, 5), S=st.integers(1, 40),
       padded=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 10_000))
def test_decode_attention_matches_sdpa_for_any_group_size_and_padding(B, H_kv, G, S, padded, bf16, seed, device):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    q = torch.randn(B, H_kv * G, 1, 16, generator=g).to(device).to(dtype)
    k, v = (torch.randn(B, H_kv, S, 16, generator=g).to(device).to(dtype) for _ in range(2))
    mask = None
    if padded:  # left padding per row; the newest key (the token itself) is never padding
        pads = torch.randint(0, S, (B,), generator=g).to(device)
        mask = (torch.arange(S, device=device)[None] >= pads[:, None])[:, None, None]  # (B, 1, 1, S)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(decode_attention(q, k, v, mask), want, **tol(device, **DECODE_TOL[dtype]))


def test_decode_attention_keeps_each_query_head_on_its_own_kv_head(device):
    # Query head h reads KV head h // G. A grouping that mixed the order (g-major instead
    # of kv-major) would still look like attention, so plant values that tell heads apart.
    B, H_kv, G, S, D = 1, 3, 3, 5, 8
    q = torch.zeros(B, H_kv * G, 1, D, device=device)  # equal scores: the output is each KV head's mean value
    k = torch.randn(B, H_kv, S, D, device=device)
    v = torch.arange(H_kv, dtype=torch.float32, device=device).view(1, H_kv, 1, 1).expand(B, H_kv, S, D)
    y = decode_attention(q, k, v)  # (1, 9, 1, 8)
    assert y[0, :, 0, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    q2, v = torch.randn(B, H_kv * G, 1, D, device=device), torch.randn(B, H_kv, S, D, device=device)  # random queries, values:
    wrong = torch.nn.functional.scaled_dot_product_attention(  # query heads grouped g-major
        q2.reshape(B, G, H_kv, D).transpose(1, 2), k, v).reshape(B, H_kv * G, 1, D)
    right = torch.nn.functional.scaled_dot_product_attention(q2, k, v, enable_gqa=True)
    assert not torch.allclose(wrong, right)  # the check below can fail
    torch.testing.assert_close(decode_attention(q2, k, v), right, **tol(device, **DECODE_TOL[torch.float32]))


def test_attend_sends_fp32_cpu_decode_steps_with_gqa_to_decode_attention(monkeypatch, device):
    import sys
    A = sys.modules["kvlib.attention"]  # the module (kvlib.attention the name is the function)
    calls = []
    monkeypatch.setattr(A, "decode_attention", lambda *a: calls.append(a[0].dtype) or a[0])
    q, k = torch.randn(1, 6, 1, 8, device=device), torch.randn(1, 2, 4, 8, device=device)
    attend(q, k, k, None)  # fp32 decode with GQA: grouped
    attend(q.bfloat16(), k.bfloat16(), k.bfloat16(), None)  # bf16: SDPA's own path
    attend(torch.randn(1, 2, 1, 8, device=device), k, k, None)  # no GQA: nothing to share
    attend(torch.randn(1, 6, 4, 8, device=device), k, k, None)  # a prefill: many queries
    attend(q, k, k, None, "reference")  # another kernel asked for
    assert calls == [torch.float32]


def test_attend_leaves_what_decode_attention_cannot_take_to_sdpa_as_before(device):
    # SDPA broadcasts a batch of one against another batch, and takes a float mask; attend
    # must keep taking them (chapter 10 shows a cache whose keys lost their batch axis),
    # so those steps do not go to decode_attention, which would refuse them.
    q, k = torch.randn(2, 6, 1, 8, device=device), torch.randn(1, 2, 4, 8, device=device)
    v = torch.randn(2, 2, 4, 8, device=device)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, None), want, **tol(device, **DECODE_TOL[torch.float32]))
    k2 = torch.randn(2, 2, 4, 8, device=device)
    bias = torch.randn(2, 1, 1, 4, device=device)  # a float mask: added to the scores
    want = torch.nn.functional.scaled_dot_product_attention(q, k2, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(attend(q, k2, v, bias), want, **tol(device, **DECODE_TOL[torch.float32]))


@pytest.mark.parametrize("q_shape, mask_shape, match", [
    ((1, 4, 2, 8), None, "one query"),
    ((1, 4, 1, 8), (1, 1, 2, 5), r"mask must be bool \(1 or 1, 1, 1, 5\)"),
])
def test_decode_attention_refuses_what_it_cannot_compute(q_shape, mask_shape, match, device):
    k = torch.randn(1, 2, 5, 8, device=device)
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=match):
        decode_attention(torch.randn(q_shape, device=device), k, k, mask)
