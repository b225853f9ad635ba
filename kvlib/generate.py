"""Turning a model into text: sampling, prefill, decode, and the two loops.

``generate_naive`` feeds the whole sequence through the model at every step,
the O(N²) baseline. ``generate`` runs one *prefill* over the prompt, then one
*decode step* per new token against a KV cache. Both share the sampling and
stopping code below, so any difference in their output is the cache's fault.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from .cache import Cache, StaticCache
from .model import Transformer


# -- sampling ---------------------------------------------------------------------------
def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``(B, vocab)``; returns ``(B,)``.

    ``temperature=0`` is greedy (argmax). Otherwise the logits are divided by
    the temperature, cut to the ``top_k`` largest and to the smallest set whose
    probability reaches ``top_p``, and sampled with ``generator``.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- the two phases ---------------------------------------------------------------------
@torch.inference_mode()  # no autograd graph may grow through the cache
def prefill(model: Transformer, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run the whole prompt ``(B, T)`` through the model at once, filling ``cache``.

    Returns the logits for the next token, ``(B, vocab)``.
    """
    return model(tokens, cache, last_only=True)[:, -1]


@torch.inference_mode()
def decode_step(model: Transformer, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Feed one new token per sequence ``(B,)`` or ``(B, 1)``; returns next logits ``(B, vocab)``."""
    if token.dim() == 1:
        token = token[:, None]  # (B, 1)
    return model(token, cache, last_only=True)[:, -1]


# -- input handling -----------------------------------------------------------------------
def _as_batch(prompt_ids, model: Transformer) -> torch.Tensor:
    """``list[int]`` or ``(T,)``/``(B, T)`` tensor -> ``(B, T)`` int64 on the model's device."""
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"prompt_ids must be (T,) or (B, T), got shape {tuple(prompt_ids.shape)}")
    elif isinstance(prompt_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise TypeError("prompt_ids given as a list must contain only ints")
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    else:
        raise TypeError(f"prompt_ids must be a list[int] or a LongTensor, got {type(prompt_ids).__name__}")
    if ids.numel() == 0 or ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    V = model.config.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= V:
        raise IndexError(f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {V})")
    return ids.to(device=model.device, dtype=torch.long)


def _stop_set(stop, device) -> torch.Tensor | None:
    if stop is None:
        return None
    ids = [stop] if isinstance(stop, int) else list(stop)
    if not ids or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"stop must be an int or a non-empty iterable of ints, got {stop!r}")
    return torch.tensor(ids, device=device)


def _check_len(model: Transformer, prompt_len: int, past: int, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    total = past + prompt_len + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"{past} cached + {prompt_len} prompt + {max_new_tokens} new = {total} tokens "
            f"exceeds max_seq_len={model.config.max_seq_len}"
        )


# -- the shared loop ---------------------------------------------------------------------------
def _loop(
    next_logits: Callable[[torch.Tensor | None], torch.Tensor],
    batch: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    stop: torch.Tensor | None,
    device: torch.device,
) -> Iterator[torch.Tensor]:
    """Yield ``(B,)`` tokens. ``next_logits(None)`` starts; ``next_logits(tok)`` continues.

    A sequence that emits a stop token is finished: it repeats that token
    until every sequence in the batch has finished (as HF pads finished rows).
    """
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    fill = torch.zeros(batch, dtype=torch.long, device=device)
    tok = None
    for _ in range(max_new_tokens):
        with torch.inference_mode():  # scoped per step: a suspended generator must not leak the mode
            logits = next_logits(tok)  # (B, vocab)
            tok = sample(logits, temperature, top_k, top_p, generator)
            tok = torch.where(finished, fill, tok)
        yield tok
        if stop is not None:
            just = torch.isin(tok, stop) & ~finished
            fill = torch.where(just, tok, fill)
            finished |= just
            if bool(finished.all()):
                return


def _cached_stepper(model: Transformer, ids: torch.Tensor, cache: Cache):
    def next_logits(tok):
        return prefill(model, ids, cache) if tok is None else decode_step(model, tok, cache)

    return next_logits


def _naive_stepper(model: Transformer, ids: torch.Tensor):
    seq = [ids]

    def next_logits(tok):
        if tok is not None:
            seq.append(tok[:, None])
        full = torch.cat(seq, dim=1) if len(seq) > 1 else seq[0]  # (B, T + generated so far)
        return model(full, last_only=True)[:, -1]  # recompute every position, every step

    return next_logits


def _default_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    return StaticCache.for_model(model.config, batch, max_len, dtype=model.dtype, device=model.device)


# -- public entry points ------------------------------------------------------------------------
def stream(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int,
    *,
    cache: Cache | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop: int | Iterable[int] | None = None,
) -> Iterator:
    """Cached generation that yields each new token as soon as it exists.

    For a ``list[int]`` prompt it yields ``int``s; for a tensor prompt it
    yields ``(B,)`` tensors. ``cache=None`` allocates a `StaticCache` of
    exactly prompt + ``max_new_tokens`` slots; a cache you pass in may already
    hold a conversation, and the prompt is appended after it.
    """
    _check_sampling(temperature, top_k, top_p)
    ids = _as_batch(prompt_ids, model)
    B, T = ids.shape
    past = 0 if cache is None else cache.seq_len
    _check_len(model, T, past, max_new_tokens)
    stops = _stop_set(stop, ids.device)
    if cache is None and max_new_tokens > 0:
        cache = _default_cache(model, B, T + max_new_tokens)
    # Checks above run at call time; the generator below runs as it is consumed.
    toks = _loop(_cached_stepper(model, ids, cache), B, max_new_tokens, temperature, top_k, top_p,
                 generator, stops, ids.device)
    if isinstance(prompt_ids, torch.Tensor):
        return toks
    return (int(tok[0]) for tok in toks)


def generate(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int,
    *,
    cache: Cache | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop: int | Iterable[int] | None = None,
) -> torch.Tensor:
    """Prefill once, then one cached decode step per token.

    Returns prompt + new tokens as a ``(B, T + n)`` LongTensor, like Hugging
    Face's ``generate``; ``n < max_new_tokens`` when every row hit ``stop``.
    """
    ids = _as_batch(prompt_ids, model)
    toks = list(stream(model, ids, max_new_tokens, cache=cache, temperature=temperature, top_k=top_k,
                       top_p=top_p, generator=generator, stop=stop))
    return torch.cat([ids, torch.stack(toks, dim=1)], dim=1) if toks else ids


def generate_naive(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int,
    *,
    cache: Cache | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop: int | Iterable[int] | None = None,
) -> torch.Tensor:
    """Like `generate`, but recompute the whole sequence at every step (no cache).

    ``cache`` is accepted for a drop-in signature and must be None.
    """
    if cache is not None:
        raise ValueError("generate_naive recomputes everything and uses no cache; pass cache=None")
    _check_sampling(temperature, top_k, top_p)
    ids = _as_batch(prompt_ids, model)
    B, T = ids.shape
    _check_len(model, T, 0, max_new_tokens)
    stops = _stop_set(stop, ids.device)
    toks = list(_loop(_naive_stepper(model, ids), B, max_new_tokens, temperature, top_k, top_p,
                      generator, stops, ids.device))
    return torch.cat([ids, torch.stack(toks, dim=1)], dim=1) if toks else ids
