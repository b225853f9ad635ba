"""Speculative decoding (kvlib.speculative) against plain greedy `kvlib.generate`.

- Lossless: for any draft, k and cache kind the tokens equal `generate`'s exactly (random
  models with std=0.2, so no argmax is decided by rounding).
- Rollback: rejected proposals leave no trace. Two runs whose drafts guess *different*
  wrong tokens end with bit-identical caches, and both equal a one-shot prefill of the
  kept tokens up to rounding (the verify forwards have other shapes than one prefill;
  the differences measured were below 4e-6, so 1e-5).
- Extremes: a draft that knows the answer is always accepted (k + 1 tokens per forward);
  one that is always wrong still gives the exact output, one token per forward.
- Sampling (temperature > 0) is lossless in distribution: a chi-square test of the output
  against the target's exact probabilities passes for three drafts, and fails once the
  residual step is dropped (the test has power). Greedy is the same code: any draft, even
  one proposing from a fixed distribution, gives `generate`'s tokens at temperature 0.
"""

import itertools
import math
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
import kvlib.speculative
from kvlib import DynamicCache, ModelConfig, PagedCache, SamplingParams, StaticCache, Transformer
from kvlib.speculative import EarlyExitDraft, PromptLookupDraft, speculative_generate

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

V = 50


@cache
def tiny(n_layer: int = 3, vocab: int = V, seed: int = 0) -> Transformer:
    cfg = ModelConfig(n_layer=n_layer, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=vocab, max_seq_len=128)
    m = Transformer(cfg)
    m.reset_parameters(seed=seed, std=0.2)
    return m.eval()


