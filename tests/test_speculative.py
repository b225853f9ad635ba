"""Speculative decoding (kvlib.speculative) against plain greedy `kvlib.generate`.

- Lossless: for any draft, k and cache kind the tokens equal `generate`'s exactly (random
  models with std=0.2, so no argmax is decided by rounding).
- Rollback: rejected proposals leave no trace. Two runs whose drafts guess *different*
  wrong tokens end with bit-identical caches, and both equal a one-shot prefill of the
  kept tokens up to rounding (the verify forwards have other shapes than one prefill;
  the differences measured were below 4e-6, so 1e-5).
- Extremes: a draft that knows the answer is always accepted (k + 1 tokens per forward);
  one that is always wrong still gives the exact output, one token per forward.
"""

from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib import DynamicCache, ModelConfig, PagedCache, StaticCache, Transformer
from kvlib.speculative import EarlyExitDraft, PromptLookupDraft, speculative_generate

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
