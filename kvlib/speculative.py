"""Speculative decoding: a cheap draft guesses, the target checks many guesses in one forward.

A decode step reads every weight of the model to produce one token. Reading them
once for ``k + 1`` tokens costs about the same, so: let a cheap *draft* propose
``k`` tokens, feed ``[last token, d_1 .. d_k]`` through the target in one forward,
and keep a prefix of the proposals. Only the number of target forwards changes,
never what comes out: the rule below is lossless *in distribution* (Leviathan et
al. 2023, Chen et al. 2023). The draft drew ``d_i`` from its distribution ``q_i``; the
verify forward gives the target's ``p_1 .. p_{n+1}`` (`kvlib.sampling.probabilities`,
the same temperature and cuts). For ``i = 1 .. n``:

* accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
* on the first rejection, draw the token from the residual ``norm(max(0, p_i - q_i))``
  and stop. Accepting gives ``min(p, q)``, the residual adds ``p - min(p, q)``: ``p``.

If all ``n`` were accepted, the *bonus* token is drawn from ``p_{n+1}``: the target's
draw after the last guess, free because the verify forward computed ``p_{n+1}``
anyway (so a step always yields at least one token, at most ``n + 1``). Greedy
(``temperature=0``) is the same code with one-hot ``p`` and ``q``: accept while
``d_i == argmax p_i``, and the residual is the target's own token, so the output is
`kvlib.generate`'s, token for token, wherever the two compute the same argmaxes. A verify
forward over ``n + 1`` tokens rounds differently from ``n + 1`` decode steps, so in float32
that is every step whose top-2 margin exceeds the last-bit difference (the book's
"When cached and uncached disagree" measures both); with ``model.set_batch_invariant(True)``
it is every step.

The cache is what makes it work, and what must be repaired: the verify forward
wrote K/V for every proposal, so after a rejection the target cache is rolled
back with ``cache.crop(n)`` (``PagedCache.truncate`` for a paged one).

**Host round-trips.** Inherent: the accepted count decides what the cache keeps, so a verify step reads each examined guess's ``p/q``, each
uniform and each draw (greedy: 1 per guess examined, 1 after a rejection, 2 per draw), a draft's ``q`` once; the prompt once.

The draft protocol: ``propose(context_ids, k) -> list[int]`` (at most ``k`` tokens),
taken as a one-hot ``q`` at each token, which is exactly lossless however the tokens
were chosen. A draft that knows its distribution may add ``propose_probs(context_ids,
k, sampling, generator) -> (tokens, q)``, ``q`` of shape ``(n, vocab)``: ``tokens[i]``
drawn from ``q[i]`` (with ``generator``) given the context and ``tokens[:i]``; used
when present, it is accepted more often than the one-hot. Two drafts:

* `PromptLookupDraft` copies what followed an earlier occurrence of the last few
  tokens (Hugging Face's ``prompt_lookup_num_tokens``, vLLM's n-gram speculator);
  free, and good when the answer repeats the prompt. Tokens only.
* `EarlyExitDraft` runs the target's first few blocks with the shared final norm
  and lm_head (self-speculation, as in LayerSkip), with its own small cache. It
  proposes distributions: its own `probabilities` under the call's sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cache import Cache, DynamicCache, StaticCache
from .generate import _as_batch, _check_len
from .model import Transformer
from .paged import PagedCache
from .sampling import SamplingParams, probabilities, sampling_params
from .validate import int_at_least, int_in_range, positive_int


class Draft(Protocol):
    """Anything with ``propose(context_ids, k) -> list[int]`` (at most ``k`` tokens, maybe none).

    A draft built on a model should also carry ``vocab_size``: `speculative_generate`
    refuses a draft whose token ids mean something else than the target's. One that
    knows the distribution it drew from also has ``propose_probs`` (`DistributionDraft`).
    """

    def propose(self, context_ids: list[int] | torch.Tensor, k: int) -> list[int]: ...


class DistributionDraft(Draft, Protocol):
    """A draft that also says what it sampled from: ``q`` ``(n, vocab)``, rows summing to 1.

    ``tokens[i]`` must really be a draw from ``q[i]`` (given the context and ``tokens[:i]``):
    the acceptance test divides by ``q``, so a ``q`` that lies gives a biased output.
    """

    def propose_probs(
        self, context_ids: list[int] | torch.Tensor, k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor]: ...


def _as_list(context_ids: list[int] | torch.Tensor) -> list[int]:
    """``list[int]``, ``(T,)`` or ``(1, T)`` ids -> a list of ints."""
    if isinstance(context_ids, torch.Tensor):
        if context_ids.dim() == 2 and context_ids.shape[0] == 1:
            context_ids = context_ids[0]
        if context_ids.dim() != 1:
            raise ValueError(f"context_ids must be (T,) or (1, T), got shape {tuple(context_ids.shape)}")
        return context_ids.tolist()
    return [int(t) for t in context_ids]


# -- drafts -------------------------------------------------------------------------------------------
class PromptLookupDraft:
    """Propose the tokens that followed the most recent earlier occurrence of the context's tail.

    Tries the last ``ngram_max`` tokens first, then shorter tails down to ``ngram_min``.
    (Hugging Face's prompt lookup takes the *earliest* match; the most recent one is
    usually the better guess when text repeats.) No model, no cache: almost free.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        positive_int("ngram_min", ngram_min)
        positive_int("ngram_max", ngram_max)
        if ngram_min > ngram_max:
            raise ValueError(f"ngram_min={ngram_min} must be <= ngram_max={ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context_ids: list[int] | torch.Tensor, k: int) -> list[int]:
        """Up to ``k`` tokens: those after the latest earlier match of the context's tail, fewer where
        the match is near the end, and ``[]`` where the tail never occurred before."""
        ctx, k = _as_list(context_ids), positive_int("k", k)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # newest first; never the tail itself
                if ctx[start : start + n] == tail:
                    return ctx[start + n : start + n + k]
        return []


class EarlyExitDraft:
    """The target's first ``n_layers`` blocks + its final norm + its lm_head.

    The weights are the target's own (`Transformer.first_layers`), so the draft costs
    no memory for weights, only its own `DynamicCache` over ``n_layers`` layers. That
    cache remembers which tokens it holds; each proposal crops it back to the part
    that still matches the context (a rejection rolls the draft back too) and feeds
    only the rest. ``propose`` is greedy; ``propose_probs`` samples under the call's
    `SamplingParams` and returns the distributions it drew from.
    """

    def __init__(self, model: Transformer, n_layers: int) -> None:
        int_in_range("n_layers", n_layers, 1, model.config.n_layer)
        self.model = model.first_layers(n_layers)
        self.vocab_size = model.config.vocab_size
        self.cache = DynamicCache(n_layers)
        self.tokens: list[int] = []  # the tokens whose K/V self.cache holds, in order

    def propose(self, context_ids: list[int] | torch.Tensor, k: int) -> list[int]:
        return self.propose_probs(context_ids, k, SamplingParams(), None)[0]  # greedy: q is one-hot

    @torch.inference_mode()
    def propose_probs(
        self, context_ids: list[int] | torch.Tensor, k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor]:
        """``k`` tokens, each drawn from ``q = probabilities(draft logits, sampling)``, and ``q`` ``(k, vocab)``."""
        ctx, k = _as_list(context_ids), positive_int("k", k)
        if not ctx:
            raise ValueError("context_ids is empty: the draft needs at least one token")
        keep = 0  # how much of the cache still matches; the last context token is always fed
        while keep < min(len(self.tokens), len(ctx) - 1) and self.tokens[keep] == ctx[keep]:
            keep += 1
        self.cache.crop(keep)
        self.tokens = ctx[:keep]
        out: list[int] = []
        qs: list[torch.Tensor] = []
        feed = ctx[keep:]
        for _ in range(k):
            ids = torch.tensor([feed], device=self.model.device)  # (1, t)
            logits = self.model(ids, self.cache, last_only=True)  # (1, 1, vocab)
            self.tokens += feed
            qs.append(probabilities(logits[0, -1], sampling))  # (vocab,)
            feed = [_draw(qs[-1], generator)]
            out += feed
        return out, torch.stack(qs)  # (k, vocab)


# -- the target side: one forward, one rollback ----------------------------------------------------
class _Target:
    """The target model and its cache behind two calls: ``forward`` and ``crop``."""

    def __init__(self, model: Transformer, cache: Cache | PagedCache) -> None:
        self.model, self.cache, self.sid = model, cache, None

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        if isinstance(self.cache, PagedCache):
            self.sid, cached = self.cache.add(prompt)  # a prefix-cache hit skips those tokens
            prompt = prompt[cached:]
        return self.forward(prompt, 1)

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Logits ``(keep, vocab)`` for the last ``keep`` of ``tokens``, appended to the cache."""
        ids = torch.tensor([tokens], device=self.model.device)  # (1, t)
        if isinstance(self.cache, PagedCache):
            with self.cache.step([self.sid], ids) as batch:
                return self.model(ids, batch, logits_to_keep=keep)[0]
        return self.model(ids, self.cache, logits_to_keep=keep)[0]

    @property
    def length(self) -> int:
        if isinstance(self.cache, PagedCache):
            return self.cache.num_tokens(self.sid)
        return self.cache.tokens_seen

    def crop(self, n: int) -> None:
        if isinstance(self.cache, PagedCache):
            self.cache.truncate(self.sid, n)
        else:
            self.cache.crop(n)

    def close(self) -> None:
        """Free the paged sequence this call added; a plain cache keeps its tokens for the caller."""
        if isinstance(self.cache, PagedCache) and self.sid is not None:
            self.cache.free(self.sid)
            self.sid = None


@dataclass
class SpecStats:
    """What one `speculative_generate` call did. Lists have one entry per verify forward."""

    proposed_per_step: list[int] = field(default_factory=list)  # draft tokens sent to the target
    accepted_per_step: list[int] = field(default_factory=list)  # how many of them it kept

    @property
    def steps(self) -> int:
        """Target verify forwards (the prefill, which gives the first token, is not counted)."""
        return len(self.accepted_per_step)

    @property
    def proposed(self) -> int:
        return sum(self.proposed_per_step)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens; 0.0 when the draft proposed nothing."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per verify forward: accepted + 1 on average (plain decoding: 1.0)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


def expected_tokens_per_forward(k: int, a: float) -> float:
    """Tokens a verify step makes on average when each of its ``k`` guesses is right with
    probability ``a``, independently: the guesses up to the first wrong one, plus the target's
    token, ``1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)`` (Leviathan et al. 2023; ``k + 1`` at
    ``a = 1``). `SpecStats.acceptance_rate` is not ``a``: a step stops at its first wrong guess.

    >>> kvlib.speculative.expected_tokens_per_forward(4, 0.5)
    1.9375
    """
    int_at_least("k (draft tokens per step)", k, 0)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
        raise ValueError(f"a (the chance that a guess is right) must be a number in [0, 1], got {a!r}")
    return float(sum(a**i for i in range(k + 1)))


# -- the rule: accept with min(1, p/q), else draw from the residual ------------------------------------
def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a ``(vocab,)`` distribution. A one-hot one (greedy) is its argmax: no randomness used."""
    top = int(probs.argmax())
    if probs[top] == 1:
        return top
    return int(torch.multinomial(probs, 1, generator=generator))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` ``(vocab,)``: where the target wants more than the draft offered.

    Its mass is ``sum max(0, p - q)``, exactly the probability that a guess is rejected. So
    zero mass means ``p <= q`` everywhere, i.e. ``p == q``, where no guess is ever rejected;
    in floats it can still come up after a rejection of probability ~1e-7 (``p`` and ``q``
    equal up to rounding), and then ``p`` itself is the distribution to draw from.
    """
    r = (p - q).clamp_min(0)
    mass = r.sum()
    return r / mass if mass > 0 else p


def _verify(
    guess: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """``(a, token)``: keep ``guess[:a]``, then ``token`` (a residual draw, or the bonus if ``a == n``).

    ``q`` is ``(n, vocab)``, ``p`` is ``(n + 1, vocab)``. A uniform draw is taken only when
    ``0 < p/q < 1``: greedy (ratios 0 or 1) uses no randomness at all.
    """
    for i, d in enumerate(guess):
        ratio = float(p[i, d] / q[i, d])  # q[i, d] > 0: checked
        if ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=generator, device=p.device)) < ratio):
            continue  # accepted
        return i, _draw(_residual(p[i], q[i]), generator)
    return len(guess), _draw(p[len(guess)], generator)  # every guess accepted: the bonus token


def _propose(
    draft: Draft, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, model: Transformer
) -> tuple[list[int], torch.Tensor]:
    """Ask the draft for up to ``k`` tokens and their ``q`` ``(n, vocab)`` (float32, on the model's device)."""
    vocab, device = model.config.vocab_size, model.device
    if callable(getattr(draft, "propose_probs", None)):
        out = draft.propose_probs(list(seq), k, params, generator)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"propose_probs must return (tokens, q), got {type(out).__name__}")
        guess, q = _as_list(out[0]), out[1]
    else:
        guess, q = _as_list(draft.propose(list(seq), k)), None
    if len(guess) > k or any(not 0 <= t < vocab for t in guess):
        raise ValueError(f"the draft proposed {guess} for k={k}: at most k ids in [0, {vocab})")
    if q is None:  # tokens only: a one-hot q at each token
        return guess, torch.nn.functional.one_hot(torch.tensor(guess, dtype=torch.long, device=device), vocab).float()
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"the draft's q must be a float tensor (n, vocab), got {type(q).__name__} {getattr(q, 'dtype', '')}")
    if tuple(q.shape) != (len(guess), vocab):
        raise ValueError(f"the draft's q has shape {tuple(q.shape)}; {len(guess)} tokens need ({len(guess)}, {vocab})")
    q = q.to(device=device, dtype=torch.float32)
    if not guess:
        return guess, q
    sums, at = q.sum(-1), q[torch.arange(len(guess), device=device), torch.tensor(guess, device=device)]  # (n,) each
    finite_bad, sum_bad, zero_bad = torch.stack([  # the checks' one read; the messages read more, on failure only
        ~torch.isfinite(q).all() | (q.min() < 0), ((sums - 1).abs() > 1e-3).any(), (at <= 0).any()]).tolist()
    if finite_bad:
        raise ValueError(f"the draft's q must be finite and >= 0, got min {float(q.min())}")
    if sum_bad:
        worst = int((sums - 1).abs().argmax())
        raise ValueError(f"each row of the draft's q must sum to 1 (within 1e-3); row {worst} sums to {float(sums[worst])}")
    if zero_bad:
        i = int((at <= 0).nonzero()[0])
        raise ValueError(f"the draft proposed token {guess[i]} at position {i} with q = 0: it cannot have drawn it")
    return guess, q


# -- the loop ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def speculative_generate(
    model: Transformer,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    draft: Draft,
    k: int = 4,
    cache: Cache | PagedCache | None = None,
    *,
    sampling: SamplingParams | None = None,
    **sampling_kwargs,
) -> tuple[torch.Tensor, SpecStats]:
    """Generation with a draft, distributed exactly as ``generate(model, prompt_ids, n, sampling=...)``.

    Returns prompt + exactly ``max_new_tokens`` new tokens, ``(1, T + n)``, and a
    `SpecStats`. Each verify step asks the draft for up to ``k`` tokens (fewer near
    the end: never more than are still wanted), runs ``[last token, proposals]``
    through the target at once, keeps the accepted prefix plus one token of the
    target's (see the module docstring), and crops the target cache back to what was kept.
    Greedy (the default) gives `generate`'s tokens (up to near ties, see above); with ``temperature > 0`` the
    output has `generate`'s distribution, not its seeded tokens (the draws differ).
    Sampling as in `generate`: ``sampling=SamplingParams(...)`` or ``temperature``, ``top_k``,
    ``top_p``, ``seed``, ``generator`` as keywords (``stop`` is not supported here).

    ``cache=None`` allocates a `StaticCache` of prompt + ``max_new_tokens`` slots. A
    `PagedCache` gets a new sequence for the call, rolled back with ``truncate`` and freed
    when the call returns or raises (its full blocks stay in the prefix cache, so a next
    call on the same text hits them). Batch size 1 only; the draft sees the prompt and new tokens.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)
    >>> prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    >>> out, stats = kvlib.speculative.speculative_generate(model, prompt, 6, kvlib.speculative.PromptLookupDraft())
    >>> out.shape, torch.equal(out, kvlib.generate(model, prompt, 6))  # greedy: generate's tokens
    (torch.Size([1, 14]), True)
    """
    int_at_least("k (draft tokens per step)", k, 1)
    int_at_least("max_new_tokens", max_new_tokens, 1)
    params = sampling_params(sampling, max_new_tokens, **sampling_kwargs)
    if params.stop:
        raise ValueError(f"speculative_generate does not support stop tokens, got stop={params.stop}")
    if not callable(getattr(draft, "propose", None)):
        raise TypeError(f"draft must have a propose(context_ids, k) method, got {type(draft).__name__}")
    if cache is not None and not isinstance(cache, (Cache, PagedCache)):
        raise TypeError(f"cache must be a kvlib Cache or PagedCache, got {type(cache).__name__}")
    if isinstance(cache, Cache) and cache.evicts:
        raise ValueError(
            f"speculative_generate rolls the cache back after every rejected guess, and a {type(cache).__name__} "
            f"evicts: a verify step's guesses can push out tokens that a rollback cannot bring back. Use a cache "
            f"that keeps every token (kvlib.DynamicCache, kvlib.StaticCache, a quantized cache, a PagedCache)")
    vocab = model.config.vocab_size
    draft_vocab = getattr(draft, "vocab_size", vocab)
    if draft_vocab != vocab:
        raise ValueError(f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({vocab})")
    ids, _ = _as_batch(prompt_ids, model)  # (B, T)
    B, T = ids.shape
    if B != 1:
        raise ValueError(f"speculative_generate runs one sequence at a time, got a batch of {B}")
    _check_len(model, T, None if isinstance(cache, PagedCache) else cache, max_new_tokens)
    if cache is None:
        cache = StaticCache.for_model(model.config, 1, T + max_new_tokens, dtype=model.dtype, device=model.device)

    generator = params.make_generator(model.device)
    target, stats = _Target(model, cache), SpecStats()
    try:
        seq = ids[0].tolist()
        p = probabilities(target.prefill(seq)[-1], params)  # (vocab,); the target cache now holds seq
        seq.append(_draw(p, generator))  # the prefill's token, never fed yet
        new = 1
        while new < max_new_tokens:
            k_step = min(k, max_new_tokens - new - 1)  # the bonus token is one more
            guess, q = _propose(draft, seq, k_step, params, generator, model) if k_step else ([], None)
            start = target.length
            logits = target.forward([seq[-1]] + guess, len(guess) + 1)  # (1 + n, vocab)
            p = probabilities(logits, params)  # (1 + n, vocab): the target's p_1 .. p_{n+1}
            a, tok = _verify(guess, q, p, generator)
            target.crop(start + 1 + a)  # keep the last token and the accepted proposals; drop the rest
            seq += guess[:a] + [tok]
            new += a + 1
            stats.proposed_per_step.append(len(guess))
            stats.accepted_per_step.append(a)
    finally:
        target.close()  # a paged sequence is freed (its full blocks stay in the prefix cache)
    return torch.tensor([seq], device=model.device), stats