def make_cache(kind: str, model: Transformer, room: int, block_size: int = 4):
    cfg = model.config
    if kind == "dynamic":
        return DynamicCache(cfg.n_layer)
    if kind == "static":
        return StaticCache.for_model(cfg, 1, room + 3)
    if kind == "paged":
        return PagedCache.for_model(cfg, num_blocks=-(-room // block_size) + 4, block_size=block_size)
    return None


def kept_kv(cache, kept: list[int]):
    """``(read(layer) -> (k, v), n)``: what the target cache holds of ``kept`` after a call, and how
    many tokens. The call frees a paged sequence; its full blocks stay in the prefix cache, found again."""
    if isinstance(cache, PagedCache):
        sid, cached = cache.add(kept)
        return (lambda layer: cache.layer_kv(sid, layer)), cached
    return cache.layer_kv, cache.seq_len


class Scripted:
    """A test draft that knows the greedy answer ``ref``: right for the first ``right``
    tokens of each proposal, then wrong by ``+shift`` (mod V)."""

    def __init__(self, ref: list[int], right: int, shift: int = 1) -> None:
        self.ref, self.right, self.shift = ref, right, shift

    def propose(self, context_ids, k):
        n = len(context_ids)
        assert context_ids == self.ref[:n], "the context must be the greedy answer so far"
        out = self.ref[n : n + k]
        return [t if i < self.right else (t + self.shift) % V for i, t in enumerate(out)]


# -- lossless ---------------------------------------------------------------------------------------------
@given(
    k=st.integers(1, 6),
    depth=st.integers(0, 3),  # 0: prompt lookup; else an early-exit draft of that many layers
    prompt=st.lists(st.integers(0, 7), min_size=1, max_size=12),  # a small alphabet: lookups hit
    n_new=st.integers(1, 20),
    kind=st.sampled_from(["default", "dynamic", "static", "paged"]),
    block_size=st.integers(1, 5),
    seed=st.integers(0, 2),
)
def test_output_equals_generate(k, depth, prompt, n_new, kind, block_size, seed):
    model = tiny(seed=seed)
    want = kvlib.generate(model, prompt, n_new)
    draft = PromptLookupDraft() if depth == 0 else EarlyExitDraft(model, depth)
    got, stats = speculative_generate(model, prompt, n_new, draft, k=k,
                                      cache=make_cache(kind, model, len(prompt) + n_new, block_size))
    assert torch.equal(got, want)
    assert stats.steps == n_new - 1 - stats.accepted  # every step adds its accepted tokens + 1
    assert all(0 <= a <= p <= k for a, p in zip(stats.accepted_per_step, stats.proposed_per_step))


@pytest.mark.parametrize("draft", ["lookup", "early-exit"])
def test_both_drafts_are_partly_right_on_a_repetitive_prompt(draft):
    """So the lossless test above checks acceptances and rejections, not one of them only."""
    model = tiny()
    prompt = [1, 2, 3, 4, 5, 6] * 3 + [1, 2]
    d = PromptLookupDraft() if draft == "lookup" else EarlyExitDraft(model, 2)
    got, stats = speculative_generate(model, prompt, 30, d, k=4)
    assert torch.equal(got, kvlib.generate(model, prompt, 30))
    assert 0 < stats.accepted < stats.proposed
    assert 0 in stats.accepted_per_step and any(a > 0 for a in stats.accepted_per_step)


def test_a_full_depth_early_exit_draft_is_the_target_itself():
    model = tiny(n_layer=2)
    got, stats = speculative_generate(model, [4, 9, 1], 16, EarlyExitDraft(model, 2), k=4)
    assert torch.equal(got, kvlib.generate(model, [4, 9, 1], 16))
    assert stats.acceptance_rate == 1.0 and stats.steps == 3  # 1 + 3 * (4 + 1) = 16 tokens


# -- the two extremes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_draft_that_knows_the_answer_gets_k_plus_1_tokens_per_forward(k):
    model, prompt, n = tiny(), [7, 3, 3, 12], 1 + 4 * (k + 1)  # the prefill's token, then 4 full steps
    ref = kvlib.generate(model, prompt, n)[0].tolist()
    got, stats = speculative_generate(model, prompt, n, Scripted(ref, right=k), k=k)
    assert got[0].tolist() == ref
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_forward == k + 1
    assert stats.accepted_per_step == [k] * 4 and stats.steps == 4


def test_a_draft_that_is_always_wrong_still_gives_the_exact_output():
    model, prompt, n = tiny(), [7, 3, 3, 12], 15
    ref = kvlib.generate(model, prompt, n)[0].tolist()
    got, stats = speculative_generate(model, prompt, n, Scripted(ref, right=0), k=4)
    assert got[0].tolist() == ref
    assert stats.accepted == 0 and stats.tokens_per_forward == 1.0 and stats.steps == n - 1
    assert stats.proposed == sum(min(4, n - 1 - i) for i in range(1, n))  # fewer near the end


def test_never_more_than_max_new_tokens():
    model = tiny()
    ref = kvlib.generate(model, [5], 30)[0].tolist()
    for n in range(1, 9):
        got, stats = speculative_generate(model, [5], n, Scripted(ref, right=6), k=6)
        assert got[0].tolist() == ref[: 1 + n]
        assert stats.steps == (0 if n == 1 else -(-(n - 1) // 7))  # 6 accepted + 1 per step
        assert all(p <= n - 2 for p in stats.proposed_per_step)  # the bonus token is the n-th


# -- rollback --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_rejected_tokens_leave_no_trace_in_the_target_cache(kind):
    model, prompt, n = tiny(), [3, 1, 4, 1, 5, 9, 2, 6], 23
    ref = kvlib.generate(model, prompt, n)[0].tolist()
    caches = []
    for shift in (1, 2):  # the same acceptances, different rejected tokens
        c = make_cache(kind, model, len(prompt) + n, block_size=3)
        got, stats = speculative_generate(model, prompt, n, Scripted(ref, right=2, shift=shift), k=4, cache=c)
        assert got[0].tolist() == ref and 0 < stats.accepted < stats.proposed
        caches.append(c)
    one_shot = DynamicCache(model.config.n_layer)
    with torch.inference_mode():
        model(torch.tensor([ref[:-1]]), one_shot)  # the kept tokens; the last one was never fed
    (read1, n1), (read2, n2) = (kept_kv(c, ref[:-1]) for c in caches)
    n_kept = len(ref) - 1
    # paged: the full blocks, less the last token, which add() always leaves to be run
    want_n = min(n_kept // 3 * 3, n_kept - 1) if kind == "paged" else n_kept
    assert n1 == n2 == want_n
    for layer in range(model.config.n_layer):
        (k1, v1), (k2, v2) = read1(layer), read2(layer)
        assert k1.shape[2] == want_n
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        torch.testing.assert_close(k1, one_shot.keys[layer][:, :, :want_n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, one_shot.values[layer][:, :, :want_n], rtol=1e-5, atol=1e-5)


def test_an_early_exit_draft_rolls_its_own_cache_back():
    model = tiny()
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    used = EarlyExitDraft(model, 2)
    used.propose(ctx, 5)  # its cache now holds ctx + 4 of its own guesses
    other = ctx[:5] + [(ctx[5] + 1) % V, 7]  # diverges at position 5
    got = used.propose(other, 3)
    fresh = EarlyExitDraft(model, 2)
    assert got == fresh.propose(other, 3)
    assert used.tokens[: len(other)] == other and used.cache.seq_len == len(used.tokens)
    for layer in range(2):
        torch.testing.assert_close(used.cache.keys[layer], fresh.cache.keys[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(used.cache.values[layer], fresh.cache.values[layer], rtol=1e-5, atol=1e-5)


# -- prompt lookup by hand -------------------------------------------------------------------------------------------
def test_prompt_lookup_takes_the_longest_tail_and_its_most_recent_match():
    d = PromptLookupDraft(ngram_max=3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # 3-gram, the later of two matches
    assert d.propose([8, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # no [1, 2, 3] before: the 2-gram [2, 3]
    assert d.propose([5, 6, 7, 5], 4) == [6, 7, 5]  # 1-gram; stops at the end of the context
    assert d.propose([1, 2, 3, 4], 4) == [] and d.propose([4], 2) == []
    assert PromptLookupDraft(ngram_max=3, ngram_min=2).propose([5, 6, 7, 5], 4) == []
    assert d.propose(torch.tensor([[5, 6, 5]]), 1) == [6]


# -- bad input -------------------------------------------------------------------------------------------------------
def test_bad_k():
    with pytest.raises(ValueError, match="k .*got 0"):
        speculative_generate(tiny(), [1, 2], 4, PromptLookupDraft(), k=0)


def test_a_draft_with_another_vocabulary():
    with pytest.raises(ValueError, match="vocabulary \\(60 tokens\\) differs from the target's \\(50\\)"):
        speculative_generate(tiny(), [1, 2], 4, EarlyExitDraft(tiny(vocab=60), 1))


def test_a_batch_of_two():
    with pytest.raises(ValueError, match="batch of 2"):
        speculative_generate(tiny(), torch.tensor([[1, 2], [3, 4]]), 4, PromptLookupDraft())


def test_bad_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        speculative_generate(tiny(), [1, 2], 0, PromptLookupDraft())


def test_a_draft_proposing_too_many_or_foreign_tokens():
    class Bad:
        def __init__(self, out):
            self.out = out

        def propose(self, context_ids, k):
            return self.out

    with pytest.raises(ValueError, match="proposed \\[1, 2, 3\\] for k=2"):
        speculative_generate(tiny(), [1, 2], 4, Bad([1, 2, 3]), k=2)
    with pytest.raises(ValueError, match="proposed \\[50\\]"):
        speculative_generate(tiny(), [1, 2], 4, Bad([50]), k=2)
    with pytest.raises(ValueError, match=r"n_layers must be an int in \[1, 3\], got 4"):
        EarlyExitDraft(tiny(), 4)
    with pytest.raises(ValueError, match="ngram_min=3 must be <= ngram_max=2"):
        PromptLookupDraft(ngram_max=2, ngram_min=3)


# -- sampling: lossless in distribution -------------------------------------------------------------------------
# A target with a vocabulary of SV = 4 makes N_NEW = 4 tokens with k = 2: the prefill's token, then d_1, d_2 and,
# when both are kept, the bonus token (after a rejection the next step proposes one), so every branch of the
# rule runs. The exact probability of each of the 4^4 = 256 continuations comes from the target itself (plain
# forwards over all 4^3 contexts), and Pearson's chi-square goodness-of-fit test at ALPHA compares it with the
# counts of N_SAMPLES calls. Cells expected below 5 are pooled into one cell (folded into the smallest kept cell
# if the pool is still below 5). Fixed seeds, so each test is deterministic.
ALPHA = 0.001
SV, N_NEW, SPEC_K, N_SAMPLES = 4, 4, 2, 2000  # ~2 ms a call: about 5 s a test
SPROMPT = [0, 1, 2, 3, 0, 1, 2, 3]  # repetitive, so prompt lookup always has a match to propose
WRONG_Q = [0.7, 0.1, 0.05, 0.15]  # far from the target's p, which are near-uniform (std=0.1)


@cache
def small(n_layer: int) -> Transformer:
    cfg = ModelConfig(n_layer=n_layer, n_head=2, n_kv_head=1, d_model=16, d_ff=32, vocab_size=SV, max_seq_len=16)
    m = Transformer(cfg)
    m.reset_parameters(seed=1, std=0.1)  # soft logits: few continuations are rare, so few cells are pooled
    return m.eval()


class FixedDraft:
    """Proposes from one fixed distribution ``q``, whatever the context: deliberately not the target's."""

    def __init__(self, q: list[float]) -> None:
        self.q, self.vocab_size = torch.as_tensor(q, dtype=torch.float32), len(q)

    def propose(self, context_ids, k):
        raise AssertionError("speculative_generate must call propose_probs when a draft has it")

    def propose_probs(self, context_ids, k, sampling, generator):
        tokens = torch.multinomial(self.q, k, replacement=True, generator=generator).tolist()
        return tokens, self.q.expand(k, -1)  # (k, vocab): the distribution each token was drawn from


def _index(tokens) -> int:
    """A continuation's cell: its tokens read as a base-SV number."""
    return sum(t * SV ** (len(tokens) - 1 - j) for j, t in enumerate(tokens))


def exact_joint(model: Transformer) -> torch.Tensor:
    """P(x_1 .. x_N_NEW | SPROMPT) for every continuation, ``(SV ** N_NEW,)`` float64, from plain forwards."""
    ctx = list(itertools.product(range(SV), repeat=N_NEW - 1))  # row r feeds x_1 .. x_{N_NEW-1}
    with torch.inference_mode():
        p = model(torch.tensor([SPROMPT + list(c) for c in ctx])).double().softmax(-1)  # (SV^3, T + 3, SV)
    T = len(SPROMPT)
    joint = torch.empty(SV ** N_NEW, dtype=torch.float64)
    for xs in itertools.product(range(SV), repeat=N_NEW):
        row = p[_index(xs[:-1])]  # position T - 1 + j has seen SPROMPT + xs[:j]
        joint[_index(xs)] = torch.stack([row[T - 1 + j, x] for j, x in enumerate(xs)]).prod()
    return joint


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > ``x``) = Q(df / 2, x / 2), the regularised upper gamma."""
    half_df, half_x = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, half_x))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value, cells expected < 5 pooled (see above).

    The p-value is `chi2_sf`: torch alone, no scipy.
    """
    expected = probs * counts.sum()
    keep = expected >= 5
    obs, exp = counts[keep].tolist(), expected[keep].tolist()
    if not bool(keep.all()):
        pooled_obs, pooled_exp = float(counts[~keep].sum()), float(expected[~keep].sum())
        if pooled_exp >= 5:
            obs, exp = obs + [pooled_obs], exp + [pooled_exp]
        else:
            j = exp.index(min(exp))
            obs[j], exp[j] = obs[j] + pooled_obs, exp[j] + pooled_exp
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat, df = float(((o - e) ** 2 / e).sum()), len(obs) - 1
    return stat, df, chi2_sf(stat, df)


def spec_chi_square(model: Transformer, draft, n: int = N_SAMPLES, seed: int = 0):
    """Run ``speculative_generate`` ``n`` times at temperature 1: ``(stat, df, p-value, first_step)``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(SV ** N_NEW, dtype=torch.float64)
    first_step = []  # how many of the first step's SPEC_K proposals were accepted, per call
    for _ in range(n):
        out, stats = speculative_generate(model, SPROMPT, N_NEW, draft, k=SPEC_K, temperature=1.0, generator=g)
        counts[_index(out[0, len(SPROMPT):].tolist())] += 1
        first_step.append(stats.accepted_per_step[0] if stats.proposed_per_step[0] == SPEC_K else -1)
    return (*chi_square(counts, exact_joint(model)), first_step)


def test_the_chi_square_p_value_needs_no_scipy():
    """``gammaincc(df / 2, x / 2)`` is the chi-square survival function: a closed form and table values."""
    for x in (0.5, 2.0, 9.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # df = 2: exp(-x / 2)
    for df, x, p in [(1, 3.841459, 0.05), (10, 29.588298, 0.001), (100, 124.342113, 0.05)]:  # x = chi2.isf(p, df)
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-5), df
    probs = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert chi_square(probs * 100, probs) == (0.0, 2, 1.0)


@pytest.mark.parametrize("draft", ["fixed q", "prompt lookup", "early exit"])
def test_speculative_sampling_has_the_targets_distribution(draft):
    model = small(2 if draft == "early exit" else 1)
    d = {"fixed q": lambda: FixedDraft(WRONG_Q), "prompt lookup": PromptLookupDraft,
         "early exit": lambda: EarlyExitDraft(model, 1)}[draft]()
    n = 1500 if draft == "early exit" else N_SAMPLES  # a 2-layer target is slower per call
    stat, df, pvalue, first = spec_chi_square(model, d, n)
    print(f"{draft}: chi2 = {stat:.1f}, df = {df}, p = {pvalue:.3g}")
    assert pvalue > ALPHA, f"{draft}: chi2 = {stat:.1f} on {df} df, p = {pvalue:.3g} < {ALPHA}"
    # every branch ran, many times: a rejection at d_1, at d_2, and both kept (then the bonus token)
    assert min(first.count(a) for a in range(SPEC_K + 1)) > 50, [first.count(a) for a in range(SPEC_K + 1)]


def test_dropping_the_residual_step_fails_the_chi_square_test(monkeypatch):
    """Resampling a rejected guess from p instead of norm(max(0, p - q)) over-weights the draft's guesses:
    the test above must see it (so passing it means something)."""
    monkeypatch.setattr(kvlib.speculative, "_residual", lambda p, q: p)
    stat, df, pvalue, _ = spec_chi_square(small(1), FixedDraft(WRONG_Q))  # the same samples and seed
    print(f"residual dropped: chi2 = {stat:.1f}, df = {df}, p = {pvalue:.3g}")
    assert pvalue < ALPHA


def test_the_same_seed_gives_the_same_sampled_tokens():
    model = small(1)
    p = SamplingParams(temperature=0.8, top_k=3, seed=5)
    a, _ = speculative_generate(model, SPROMPT, 8, FixedDraft(WRONG_Q), sampling=p)
    b, _ = speculative_generate(model, SPROMPT, 8, FixedDraft(WRONG_Q), temperature=0.8, top_k=3, seed=5)
    assert torch.equal(a, b) and a.shape == (1, len(SPROMPT) + 8)


@pytest.mark.parametrize("draft", ["early exit", "fixed q"])
def test_greedy_is_the_temperature_0_case_of_the_same_rule(draft):
    """At temperature 0, p and the early-exit q are one-hot: accept while d == argmax p, and the residual is the
    target's own token. Even a draft sampling a fixed, spread-out q gives `generate`'s tokens exactly."""
    model, prompt = tiny(), [3, 1, 4, 1, 5, 9, 2, 6]
    want = kvlib.generate(model, prompt, 20)
    g = torch.Generator().manual_seed(0)
    for sampling in (None, SamplingParams(temperature=0.0)):
        d = EarlyExitDraft(model, 2) if draft == "early exit" else FixedDraft(torch.randn(V, generator=g).softmax(-1))
        before = torch.get_rng_state()
        got, stats = speculative_generate(model, prompt, 20, d, k=3, sampling=sampling)
        assert torch.equal(got, want)
        assert 0 < stats.accepted < stats.proposed or draft == "fixed q"
        if draft == "early exit":
            assert torch.equal(torch.get_rng_state(), before)  # greedy draws nothing: ratios are 0 or 1


class Proposing:
    """A test draft returning a fixed ``propose_probs`` answer."""

    vocab_size = SV

    def __init__(self, out):
        self.out = out

    def propose(self, context_ids, k):
        raise AssertionError("not called")

    def propose_probs(self, context_ids, k, sampling, generator):
        return self.out


_UNIFORM = torch.full((2, SV), 1 / SV)


@pytest.mark.parametrize("out, error, match", [
    (([1, 2], _UNIFORM[:1]), ValueError, r"q has shape \(1, 4\); 2 tokens need \(2, 4\)"),
    (([1, 2], torch.ones(2, SV)), ValueError, "row 0 sums to 4.0"),
    (([1, 2], torch.tensor([[0.5, 0.5, 0, 0], [0.6, 0.6, -0.2, 0]])), ValueError, "finite and >= 0, got min -0.2"),
    (([1, 2], torch.tensor([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]])), ValueError, "token 2 at position 1 with q = 0"),
    (([1, 4], _UNIFORM), ValueError, r"proposed \[1, 4\] for k=2: at most k ids in \[0, 4\)"),
    (([1, 2, 3], torch.full((3, SV), 0.25)), ValueError, r"proposed \[1, 2, 3\] for k=2"),
    (([1, 2], [[0.25] * 4] * 2), TypeError, "q must be a float tensor"),
    (([1, 2], torch.ones(2, SV, dtype=torch.long)), TypeError, "q must be a float tensor"),
    ([1, 2], TypeError, r"must return \(tokens, q\), got list"),
])
def test_a_draft_with_a_bad_distribution_is_refused(out, error, match):
    with pytest.raises(error, match=match):
        speculative_generate(small(1), SPROMPT, 4, Proposing(out), k=2, temperature=1.0, seed=0)


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match=r"does not support stop tokens, got stop=\(3,\)"):
        speculative_generate(small(1), SPROMPT, 4, PromptLookupDraft(), stop=3)
    with pytest.raises(ValueError, match="either sampling=SamplingParams"):
        speculative_generate(small(1), SPROMPT, 4, PromptLookupDraft(), sampling=SamplingParams(), top_k=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        speculative_generate(small(1), SPROMPT, 4, PromptLookupDraft(), temprature=1.0)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        speculative_generate(small(1), SPROMPT, 4, PromptLookupDraft(), temperature=-1.0)


# -- SmolLM2 ----------------------------------------------------------------------------------------------------------
@pytest.mark.smollm2
def test_smollm2_prompt_lookup_is_lossless_and_accepts_a_repeated_sentence(smollm2):
    model, tok = smollm2
    sentence = "The little robot painted the old fence blue, then it sat down to watch the sunset."
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}])
    want = kvlib.generate(model, prompt, 24)
    got, stats = speculative_generate(model, prompt, 24, PromptLookupDraft(), k=4)
    assert torch.equal(got, want)
    print(f"SmolLM2 prompt lookup: acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_forward:.2f} tokens/forward")
    assert stats.acceptance_rate > 0.5 and stats.tokens_per_forward > 2.0  # measured 0.74 and 2.56 (CPU, fp32)


# -- the expected tokens per verify step ------------------------------------------------------------------------------
class RightWithChance:
    """A draft that knows the target's greedy continuation and proposes each next token right with
    probability ``a``, independently (else a token that is surely wrong), as the formula assumes."""

    def __init__(self, want: list[int], a: float, vocab: int, seed: int) -> None:
        self.want, self.a, self.vocab = want, a, vocab
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, context_ids, k):
        n = len(context_ids)
        right = self.want[n:n + k]
        return [t if float(torch.rand((), generator=self.rng)) < self.a else (t + 1) % self.vocab for t in right]


@pytest.mark.parametrize("k, a", [(1, 0.5), (4, 0.7), (8, 0.9)])
def test_expected_tokens_per_forward_is_what_verification_makes(k, a):
    """speculative_generate on a draft whose guesses are right with chance a: each verify step
    that proposed all k guesses makes 1 + a + ... + a^k tokens on average (within 4 standard errors)."""
    model = Transformer(kvlib.PRESETS["tiny"])
    model.reset_parameters(seed=0, std=0.2)
    prompt, n = [1, 2, 3], 240
    want = kvlib.generate(model, prompt, n)[0].tolist()
    _, stats = speculative_generate(model, prompt, n, RightWithChance(want, a, 128, seed=k), k=k)
    made = torch.tensor([acc + 1.0 for p, acc in zip(stats.proposed_per_step, stats.accepted_per_step) if p == k])
    expected = kvlib.speculative.expected_tokens_per_forward(k, a)
    sem = made.std() / len(made) ** 0.5
    assert len(made) >= 30 and abs(made.mean() - expected) < 4 * sem, (made.mean(), expected, sem)


def test_expected_tokens_per_forward_by_hand():
    e = kvlib.speculative.expected_tokens_per_forward
    assert e(4, 0.5) == 1 + 0.5 + 0.25 + 0.125 + 0.0625  # 1.9375
    assert e(3, 1.0) == 4.0 and e(5, 0.0) == 1.0 and e(0, 0.4) == 1.0  # all right; none; no guesses
    assert e(6, 0.8) == pytest.approx((1 - 0.8**7) / (1 - 0.8), rel=1e-12)  # the closed form
    with pytest.raises(ValueError, match=r"a \(the chance that a guess is right\) must be a number in \[0, 1\], got 1.5"):
        e(4, 1.5)
    with pytest.raises(ValueError, match="must be a number in"):
        e(4, True)
    with pytest.raises(ValueError, match="k"):
        e(-1, 0.5)
