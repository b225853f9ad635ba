"""Needle in a haystack: plant a fact in filler text, ask for it, and check the answer.

The test of long-context retrieval that RULER and the needle-in-a-haystack plots run: a
short fact (the *needle*, "The secret number is 73914.") is planted at a chosen *depth* of
a filler text (Tiny Shakespeare), a question follows, and the model must answer with the
number. A cache that evicted the fact cannot; one that kept it usually can.

* `haystack` builds the prompt: ``n_tokens`` of filler and fact, the fact starting at
  ``round(depth * (n_tokens - len(fact)))``, so depth 0 puts it first and depth 1 last.
* `retrieve` checks the answer. Greedy decoding produces the answer's tokens exactly when the
  argmax after each of its prefixes is its next token, so we feed the answer once, as one
  chunk (teacher forcing), and compare: one forward instead of a decode loop, same verdict.
* `needle_sweep` runs both for each depth under any *policy*: a function
  ``policy(model, ids) -> (cache, logits)`` that prefills the prompt ``ids`` ``(1, S)`` into
  a cache of its choice and returns the last logits ``(1, vocab)``. `streamed` makes one
  from a cache factory (chapter 10's caches); `kvlib.press.prefill` is one for a press.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cache import Cache
from .model import Transformer
from .validate import int_at_least, positive_int

Policy = Callable[[Transformer, torch.Tensor], tuple[Cache, torch.Tensor]]


@dataclass(frozen=True)
class Needle:
    """The fact to plant, the question that asks for it, and the answer expected, as text."""

    fact: str = "\nThe secret number is 73914.\n"
    question: str = "\nWhat is the secret number? The secret number is"
    answer: str = " 73914"


@dataclass(frozen=True)
class Retrieval:
    """One needle run: where the fact sat, how many answer tokens the model got right
    (teacher-forced), and whether greedy decoding gives the whole answer (``found``)."""

    depth: float
    fact_at: int  # the fact's first token, as an index into the prompt
    right: int  # answer tokens whose greedy prediction is right
    n_answer: int

    @property
    def found(self) -> bool:
        return self.right == self.n_answer


def haystack(filler: Sequence[int], fact: Sequence[int], n_tokens: int, depth: float) -> tuple[list[int], int]:
    """``n_tokens`` token ids: the start of ``filler`` with ``fact`` inserted whole, and where it starts.

    The fact starts at ``round(depth * (n_tokens - len(fact)))``: depth 0 is the very start,
    depth 1 puts its last token at the end. The filler keeps its order around it.
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    fact, filler = list(fact), list(filler)
    if not fact:
        raise ValueError("the fact is empty: plant at least one token")
    int_at_least("n_tokens", n_tokens, len(fact) + 1)
    n_filler = n_tokens - len(fact)
    if len(filler) < n_filler:
        raise ValueError(f"need {n_filler} filler tokens for a haystack of {n_tokens}, got {len(filler)}")
    at = round(depth * n_filler)
    return filler[:at] + fact + filler[at:n_filler], at


@torch.inference_mode()
def retrieve(model: Transformer, cache: Cache, logits: torch.Tensor, answer: Sequence[int],
             question: Sequence[int] = ()) -> int:
    """How many of the ``answer`` tokens greedy decoding gets right, fed after a prefill.

    ``logits`` ``(1, vocab)`` are the prefill's last. If ``question`` is given it is fed first
    (a question asked after the cache was built). The answer (but its last token) is fed in the
    same chunk, so each prediction sees the right tokens before it: teacher forcing. Returns the
    number of positions whose argmax is the answer's token; all of them means greedy decoding
    writes the answer. A cache that brings its own attention (``cache.attention``) gets it.
    """
    answer, question = list(answer), list(question)
    if not answer:
        raise ValueError("the answer is empty")
    if logits.dim() != 2 or logits.shape[0] != 1:
        raise ValueError(f"logits must be the prefill's last, (1, vocab), got {tuple(logits.shape)}")
    chunk = question + answer[:-1]
    preds = [] if question else [int(logits[0].argmax())]
    if chunk:
        impl = getattr(cache, "attention", None)
        before = [block.attn.impl for block in model.layers]
        if callable(impl):
            model.set_attention_impl(impl)
        try:
            out = model(torch.tensor([chunk], device=model.device), cache)  # (1, len(chunk), vocab)
        finally:
            for block, b in zip(model.layers, before):
                block.attn.impl = b
        start = max(len(question) - 1, 0)
        preds += out[0, start:].argmax(-1).tolist()
    return sum(int(p == a) for p, a in zip(preds, answer))


def streamed(make: Callable[[int], Cache], chunk: int) -> Policy:
    """A policy that feeds the prompt through ``make(n_layer)`` in chunks of ``chunk`` tokens
    (chapter 10's caches take a prompt so), with the cache's own attention if it has one."""
    positive_int("chunk", chunk)

    @torch.inference_mode()
    def policy(model: Transformer, ids: torch.Tensor) -> tuple[Cache, torch.Tensor]:
        cache = make(model.config.n_layer)
        impl = getattr(cache, "attention", None)
        before = [block.attn.impl for block in model.layers]
        if callable(impl):
            model.set_attention_impl(impl)
        try:
            for i in range(0, ids.shape[1], chunk):
                logits = model(ids[:, i:i + chunk], cache, last_only=True)[:, -1]  # (1, vocab)
        finally:
            for block, b in zip(model.layers, before):
                block.attn.impl = b
        return cache, logits

    return policy


def needle_sweep(model: Transformer, encode: Callable[[str], list[int]], policy: Policy, *,
                 n_tokens: int, depths: Sequence[float], filler: str, needle: Needle = Needle(),
                 question_in_prompt: bool = True) -> list[Retrieval]:
    """Plant ``needle`` at each of ``depths`` in ``n_tokens`` of ``filler``, prefill with ``policy``,
    and check the answer (`retrieve`). ``encode`` is the tokenizer's ``str -> ids``.

    With ``question_in_prompt`` (the default, as in SnapKV's paper) the question is part of the
    prompt the policy compresses; without it the question is asked after (kvpress's pipeline
    compresses the context alone).
    """
    fact, question, answer = encode(needle.fact), encode(needle.question), encode(needle.answer)
    filler_ids = encode(filler)
    out = []
    for depth in depths:
        ids, at = haystack(filler_ids, fact, n_tokens, depth)
        prompt = ids + question if question_in_prompt else ids
        cache, logits = policy(model, torch.tensor([prompt], device=model.device))
        right = retrieve(model, cache, logits, answer, () if question_in_prompt else question)
        out.append(Retrieval(float(depth), at, right, len(answer)))
    return out
