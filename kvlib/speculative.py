"""Speculative decoding: a cheap draft guesses, the target checks many guesses in one forward.

A decode step reads every weight of the model to produce one token. Reading them
once for ``k + 1`` tokens costs about the same, so: let a cheap *draft* propose
``k`` tokens, feed ``[last token, d_1 .. d_k]`` through the target in one forward,
and keep the proposals up to the first one the target would not have chosen
itself. The target's own choice at that point comes free (the "bonus" token).
With greedy verification the output is exactly `kvlib.generate`'s; only the
number of target forwards changes.

The cache is what makes it work, and what must be repaired: the verify forward
wrote K/V for every proposal, so after a rejection the target cache is rolled
back with ``cache.crop(n)`` (``PagedCache.truncate`` for a paged one).

Two drafts:

* `PromptLookupDraft` copies what followed an earlier occurrence of the last few
  tokens (Hugging Face's ``prompt_lookup_num_tokens``, vLLM's n-gram speculator);
  free, and good when the answer repeats the prompt.
* `EarlyExitDraft` runs the target's first few blocks with the shared final norm
  and lm_head (self-speculation, as in LayerSkip), with its own small cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cache import Cache, DynamicCache, StaticCache
from .generate import _as_batch, _check_len
from .model import Transformer
from .paged import PagedCache
from .validate import int_at_least, int_in_range, positive_int


class Draft(Protocol):
    """Anything with ``propose(context_ids, k) -> list[int]`` (at most ``k`` tokens, maybe none).

    A draft built on a model should also carry ``vocab_size``: `speculative_generate`
    refuses a draft whose token ids mean something else than the target's.
    """

    def propose(self, context_ids: list[int] | torch.Tensor, k: int) -> list[int]: ...


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
        ctx, k = _as_list(context_ids), positive_int("k", k)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # newest first; never the tail itself
                if ctx[start : start + n] == tail:
                    return ctx[start + n : start + n + k]
        return []


class EarlyExitDraft:
    """The target's first ``n_layers`` blocks + its final norm + its lm_head, greedy.

    The weights are the target's own (`Transformer.first_layers`), so the draft costs
    no memory for weights, only its own `DynamicCache` over ``n_layers`` layers. That
    cache remembers which tokens it holds; each ``propose`` crops it back to the part
    that still matches the context (a rejection rolls the draft back too) and feeds
    only the rest.
    """

    def __init__(self, model: Transformer, n_layers: int) -> None:
        int_in_range("n_layers", n_layers, 1, model.config.n_layer)
        self.model = model.first_layers(n_layers)
        self.vocab_size = model.config.vocab_size
        self.cache = DynamicCache(n_layers)
        self.tokens: list[int] = []  # the tokens whose K/V self.cache holds, in order

    @torch.inference_mode()
    def propose(self, context_ids: list[int] | torch.Tensor, k: int) -> list[int]:
        ctx, k = _as_list(context_ids), positive_int("k", k)
        if not ctx:
            raise ValueError("context_ids is empty: the draft needs at least one token")
        keep = 0  # how much of the cache still matches; the last context token is always fed
        while keep < min(len(self.tokens), len(ctx) - 1) and self.tokens[keep] == ctx[keep]:
            keep += 1
        self.cache.crop(keep)
        self.tokens = ctx[:keep]
        out: list[int] = []
        feed = ctx[keep:]
        for _ in range(k):
            ids = torch.tensor([feed], device=self.model.device)  # (1, t)
            logits = self.model(ids, self.cache, last_only=True)  # (1, 1, vocab)
            self.tokens += feed
            feed = [int(logits[0, -1].argmax())]
            out += feed
        return out


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
        return self.cache.seq_len

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


# -- the loop ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def speculative_generate(
    model: Transformer,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    draft: Draft,
    k: int = 4,
    cache: Cache | PagedCache | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Greedy generation with a draft: the same tokens as ``generate(model, prompt_ids, n)``.

    Returns prompt + exactly ``max_new_tokens`` new tokens, ``(1, T + n)``, and a
    `SpecStats`. Each verify step asks the draft for up to ``k`` tokens (fewer near
    the end: never more than are still wanted), runs ``[last token, proposals]``
    through the target at once, keeps the longest prefix the target agrees with plus
    the target's next token, and crops the target cache back to what was kept.

    ``cache=None`` allocates a `StaticCache` of prompt + ``max_new_tokens`` slots. A
    `PagedCache` gets a new sequence for the call, rolled back with ``truncate`` and freed
    when the call returns or raises (its full blocks stay in the prefix cache, so a next
    call on the same text hits them). Batch size 1 only; the draft sees the prompt and new tokens.
    """
    int_at_least("k (draft tokens per step)", k, 1)
    int_at_least("max_new_tokens", max_new_tokens, 1)
    if not callable(getattr(draft, "propose", None)):
        raise TypeError(f"draft must have a propose(context_ids, k) method, got {type(draft).__name__}")
    if cache is not None and not isinstance(cache, (Cache, PagedCache)):
        raise TypeError(f"cache must be a kvlib Cache or PagedCache, got {type(cache).__name__}")
    vocab = model.config.vocab_size
    draft_vocab = getattr(draft, "vocab_size", vocab)
    if draft_vocab != vocab:
        raise ValueError(f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({vocab})")
    ids, _ = _as_batch(prompt_ids, model)  # (B, T)
    B, T = ids.shape
    if B != 1:
        raise ValueError(f"speculative_generate runs one sequence at a time, got a batch of {B}")
    past = 0 if cache is None or isinstance(cache, PagedCache) else cache.seq_len
    _check_len(model, T, past, max_new_tokens)
    if cache is None:
        cache = StaticCache.for_model(model.config, 1, T + max_new_tokens, dtype=model.dtype, device=model.device)

    target, stats = _Target(model, cache), SpecStats()
    try:
        seq = ids[0].tolist()
        seq.append(int(target.prefill(seq).argmax(-1)[-1]))  # the prefill's token; target cache = seq[:-1]
        new = 1
        while new < max_new_tokens:
            k_step = min(k, max_new_tokens - new - 1)  # the bonus token is one more
            guess = _as_list(draft.propose(list(seq), k_step)) if k_step else []
            if len(guess) > k_step or any(not 0 <= t < vocab for t in guess):
                raise ValueError(f"the draft proposed {guess} for k={k_step}: at most k ids in [0, {vocab})")
            start = target.length
            logits = target.forward([seq[-1]] + guess, len(guess) + 1)  # (1 + len(guess), vocab)
            choice = logits.argmax(-1).tolist()  # the target's next token after each fed token
            a = 0
            while a < len(guess) and guess[a] == choice[a]:
                a += 1
            target.crop(start + 1 + a)  # keep the last token and the accepted proposals; drop the rest
            seq += guess[:a] + [choice[a]]
            new += a + 1
            stats.proposed_per_step.append(len(guess))
            stats.accepted_per_step.append(a)
    finally:
        target.close()  # a paged sequence is freed (its full blocks stay in the prefix cache)
    return torch.tensor([seq], device=model.device), stats
