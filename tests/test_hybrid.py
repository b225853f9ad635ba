"""kvlib.hybrid: a cache with a policy per layer, against the recompute that masks per layer.

The reference is written out here, not taken from kvlib.hybrid: every token of every layer kept,
a layer's mask built pair by pair from the definition of its kind, a shared layer attending with
its source's keys. The hybrid cache evicts (ring buffers, dropped chunks) and must give the same
logits: exactly, up to the rounding of a different kernel on different shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import DynamicCache, ModelConfig, Transformer
from kvlib import layers as L
from kvlib.hybrid import HybridCache, Recompute

pytestmark = pytest.mark.device

TOL = dict(atol=2e-5, rtol=2e-5)  # fp32: another kernel (masked SDPA vs fused) on other shapes


def tiny(pattern, seed=0, device="cpu"):
    cfg = ModelConfig(n_layer=len(pattern), n_head=4, n_kv_head=2, d_model=32, d_ff=48, vocab_size=97,
                      max_seq_len=512, layers=pattern)
    model = Transformer(cfg, device=device)
    model.reset_parameters(seed=seed, std=0.2)
    return model.eval()


def brute_mask(kind, n):
    """(n, n) bool: may query i see key j, from the definitions alone."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            if kind.kind == "full":
                m[i, j] = True
            elif kind.kind == "window":
                m[i, j] = i - j < kind.size or j < kind.sinks
            elif kind.kind == "chunked":
                m[i, j] = i // kind.size == j // kind.size
    return m


def reference_logits(model, ids):
    """Recompute with per-layer masks, wired by hand from the model's public parts."""
    cfg = model.config
    B, T = ids.shape
    cos, sin = kvlib.model.rope_cos_sin(torch.arange(T, device=ids.device).expand(B, T), cfg.head_dim, cfg.rope_base)
    cos, sin = cos[:, :, None], sin[:, :, None]
    x = model.embed(ids)
    kv = {}
    for i, block in enumerate(model.layers):
        kind = cfg.layers[i]
        h = block.attn_norm(x)
        a = block.attn
        H, Hk, D = a.n_head, a.n_kv_head, a.head_dim
        qkv = a.wqkv(h).view(B, T, H + 2 * Hk, D)
        q = kvlib.model.apply_rope(qkv[:, :, :H], cos, sin).transpose(1, 2)
        k = kvlib.model.apply_rope(qkv[:, :, H:H + Hk], cos, sin).transpose(1, 2)
        v = qkv[:, :, H + Hk:].transpose(1, 2)
        if kind.kind == "shared":
            k, v = kv[kind.source]
            kind = cfg.layers[kind.source]
        kv[i] = (k, v)
        mask = brute_mask(kind, T).to(ids.device)[None, None]
        y = kvlib.attention(q, k, v, mask)  # the reference attention: repeat_kv and a plain softmax
        x = x + a.wo(y.transpose(1, 2).reshape(B, T, H * D))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))


PATTERNS = {
    "gemma-like": [L.window(4), L.window(4), L.full()],
    "gpt-oss-like": [L.window(3), L.full(), L.window(3), L.full()],
    "sinks": [L.window(5, sinks=2), L.full()],
    "cla": [L.full(), L.shared(0), L.window(4), L.shared(2)],
    "chunked": [L.chunked(4), L.full(), L.chunked(3)],
}


@pytest.mark.parametrize("name", PATTERNS)
def test_model_without_cache_is_the_hand_wired_masked_recompute(name, device):
    model = tiny(PATTERNS[name], device=device)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference_logits(model, ids), **TOL)


def run_chunks(model, ids, chunks, cache):
    out, at = [], 0
    for T in chunks:
        out.append(model(ids[:, at:at + T], cache))
        at += T
    return torch.cat(out, dim=1)


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.lists(st.one_of(
        st.builds(L.window, st.integers(1, 6), st.integers(0, 2)),
        st.builds(L.chunked, st.integers(1, 6)),
        st.just(L.full())), min_size=1, max_size=3),
    share=st.booleans(),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=8),
    seed=st.integers(0, 3),
)
def test_hybrid_cache_equals_the_masked_recompute_at_every_step(pattern, share, chunks, seed, device):
    """Any pattern, any prefill chunking and decode steps: every step's logits equal the rows of
    a recompute over the whole text with per-layer masks (hypothesis)."""
    if share:
        pattern = pattern + [L.shared(len(pattern) - 1)]
    model = tiny(pattern, seed, device=device)
    n = sum(chunks)
    ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad():
        got = run_chunks(model, ids, chunks, HybridCache.for_model(model.config))
        torch.testing.assert_close(got, model(ids), **TOL)  # model(ids): kvlib.hybrid.Recompute


@pytest.mark.parametrize("name", PATTERNS)
def test_generate_with_a_hybrid_cache_gives_the_recompute_tokens(name, device):
    model = tiny(PATTERNS[name], seed=2, device=device)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    want = kvlib.generate_naive(model, ids, 16)  # no cache: the masked recompute every step
    got = kvlib.generate(model, ids, 16)  # a HybridCache by default
    assert torch.equal(got, want)


