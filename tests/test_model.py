"""Cached decode must compute what full recompute computes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import tol
import kvlib
from kvlib import DynamicCache, ModelConfig, StaticCache, Transformer

pytestmark = pytest.mark.device

# Cached and uncached paths differ only in summation order (one prefill GEMM vs many
# matrix-vector products), so fp32 logits agree to ~1e-6 relative; we allow 1e-4.
TOL = dict(rtol=1e-4, atol=1e-4)


def tiny(n_layer=2, n_head=4, n_kv_head=2, head_dim=8, vocab=97, tied=False, seed=0, device="cpu"):
    cfg = ModelConfig(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=n_head * head_dim,
                      d_ff=3 * n_head * head_dim, vocab_size=vocab, max_seq_len=128, tie_embeddings=tied)
    model = Transformer(cfg, device=device)
    model.reset_parameters(seed=seed, std=0.2)  # sharp logits: no argmax ties
    return model.eval()


configs = st.builds(
    dict,
    n_layer=st.integers(1, 3),
    n_kv_head=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3]),  # n_head = n_kv_head * group: MHA (1), GQA, MQA when n_kv_head == 1
    tied=st.booleans(),
    seed=st.integers(0, 10_000),
)


def build(c, device="cpu"):
    return tiny(n_layer=c["n_layer"], n_head=c["n_kv_head"] * c["group"], n_kv_head=c["n_kv_head"], tied=c["tied"],
                seed=c["seed"], device=device)


@given(c=configs, batch=st.integers(1, 3), prompt=st.integers(1, 6), steps=st.integers(1, 6),
       kind=st.sampled_from(["dynamic", "static", "static-grow"]))
def test_cached_logits_equal_full_recompute(c, batch, prompt, steps, kind, device):
    model = build(c, device)
    cfg = model.config
    g = torch.Generator().manual_seed(c["seed"])
    tokens = torch.randint(0, cfg.vocab_size, (batch, prompt + steps), generator=g).to(device)
    with torch.inference_mode():
        full = model(tokens)  # (B, T, V): every position recomputed at once
        cache = {"dynamic": DynamicCache(cfg.n_layer),
                 "static": StaticCache.for_model(cfg, batch, prompt + steps, device=device),
                 "static-grow": StaticCache.for_model(cfg, batch, 1, grow=True, device=device)}[kind]
        pieces = [model(tokens[:, :prompt], cache)]  # prefill
        for t in range(prompt, prompt + steps):  # one decode step per token
            pieces.append(model(tokens[:, t:t + 1], cache))
    assert cache.seq_len == prompt + steps
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


@given(c=configs, batch=st.integers(1, 3), prompt=st.integers(1, 5), n=st.integers(1, 8))
def test_cached_greedy_tokens_equal_naive(c, batch, prompt, n, device):
    model = build(c, device)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(c["seed"])).to(device)
    naive = kvlib.generate_naive(model, ids, n)
    assert naive.shape == (batch, prompt + n)
    for cache in (None, DynamicCache(model.config.n_layer), StaticCache.for_model(model, batch, prompt + n, device=device)):
        assert torch.equal(kvlib.generate(model, ids, n, cache=cache), naive)


def test_prefill_into_a_nonempty_cache_uses_a_bottom_right_mask(device):
    """Chunked prefill: 3 tokens, then 4 at once. The second chunk needs the offset mask."""
    model = tiny(device=device)
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        full = model(tokens)
        cache = DynamicCache(model.config.n_layer)
        chunked = torch.cat([model(tokens[:, :3], cache), model(tokens[:, 3:], cache)], dim=1)
    torch.testing.assert_close(chunked, full, **TOL)


def test_reference_attention_path_equals_sdpa_path(device):
    model = tiny(n_head=6, n_kv_head=2, device=device)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        fast = model(tokens)
        model.set_attention_impl("reference")
        slow = model(tokens)
        cache = StaticCache.for_model(model, 2, 9, device=device)
        slow_cached = torch.cat([model(tokens[:, :5], cache)] + [model(tokens[:, t:t + 1], cache) for t in range(5, 9)], 1)
    torch.testing.assert_close(slow, fast, **TOL)
    torch.testing.assert_close(slow_cached, fast, **TOL)


def test_explicit_positions_and_padding_match_unpadded_run(device):
    """A left-padded row, given its own positions and a padding mask, computes what it computes alone."""
    model = tiny(device=device)
    short = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(5)).to(device)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long, device=device), short], dim=1)  # 3 pad tokens on the left
    valid = torch.tensor([[False] * 3 + [True] * 4], device=device)
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3]], device=device)
    with torch.inference_mode():
        alone = model(short)
        out = model(padded, positions=positions, key_valid=valid)
    assert torch.isfinite(out).all()  # pad queries see themselves, so no NaN anywhere
    torch.testing.assert_close(out[:, 3:], alone, **TOL)


def test_last_only_returns_the_last_position(device):
    model = tiny(device=device)
    tokens = torch.randint(0, 97, (2, 5), device=device)
    with torch.inference_mode():
        last = model(tokens, last_only=True)
    assert last.shape == (2, 1, 97)
    torch.testing.assert_close(last, model(tokens)[:, -1:].detach(), **tol(device, rtol=1e-6, atol=1e-6))  # a (1, d) vs (T, d) matmul


def test_logits_to_keep_returns_the_last_positions(device):
    model = tiny(device=device)
    tokens = torch.randint(0, 97, (2, 6), device=device)
    with torch.inference_mode():
        full = model(tokens)
        for keep in (1, 4, 6):
            torch.testing.assert_close(model(tokens, logits_to_keep=keep), full[:, -keep:], **tol(device, rtol=1e-6, atol=1e-6))
        torch.testing.assert_close(model(tokens, logits_to_keep=0), full, rtol=0, atol=0)


@pytest.mark.parametrize("keep, err", [(7, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_logits_to_keep_bad_values(keep, err, device):
    with pytest.raises(err, match="logits_to_keep"):
        tiny(device=device)(torch.randint(0, 97, (1, 6), device=device), logits_to_keep=keep)


def test_logits_at_scores_only_the_chosen_positions(device):
    """A packed row's segment ends (vLLM's logits indices), as host ints or a tensor, in any order."""
    model = tiny(device=device)
    tokens = torch.randint(0, 97, (2, 7), device=device)
    with torch.inference_mode():
        full = model(tokens)
        for at in ([6], [0, 3, 6], [5, 1], (2, 2)):
            got = model(tokens, logits_at=at)
            assert got.shape == (2, len(at), 97)
            torch.testing.assert_close(got, full[:, list(at)], **tol(device, rtol=1e-6, atol=1e-6))  # a (K, d) vs (T, d) matmul
            torch.testing.assert_close(model(tokens, logits_at=torch.tensor(at, device=device)), got, rtol=0, atol=0)
        assert model(tokens, logits_at=[]).shape == (2, 0, 97)  # a step that samples nothing


@pytest.mark.parametrize("at, err, match", [
    ([7], IndexError, r"logits_at position 7 is outside the 7 positions \[0, 7\)"),
    ([-1], IndexError, "logits_at position -1"),
    (torch.tensor([0, 9]), IndexError, r"logits_at holds 0..9, outside the 7 positions"),
    ([1.0], TypeError, "logits_at must be a list of int positions"),
    ([True], TypeError, "logits_at must be a list of int positions"),
    (torch.tensor([[1]]), TypeError, r"logits_at must be a \(K,\) int64/int32 tensor, got torch.int64 \(1, 1\)"),
    (torch.tensor([1.0]), TypeError, "got torch.float32"),
])
def test_logits_at_bad_values(at, err, match, device):
    at = at.to(device) if isinstance(at, torch.Tensor) else at
    with pytest.raises(err, match=match):
        tiny(device=device)(torch.randint(0, 97, (1, 7), device=device), logits_at=at)


def test_logits_at_and_logits_to_keep_exclude_each_other(device):
    tokens = torch.randint(0, 97, (1, 7), device=device)
    with pytest.raises(ValueError, match=r"logits_at or last_only/logits_to_keep, not both \(logits_to_keep=1\)"):
        tiny(device=device)(tokens, logits_at=[3], last_only=True)
    with pytest.raises(ValueError, match=r"not both \(logits_to_keep=2\)"):
        tiny(device=device)(tokens, logits_at=[3], logits_to_keep=2)


def test_tied_embeddings_share_one_matrix(device):
    model = tiny(tied=True, device=device)
    assert model.tok_emb is None
    tokens = torch.tensor([[3, 5]], device=device)
    assert torch.equal(model.embed(tokens)[0, 1], model.lm_head.weight[:, 5])


# -- bad input -----------------------------------------------------------------------------
def test_token_outside_vocab(device):
    model = tiny(device=device)
    with pytest.raises(IndexError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        model(torch.tensor([[1, 97]], device=device))
    with pytest.raises(IndexError, match="token id -1"):
        model(torch.tensor([[-1]], device=device))


def test_tokens_must_be_a_2d_int_tensor(device):
    model = tiny(device=device)
    with pytest.raises(TypeError, match="int64/int32 tensor"):
        model(torch.tensor([[1.0, 2.0]], device=device))
    with pytest.raises(ValueError, match=r"\(batch, seq\) with seq >= 1"):
        model(torch.tensor([1, 2], device=device))


def test_model_rejects_sequences_past_max_seq_len(device):
    model = tiny(device=device)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long, device=device))


def test_bad_positions_shape(device):
    with pytest.raises(ValueError, match=r"positions must be \(B, T\)=\(1, 3\)"):
        tiny(device=device)(torch.zeros(1, 3, dtype=torch.long, device=device), positions=torch.arange(4, device=device))


def test_gpt2_preset_is_for_memory_math_only(device):
    with pytest.raises(ValueError, match="memory math"):
        Transformer(kvlib.PRESETS["gpt2"], device="meta")


def test_bad_attention_impl(device):
    with pytest.raises(ValueError, match="'sdpa', 'reference' or a function"):
        tiny(device=device).set_attention_impl("flash")


def test_first_layers_shares_weights_and_equals_a_truncated_forward(device):
    model = tiny(n_layer=3, device=device)
    small = model.first_layers(2)
    assert small.config.n_layer == 2 and small.layers[1] is model.layers[1]
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(9)).to(device)
    with torch.inference_mode():
        x = model.embed(tokens)
        cos, sin = kvlib.model.rope_cos_sin(torch.arange(6, device=device)[None], 8, model.config.rope_base)
        for block in model.layers[:2]:
            x = block(x, cos[:, :, None], sin[:, :, None], None, None)
        torch.testing.assert_close(small(tokens), model.lm_head(model.norm(x)), **tol(device, rtol=1e-6, atol=1e-6))
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 3\]"):
        model.first_layers(4)


def test_reset_parameters_std_and_bad_std(device):
    model = tiny(device=device)
    model.reset_parameters(seed=1, std=0.5)
    w = model.layers[0].mlp.w_gate_up.weight.detach()
    assert 0.45 < float(w.std()) < 0.55 and torch.equal(model.layers[0].attn_norm.weight, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="std must be positive"):
        model.reset_parameters(std=0)


def test_a_function_as_attention_impl_gets_the_full_mask(device):
    """A learner's kernel plugged in with set_attention_impl sees q, the whole cache and the bottom-right mask."""
    model = tiny(n_head=6, n_kv_head=2, device=device)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6)).to(device)
    seen = []

    def mine(q, k, v, mask):
        seen.append((q.shape[2], k.shape[2], tuple(mask.shape)))
        return kvlib.attention(q, k, v, mask)

    with torch.inference_mode():
        fast = model(tokens)
        model.set_attention_impl(mine)
        cache = StaticCache.for_model(model, 2, 9, device=device)
        mine_cached = torch.cat([model(tokens[:, :5], cache)] + [model(tokens[:, t:t + 1], cache) for t in range(5, 9)], 1)
    torch.testing.assert_close(mine_cached, fast, **TOL)
    assert seen[0] == (5, 5, (1, 1, 5, 5)) and seen[-1] == (1, 9, (1, 1, 1, 9))


