"""Prompt compression (kvlib.press) and the needle test (kvlib.needle), each against a reference.

- Each press's scores and kept tokens equal a brute-force reference of its paper's algorithm
  (as kvpress 0.5.5 defines it), written below with loops and an explicit softmax over
  `repeat_kv`-style heads, sharing no code with kvlib.press: on random tensors (hypothesis)
  and on the queries and keys a random tiny model really produced.
- A ratio of 0 gives the full cache's logits bit for bit, prefill and decode: the cache's
  attention takes the model's default kernel path.
- Decoding after compression equals a full recompute whose attention masks, per layer and
  per KV head, exactly the prompt keys the press evicted.
- PressCache passes kvlib.check.check_cache (tests/test_conformance.py), and bad input is refused.
- The needle: planting keeps the filler's order and puts the fact where the depth says, and
  teacher-forced scoring agrees with a greedy decode loop.
"""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import DynamicCache, ModelConfig, Transformer
from kvlib.needle import Needle, haystack, needle_sweep, retrieve, streamed
from kvlib.press import (PRESSES, ExpectedAttentionPress, PressCache, PyramidKVPress, SnapKVPress,
                         StreamingLLMPress, TOVAPress, keep_top, prefill, prefill_many)

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

CFG = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=256,
                  rope_base=500.0)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CFG)
    m.reset_parameters(seed=0, std=0.2)
    return m