def test_while_the_text_fits_every_window_it_is_the_full_cache_bit_for_bit(device):
    """Nothing evicted, nothing masked: the same tensors reach the same kernels."""
    pattern = [L.window(32), L.full(), L.window(32, sinks=4), L.chunked(64)]
    model = tiny(pattern, device=device)
    full = model.with_layers(None)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5)).to(device)
    hyb, dyn = HybridCache.for_model(model.config), DynamicCache(4)
    with torch.no_grad():
        assert torch.equal(model(ids[:, :12], hyb), full(ids[:, :12], dyn))
        for t in range(12, 20):
            assert torch.equal(model(ids[:, t:t + 1], hyb), full(ids[:, t:t + 1], dyn))


def test_a_window_layer_holds_its_window_and_a_decode_step_writes_one_slot(device):
    model = tiny([L.window(4, sinks=1), L.full()], device=device)
    cache = HybridCache.for_model(model.config)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(ids[:, :7], cache)
        assert sorted(cache.kept_positions(0).tolist()) == [0, 3, 4, 5, 6]
        assert cache.get_seq_length(0) == 5 and cache.get_seq_length(1) == 7
        one_slot = 2 * 1 * 2 * 1 * 8 * 4  # K and V, batch 1, 2 KV heads, 1 token, head_dim 8, fp32
        for t in range(7, 12):
            before = cache.bytes_written
            model(ids[:, t:t + 1], cache)
            assert sorted(cache.kept_positions(0).tolist()) == [0] + list(range(t - 3, t + 1))
            # layer 0 wrote one slot; layer 1 (full, torch.cat) rewrote everything it holds
            assert cache.bytes_written - before == one_slot + one_slot * (t + 1)
        assert cache.nbytes == one_slot * (5 + 12)


def test_shared_layers_keep_nothing_and_read_their_source(device):
    model = tiny([L.full(), L.shared(0), L.full(), L.shared(2)], device=device)
    cache = HybridCache.for_model(model.config)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(ids, cache)
    assert cache.keys[1] is None and cache.keys[3] is None
    assert cache.layer_kv(1)[0].data_ptr() == cache.layer_kv(0)[0].data_ptr()
    assert cache.nbytes == 2 * 2 * 2 * 9 * 8 * 4  # two layers of K and V, not four
    assert not cache.lent  # no view of the step is kept once every reader has read it


def test_a_chunked_layer_starts_each_chunk_empty(device):
    model = tiny([L.chunked(4), L.full()], device=device)
    cache = HybridCache.for_model(model.config)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0)).to(device)
    held = []
    with torch.no_grad():
        for t in range(10):
            model(ids[:, t:t + 1], cache)
            held.append(cache.get_seq_length(0))
    assert held == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2] == [L.tokens_held(L.chunked(4), t + 1) for t in range(10)]


def test_crop_works_while_nothing_needed_is_evicted_and_refuses_otherwise(device):
    model = tiny([L.window(4), L.full()], device=device)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        cache = HybridCache.for_model(model.config)
        model(ids[:, :3], cache)
        cache.crop(2)  # the ring has not wrapped: slots 0-1 stay
        assert cache.kept_positions(0).tolist() == [0, 1] and cache.positions(ids[:, :1]).item() == 2
        torch.testing.assert_close(run_chunks(model, ids[:, 2:], [1, 1, 5], cache)[:, -1],
                                   model(ids[:, :9])[:, -1], **TOL)
        with pytest.raises(ValueError, match="evicted"):
            cache.crop(5)  # the window layer no longer holds positions 1-4
        cache.crop(0)
        assert cache.seq_len == 0 and cache.nbytes == 0


def test_the_cache_and_the_model_must_agree_on_the_layers(device):
    model = tiny([L.window(4), L.full()], device=device)
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="HybridCache"):
        model(ids, DynamicCache(2))
    with pytest.raises(ValueError, match="layer kinds differ"):
        model(ids, HybridCache([L.window(5), L.full()]))
    with pytest.raises(ValueError, match="layer kinds differ"):
        model.with_layers(None)(ids, HybridCache([L.window(5), L.full()]))
    with pytest.raises(ValueError, match="no step mask"):
        model(ids, HybridCache.for_model(model.config), key_valid=torch.ones(1, 3, dtype=torch.bool, device=device))


@pytest.mark.parametrize("bad, err, words", [
    (lambda: HybridCache("full"), TypeError, "sequence"),
    (lambda: HybridCache([L.latent(8)]), ValueError, "kvlib.mla"),
    (lambda: HybridCache([L.shared(0)]), ValueError, "earlier layer"),
    (lambda: Transformer(kvlib.PRESETS["tiny"].replace(layers=[L.latent(8), L.full()])), ValueError, "mla"),
])
def test_bad_input_is_named(bad, err, words):
    with pytest.raises(err, match=words):
        bad()


def test_a_shared_layer_before_its_source_is_refused(device):
    cache = HybridCache([L.full(), L.shared(0)])
    k = torch.randn(1, 2, 3, 4, device=device)
    with pytest.raises(ValueError, match="must be updated"):
        cache.update(k, k, 1)


def test_recompute_holds_everything_and_masks(device):
    cache = Recompute([L.window(2), L.full()])
    k = torch.randn(1, 1, 5, 4, device=device)
    cache.update(k, k, 0)
    assert cache.get_seq_length(0) == 5
    assert torch.equal(cache.layer_mask(0, None)[0, 0], brute_mask(L.window(2), 5).to(device))
    cache.update(k, k, 1)
    assert cache.layer_mask(1, None) is None  # plain causal: SDPA's own fast path