def test_is_causal_true_in_a_decode_step_is_wrong(device):
    """SDPA's is_causal aligns the mask top-left: a one-token query then sees only key 0."""
    model = tiny(n_head=4, n_kv_head=4, device=device)
    tokens = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        full = model(tokens)[:, -1]
        model.set_attention_impl(lambda q, k, v, mask: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        cache = DynamicCache(model.config.n_layer)
        model(tokens[:, :7], cache)
        wrong = model(tokens[:, 7:], cache)[:, -1]
    assert (wrong - full).abs().max() > 1e-2


def test_the_documented_parts_wire_a_decode_step_by_hand(device):
    """The parts the docstrings name (embed, layers, attn_norm, attn.wqkv/wo/layer, mlp_norm, mlp,
    norm, lm_head) have the documented shapes and, wired by hand, give the model's decode step."""
    from kvlib.attention import attend
    from kvlib.model import apply_rope, rope_cos_sin

    model = tiny(n_layer=2, n_head=4, n_kv_head=2, head_dim=8, device=device)
    cfg = model.config
    H, H_kv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    assert len(model.layers) == cfg.n_layer
    assert model.lm_head.weight.shape == (cfg.d_model, cfg.vocab_size)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), device=device)
    ours, theirs = StaticCache.for_model(cfg, 1, 8, device=device), StaticCache.for_model(cfg, 1, 8, device=device)
    model(ids[:, :6], ours)
    model(ids[:, :6], theirs)
    new = ids[:, 6:]
    positions, mask = ours.positions(new), ours.mask(new)  # asked once, before any update
    cos, sin = rope_cos_sin(positions, D, cfg.rope_base)
    cos, sin = cos[:, :, None], sin[:, :, None]
    x = model.embed(new)
    for i, block in enumerate(model.layers):
        attn = block.attn
        assert attn.layer == i and (attn.n_head, attn.n_kv_head, attn.head_dim) == (H, H_kv, D)
        assert attn.wqkv.weight.shape == (cfg.d_model, (H + 2 * H_kv) * D)
        assert attn.wo.weight.shape == (H * D, cfg.d_model)
        qkv = attn.wqkv(block.attn_norm(x)).view(1, 1, H + 2 * H_kv, D)  # [q | k | v]
        q, k, v = qkv.split([H, H_kv, H_kv], dim=2)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        k, v = ours.update(k, v.transpose(1, 2), attn.layer)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(1, 1, H * D)
        x = x + attn.wo(y)
        x = x + block.mlp(block.mlp_norm(x))
    torch.testing.assert_close(model.lm_head(model.norm(x)), model(new, theirs), **TOL)