def ids(n, seed=0, batch=1):
    return torch.randint(0, CFG.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- brute-force references: the papers' algorithms, one number at a time, in float64 -------------------
def rows_softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def ref_window_weights(q, k, b, h, w):
    """[i][j]: the weight query S-w+i of head h pays key j (j <= S-w+i), explicit softmax."""
    S, D, G = k.shape[2], k.shape[3], q.shape[1] // k.shape[1]
    out = []
    for i in range(w):
        t = S - w + i
        logits = [dot(q[b, h, t].tolist(), k[b, h // G, j].tolist()) / math.sqrt(D) for j in range(t + 1)]
        out.append(rows_softmax(logits))
    return out


def ref_snapkv(q, k, window, kernel):
    """SnapKV: mean window attention, zero-padded average pool, mean over the group; window = +inf."""
    q, k = q.double(), k.double()
    B, H, S, _ = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    out = torch.zeros(B, H_kv, S, dtype=torch.float64)
    for b in range(B):
        for kv in range(H_kv):
            for g in range(G):
                wts = ref_window_weights(q, k, b, kv * G + g, window)
                mean = [sum(wts[i][j] for i in range(window)) / window for j in range(S - window)]
                r = kernel // 2
                pooled = [sum(mean[m] for m in range(j - r, j + r + 1) if 0 <= m < S - window) / kernel
                          for j in range(S - window)]
                for j in range(S - window):
                    out[b, kv, j] += pooled[j] / G
            out[b, kv, S - window:] = math.inf
    return out


def ref_tova(q, k):
    q, k = q.double(), k.double()
    B, H, S, _ = q.shape
    out = torch.zeros(B, k.shape[1], S, dtype=torch.float64)
    for b in range(B):
        per_head = [ref_window_weights(q, k, b, h, 1)[0] for h in range(H)]
        for j in range(S - 1):
            out[b, :, j] = sum(w[j] for w in per_head) / H
        out[b, :, S - 1] = math.inf
    return out


def rotate(x, p, base):
    """RoPE, rotate-half layout, of a vector x (list) at position p."""
    D = len(x)
    y = list(x)
    for i in range(D // 2):
        a = p * base ** (-2 * i / D)
        y[i] = x[i] * math.cos(a) - x[i + D // 2] * math.sin(a)
        y[i + D // 2] = x[i + D // 2] * math.cos(a) + x[i] * math.sin(a)
    return y


def ref_expected_attention(q, k, v, base, n_sink, n_future, cov=True):
    """Pre-RoPE queries (rotated back), their mean and covariance, the rotation averaged over the
    next n_future positions, E[exp] = exp(k.mu/sqrt(D) + k'Ck/2D), softmax, group mean, * ||v||."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, S, D = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    R = torch.zeros(D, D, dtype=torch.float64)
    for t in range(S, S + n_future):
        for j in range(D):
            e = [0.0] * D
            e[j] = 1.0
            R[:, j] += torch.tensor(rotate(e, t, base), dtype=torch.float64) / n_future
    out = torch.zeros(B, H_kv, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            pre = torch.tensor([rotate(q[b, h, t].tolist(), -t, base) for t in range(n_sink, S)], dtype=torch.float64)
            mu = pre.mean(0)
            c = pre - mu
            sigma = sum(torch.outer(c[i], c[i]) for i in range(len(c))) / len(c)  # (D, D)
            mu_r, cov_r = R @ mu, R @ sigma @ R.T
            logits = [float(k[b, h // G, j] @ mu_r) / math.sqrt(D)
                      + cov * float(k[b, h // G, j] @ cov_r @ k[b, h // G, j]) / (2 * D) for j in range(n_sink, S)]
            for j, p in zip(range(n_sink, S), rows_softmax(logits)):
                out[b, h // G, j] += p / G
        for kv in range(H_kv):
            for j in range(n_sink, S):
                out[b, kv, j] *= float(v[b, kv, j].norm())
        out[b, :, :n_sink] = math.inf
    return out


def ref_kept(scores, n):
    """Positions of the n best scores, older first on a tie, ascending."""
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(ranked[:n])


def ref_pyramid_budget(S, ratio, layer, n_layer, window, beta):
    """PyramidKV's per-layer budget (KVCache-Factory's formula, as kvpress 0.5.5 applies it)."""
    total = S * (1 - ratio)
    lo, hi = total / beta, 2 * total - total / beta
    if hi >= S - window:
        hi, lo = S - window, 2 * total - (S - window)
    if not (S >= hi >= lo >= window):
        return max(1, round(S * (1 - ratio)))
    return round(hi - layer * (hi - lo) / (n_layer - 1)) if n_layer > 1 else round(hi)


def assert_same_ranking(got, ref, n):
    """Scores equal to rounding (finite ones), and the kept sets equal unless a near-tie sits at the cut."""
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got.double()[fin], ref[fin], rtol=1e-4, atol=1e-7)
    assert (got.double()[~fin] > got.double()[fin].max() if fin.any() else True).all()
    for b in range(ref.shape[0]):
        for h in range(ref.shape[1]):
            r = sorted(ref[b, h].tolist(), reverse=True)
            near_tie = n < len(r) and math.isfinite(r[n - 1]) and abs(r[n - 1] - r[n]) < 1e-5 * max(1e-3, abs(r[n]))
            assume(not near_tie)
            want = ref_kept(ref[b, h].tolist(), n)
            assert keep_top(got[b:b + 1, h:h + 1], n)[0, 0].tolist() == want


def qkv(seed, B, H_kv, G, S, D=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H_kv * G, S, D, generator=g), torch.randn(B, H_kv, S, D, generator=g),
            torch.randn(B, H_kv, S, D, generator=g))


# -- scores on random tensors ---------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 2), H_kv=st.integers(1, 2), G=st.integers(1, 3),
       S=st.integers(6, 14), window=st.integers(1, 4), kernel=st.sampled_from([1, 3, 5]), keep=st.integers(1, 14))
def test_snapkv_scores_and_keeps_what_the_paper_does(seed, B, H_kv, G, S, window, kernel, keep):
    q, k, v = qkv(seed, B, H_kv, G, S)
    got = SnapKVPress(window_size=window, kernel_size=kernel).score(q, k, v)
    assert got.shape == (B, H_kv, S)
    assert_same_ranking(got, ref_snapkv(q, k, window, kernel), min(keep, S))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 2), H_kv=st.integers(1, 2), G=st.integers(1, 3),
       S=st.integers(2, 12), keep=st.integers(1, 12))
def test_tova_scores_and_keeps_what_the_paper_does(seed, B, H_kv, G, S, keep):
    q, k, v = qkv(seed, B, H_kv, G, S)
    got = TOVAPress().score(q, k, v)
    assert_same_ranking(got, ref_tova(q, k), min(keep, S))
    assert (got == got[:, :1]).all()  # one choice for every KV head


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), H_kv=st.integers(1, 2), G=st.integers(1, 2), S=st.integers(5, 10),
       n_sink=st.integers(0, 3), n_future=st.integers(1, 20), cov=st.booleans(), keep=st.integers(1, 10))
def test_expected_attention_scores_and_keeps_what_its_definition_says(seed, H_kv, G, S, n_sink, n_future, cov, keep):
    q, k, v = qkv(seed, 1, H_kv, G, S)
    q = torch.stack([torch.tensor([rotate(q[0, h, t].tolist(), t, 500.0) for t in range(S)]) for h in range(q.shape[1])])[None]
    press = ExpectedAttentionPress(n_future_positions=n_future, n_sink=n_sink, use_covariance=cov)
    got = press.score(q.float(), k, v, rope_base=500.0)
    assert_same_ranking(got, ref_expected_attention(q, k, v, 500.0, n_sink, n_future, cov), min(keep, S))


def test_expected_attention_without_covariance_drops_the_quadratic_term():
    q, k, v = qkv(3, 1, 2, 2, 9)
    a = ExpectedAttentionPress(use_covariance=False, n_future_positions=7).score(q, k, v, 500.0)
    b = ExpectedAttentionPress(use_covariance=True, n_future_positions=7).score(q, k, v, 500.0)
    assert not torch.allclose(a, b)


@settings(max_examples=50, deadline=None)
@given(S=st.integers(2, 40), n_sink=st.integers(0, 6), ratio=st.floats(0.0, 0.95))
def test_streaming_llm_keeps_the_sinks_and_the_most_recent(S, n_sink, ratio):
    assume(S > n_sink)
    q, k, v = qkv(0, 1, 2, 1, S)
    press = StreamingLLMPress(n_sink=n_sink)
    n = press.n_kept(S, ratio)
    got = keep_top(press.score(q, k, v), n)[0, 0].tolist()
    # kvpress: ones on the sinks and the last n - n_sink tokens, zeros between
    n_pruned = S - int(S * (1 - ratio))
    ones = [j for j in range(S) if j < n_sink or j >= n_sink + n_pruned]
    assert n == max(1, int(S * (1 - ratio)))
    if int(S * (1 - ratio)) == 0:  # kvpress keeps one token, any (all scores 0); we keep the newest
        assert got == ([0] if n_sink else [S - 1])
    elif n >= n_sink:
        assert got == ones
    else:  # kvpress keeps n of its n_sink tied sinks, any; we keep the oldest
        assert got == list(range(n))


@settings(max_examples=200, deadline=None)
@given(S=st.integers(2, 3000), ratio=st.floats(0.0, 0.99), window=st.integers(1, 64),
       beta=st.integers(1, 30), n_layer=st.integers(1, 32))
def test_pyramid_budgets_follow_the_formula_and_sum_to_the_ratio(S, ratio, window, beta, n_layer):
    assume(S > window)
    press = PyramidKVPress(window_size=window, beta=beta)
    got = [press.n_kept(S, ratio, i, n_layer) for i in range(n_layer)]
    assert got == [ref_pyramid_budget(S, ratio, i, n_layer, window, beta) for i in range(n_layer)]
    assert got == sorted(got, reverse=True)  # a pyramid: the lower layers keep more
    if len(set(got)) > 1:  # a real pyramid keeps the whole cache's share, to rounding
        assert abs(sum(got) - n_layer * S * (1 - ratio)) <= n_layer


def test_pyramid_at_kvpress_defaults_is_snapkv_where_the_last_layer_would_fall_under_the_window():
    press = PyramidKVPress()  # window 64, beta 20: the last layer keeps (average kept) / 20
    assert len({press.n_kept(8192, 0.75, i, 30) for i in range(30)}) == 30  # 2,048 kept: a pyramid
    assert {press.n_kept(4096, 0.75, i, 30) for i in range(30)} == {1024}  # 1,024 / 20 < 64: none
    assert {press.n_kept(512, 0.75, i, 30) for i in range(30)} == {128}
    # 256 of 512: the first layer is clipped to 512 - 64 = 448, so the last gets 2 * 256 - 448 = 64
    got = [press.n_kept(512, 0.5, i, 30) for i in range(30)]
    assert got[0] == 448 and got[-1] == 64


# -- on a model: the queries and keys it really made ----------------------------------------------------
def recorded_prefill(model, tokens):
    """The prompt's queries and keys per layer, recorded by a plain attention function."""
    seen = []

    def record(q, k, v, mask):
        seen.append((q.clone(), k.clone(), v.clone()))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    model.set_attention_impl(record)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        model.set_attention_impl("sdpa")
    return seen


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "tova", "expected_attention", "streaming_llm"])
def test_each_press_keeps_what_the_reference_keeps_on_a_model(model, name):
    tokens = ids(40, seed=5, batch=2)
    kw = {"snapkv": dict(window_size=8), "pyramidkv": dict(window_size=4, beta=2),
          "expected_attention": dict(n_future_positions=16)}.get(name, {})
    press, ratio = PRESSES[name](**kw), 0.75
    cache, _ = prefill(model, tokens, press, ratio)
    for layer, (q, k, v) in enumerate(recorded_prefill(model, tokens)):
        if name in ("snapkv", "pyramidkv"):
            ref = ref_snapkv(q, k, kw["window_size"], 5)
        elif name == "tova":
            ref = ref_tova(q, k)
        elif name == "expected_attention":
            ref = ref_expected_attention(q, k, v, CFG.rope_base, 4, 16)
        else:
            ref = torch.cat([torch.full((2, 2, 4), math.inf), torch.arange(4, 40.).expand(2, 2, 36)], -1)
        n = (ref_pyramid_budget(40, ratio, layer, CFG.n_layer, 4, 2) if name == "pyramidkv"
             else max(1, int(40 * (1 - ratio))))
        got = cache.kept_positions(layer)
        assert got.shape == (2, CFG.n_kv_head, n)
        for b in range(2):
            for h in range(CFG.n_kv_head):
                assert got[b, h].tolist() == ref_kept(ref[b, h].tolist(), n), (name, layer, b, h)
    if name == "pyramidkv":
        assert [cache.get_seq_length(i) for i in range(3)] == [15, 10, 5]  # 40 * 0.25 = 10 on average: 10/2 = 5 up to 2 * 10 - 5


def test_a_ratio_of_zero_is_the_full_cache_bit_for_bit(model):
    tokens = ids(24, seed=2, batch=2)
    for name in PRESSES:
        full = DynamicCache(CFG.n_layer)
        want = [kvlib.prefill(model, tokens, full)]
        cache, got = prefill(model, tokens, name if name not in ("snapkv", "pyramidkv") else
                             PRESSES[name](window_size=8), 0.0)
        got = [got]
        for t in range(4):
            tok = want[-1].argmax(-1)
            want.append(kvlib.decode_step(model, tok, full))
            got.append(kvlib.decode_step(model, tok, cache))
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
        assert cache.get_seq_length() == 28


def masked_recompute(model, tokens, S, kept):
    """Logits of a full forward over ``tokens`` where queries from position S on see, per layer and
    per KV head, only the kept prompt keys (``kept[layer]`` (B, H_kv, n)) and every later key."""
    calls = []

    def attn(q, k, v, mask):
        layer = len(calls) % CFG.n_layer
        calls.append(layer)
        B, H, T, D = q.shape
        G = H // k.shape[1]
        out = torch.zeros_like(q)
        for b in range(B):
            for h in range(H):
                keep = set(kept[layer][b, h // G].tolist())
                for t in range(T):
                    see = [j for j in range(t + 1) if t < S or j >= S or j in keep]
                    logits = torch.stack([q[b, h, t] @ k[b, h // G, j] for j in see]) / math.sqrt(D)
                    w = torch.softmax(logits.double(), 0).float()
                    out[b, h, t] = sum(w[i] * v[b, h // G, j] for i, j in enumerate(see))
        return out

    model.set_attention_impl(attn)
    try:
        with torch.no_grad():
            return model(tokens)
    finally:
        model.set_attention_impl("sdpa")


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "tova", "expected_attention", "streaming_llm"])
def test_decoding_after_compression_equals_a_recompute_masking_the_evicted_keys(model, name):
    S, steps = 20, 4
    tokens = ids(S + steps, seed=9, batch=2)
    press = PRESSES[name](window_size=4, beta=1) if name == "pyramidkv" else (
        PRESSES[name](window_size=4) if name == "snapkv" else PRESSES[name]())
    cache, logits = prefill(model, tokens[:, :S], press, 0.5)
    kept = [cache.kept_positions(i).clone() for i in range(CFG.n_layer)]
    got = [logits]
    for t in range(S, S + steps - 1):
        got.append(kvlib.decode_step(model, tokens[:, t], cache))
    want = masked_recompute(model, tokens, S, kept)[:, S - 1:S + steps - 1]  # (B, steps, vocab)
    torch.testing.assert_close(torch.stack(got, 1), want, atol=1e-4, rtol=1e-4)
    assert cache.kept_positions(0)[0, 0, -steps + 1:].tolist() == list(range(S, S + steps - 1))
    # the recompute is not the full cache: eviction changed the logits
    assert not torch.allclose(want, model(tokens)[:, S - 1:S + steps - 1], atol=1e-3)


def test_prefill_many_gives_each_press_what_prefill_gives_it(model):
    tokens = ids(30, seed=4)
    settings_ = [("tova", 0.5), (SnapKVPress(window_size=4), 0.75), ("streaming_llm", 0.25)]
    caches, logits = prefill_many(model, tokens, settings_)
    for (p, r), c in zip(settings_, caches):
        alone, l1 = prefill(model, tokens, p, r)
        assert torch.equal(l1, logits)
        for i in range(CFG.n_layer):
            assert torch.equal(alone.kept_positions(i), c.kept_positions(i))
            assert torch.equal(alone.layer_kv(i)[0], c.layer_kv(i)[0])


def test_prefill_leaves_the_models_attention_as_it_found_it(model):
    model.set_attention_impl("reference")
    try:
        prefill(model, ids(20), "tova", 0.5)
        assert all(b.attn.impl == "reference" for b in model.layers)
    finally:
        model.set_attention_impl("sdpa")


# -- bad input --------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused(model):
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\)"):
            PressCache(2, "tova", bad)
    with pytest.raises(TypeError, match="compression_ratio"):
        PressCache(2, "tova", "0.5")
    with pytest.raises(ValueError, match="unknown press 'h2o'"):
        PressCache(2, "h2o", 0.5)
    with pytest.raises(TypeError, match="press must be"):
        PressCache(2, 3, 0.5)
    with pytest.raises(ValueError, match="longer than window_size=64"):
        prefill(model, ids(64), "snapkv", 0.5)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        SnapKVPress(kernel_size=4)
    with pytest.raises(ValueError, match="beta"):
        PyramidKVPress(beta=0)
    with pytest.raises(ValueError, match="n_sink=4"):
        prefill(model, ids(4), "streaming_llm", 0.5)
    with pytest.raises(ValueError, match="rope_base"):
        ExpectedAttentionPress().score(*qkv(0, 1, 1, 1, 8))
    with pytest.raises(TypeError, match="ids"):
        prefill(model, [1, 2, 3], "tova", 0.5)
    with pytest.raises(ValueError, match="non-empty list"):
        prefill_many(model, ids(8), [])


def test_a_compressing_cache_run_without_its_attention_says_how_to_fix_it(model):
    cache = PressCache(CFG.n_layer, "tova", 0.5)
    with torch.no_grad():
        model(ids(8), cache)  # the model's own kernel: no queries reach the press
        with pytest.raises(ValueError, match="kvlib.press.prefill"):
            model(ids(1), cache)


# -- the needle -------------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(n_fact=st.integers(1, 5), n_tokens=st.integers(6, 40), depth=st.floats(0, 1))
def test_the_fact_is_planted_whole_at_its_depth_in_the_filler_kept_in_order(n_fact, n_tokens, depth):
    assume(n_tokens > n_fact)
    filler, fact = list(range(100, 200)), list(range(-n_fact, 0))
    got, at = haystack(filler, fact, n_tokens, depth)
    assert len(got) == n_tokens and got[at:at + n_fact] == fact
    assert at == round(depth * (n_tokens - n_fact))
    assert [t for t in got if t >= 0] == filler[:n_tokens - n_fact]
    assert haystack(filler, fact, n_tokens, 0.0)[1] == 0 and haystack(filler, fact, n_tokens, 1.0)[0][-1] == -1


def test_haystack_refuses_bad_depths_and_short_filler():
    with pytest.raises(ValueError, match="depth"):
        haystack(range(10), [1], 5, 1.5)
    with pytest.raises(ValueError, match="filler"):
        haystack(range(3), [1], 8, 0.5)
    with pytest.raises(ValueError, match="empty"):
        haystack(range(10), [], 5, 0.5)


@pytest.mark.parametrize("question", [(), (7, 8, 9)])
def test_teacher_forced_scoring_agrees_with_a_greedy_decode_loop(model, question):
    prompt = ids(12, seed=1)
    for answer_seed in range(6):
        cache = DynamicCache(CFG.n_layer)
        logits = kvlib.prefill(model, prompt, cache)
        if answer_seed == 0:  # the model's own greedy continuation: all right
            answer = kvlib.generate(model, torch.cat([prompt, torch.tensor([question], dtype=torch.long)], 1)
                                    if question else prompt, 4)[0, -4:].tolist()
        else:
            answer = ids(4, seed=answer_seed)[0].tolist()
        right = retrieve(model, cache, logits, answer, question)
        # the reference: decode greedily, one token at a time, feeding the answer's tokens
        loop = DynamicCache(CFG.n_layer)
        last = kvlib.prefill(model, torch.cat([prompt, torch.tensor([question], dtype=torch.long)], 1)
                             if question else prompt, loop)
        want = 0
        for a in answer:
            want += int(last.argmax(-1).item() == a)
            last = kvlib.decode_step(model, torch.tensor([a]), loop)
        assert right == want
        if answer_seed == 0:
            assert right == 4


def test_needle_sweep_plants_at_each_depth_and_scores_a_chunked_prompt_as_one_prefill(model):
    encode = lambda s: [ord(c) % CFG.vocab_size for c in s]  # noqa: E731
    needle = Needle(fact="#fact#", question="?q", answer="ab")
    full = needle_sweep(model, encode, streamed(lambda n: DynamicCache(n), 8), n_tokens=40, depths=[0, 0.5, 1],
                        filler="the quick brown fox jumps over the lazy dog " * 3, needle=needle)
    assert [r.fact_at for r in full] == [0, 17, 34] and all(r.n_answer == 2 for r in full)
    by_prefill = needle_sweep(model, encode, lambda m, x: (lambda c: (c, kvlib.prefill(m, x, c)))(DynamicCache(3)),
                              n_tokens=40, depths=[0, 0.5, 1], needle=needle,
                              filler="the quick brown fox jumps over the lazy dog " * 3)
    assert [r.right for r in full] == [r.right for r in by_prefill]  # chunked = one prefill, to rounding
