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
from .padding import pad, position_ids


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
def _as_batch(prompt_ids, model: Transformer, attention_mask=None, pad_id: int = 0):
    """Prompts -> ``(ids (B, T) int64, valid (B, T) bool or None)`` on the model's device.

    Accepts ``list[int]``, a list of ``list[int]`` (different lengths are
    left-padded with ``pad_id``), or a ``(T,)``/``(B, T)`` tensor with an optional
    HF-style ``attention_mask`` (1 = token, 0 = left padding). ``valid`` is None
    when no row is padded, so the common case keeps the mask-free fast path.
    """
    valid = None
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"prompt_ids must be (T,) or (B, T), got shape {tuple(prompt_ids.shape)}")
        if attention_mask is not None:
            am = torch.as_tensor(attention_mask)
            am = am[None] if am.dim() == 1 else am
            if am.shape != ids.shape:
                raise ValueError(f"attention_mask shape {tuple(am.shape)} does not match prompt_ids {tuple(ids.shape)}")
            valid = am.to(torch.bool)
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(isinstance(r, (list, tuple)) for r in prompt_ids):
        rows = [list(r) for r in prompt_ids]
        if not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
            raise TypeError("prompt_ids given as lists must contain only ints")
        if any(len(r) == 0 for r in rows):
            raise ValueError(f"prompt {[len(r) for r in rows].index(0)} is empty: every prompt needs a token")
        ids, valid = pad(rows, pad_id, side="left")  # (B, T) each
    elif isinstance(prompt_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise TypeError("prompt_ids given as a list must contain only ints")
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    else:
        raise TypeError(f"prompt_ids must be a list[int], a list of lists, or a LongTensor, got {type(prompt_ids).__name__}")
    if ids.numel() == 0 or ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    if valid is not None:
        if not valid.any(dim=1).all():
            raise ValueError("a prompt row has no tokens at all (its attention_mask is all 0)")
        if (valid[:, 1:] < valid[:, :-1]).any():
            raise ValueError("padding must be on the left for generation (a 1 followed by a 0 in attention_mask)")
        if bool(valid.all()):
            valid = None  # nothing padded: use the fast path
    V = model.config.vocab_size
    real = ids if valid is None else ids[valid]
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= V:
        raise IndexError(f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {V})")
    if valid is not None:
        ids = ids.masked_fill(~valid, 0)  # pad ids never reach a real token's output; keep them in range
        valid = valid.to(model.device)
    return ids.to(device=model.device, dtype=torch.long), valid


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


def _cached_stepper(model: Transformer, ids: torch.Tensor, cache: Cache, valid: torch.Tensor | None):
    if valid is None:  # no padding: positions follow the cache, no mask needed

        def next_logits(tok):
            return prefill(model, ids, cache) if tok is None else decode_step(model, tok, cache)

        return next_logits

    state = {"valid": valid, "pos": position_ids(valid)}  # (B, S) key mask, (B, T) positions

    def next_logits_padded(tok):
        if tok is not None:  # one new real token per row: a True key, the next position
            state["valid"] = torch.cat([state["valid"], torch.ones_like(state["valid"][:, :1])], dim=1)
            state["pos"] = state["pos"][:, -1:] + 1
            tok = tok[:, None]
        x = ids if tok is None else tok
        return model(x, cache, positions=state["pos"], key_valid=state["valid"], last_only=True)[:, -1]

    return next_logits_padded


def _naive_stepper(model: Transformer, ids: torch.Tensor, valid: torch.Tensor | None):
    seq = [ids]
    masks = [valid if valid is not None else torch.ones_like(ids, dtype=torch.bool)]

    def next_logits(tok):
        if tok is not None:
            seq.append(tok[:, None])
            masks.append(torch.ones_like(masks[0][:, :1]))
        full = torch.cat(seq, dim=1)  # (B, T + generated so far)
        if valid is None:
            return model(full, last_only=True)[:, -1]  # recompute every position, every step
        key_valid = torch.cat(masks, dim=1)
        return model(full, positions=position_ids(key_valid), key_valid=key_valid, last_only=True)[:, -1]

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
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
) -> Iterator:
    """Cached generation that yields each new token as soon as it exists.

    For a ``list[int]`` prompt it yields ``int``s; for a batch (a tensor, or a
    list of lists) it yields ``(B,)`` tensors. Prompts of different lengths
    are left-padded (see `generate`). ``cache=None`` allocates a `StaticCache`
    of exactly prompt + ``max_new_tokens`` slots; a cache you pass in may
    already hold a conversation, and the prompt is appended after it.
    """
    _check_sampling(temperature, top_k, top_p)
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    B, T = ids.shape
    past = 0 if cache is None else cache.seq_len
    if valid is not None and past > 0:
        raise ValueError(f"padded prompts need an empty cache; this one already holds {past} tokens")
    _check_len(model, T, past, max_new_tokens)
    stops = _stop_set(stop, ids.device)
    if cache is None and max_new_tokens > 0:
        cache = _default_cache(model, B, T + max_new_tokens)
    # Checks above run at call time; the generator below runs as it is consumed.
    toks = _loop(_cached_stepper(model, ids, cache, valid), B, max_new_tokens, temperature, top_k, top_p,
                 generator, stops, ids.device)
    if isinstance(prompt_ids, torch.Tensor) or ids.shape[0] > 1 or valid is not None:
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
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """Prefill once, then one cached decode step per token.

    Returns prompt + new tokens as a ``(B, T + n)`` LongTensor, like Hugging
    Face's ``generate``; ``n < max_new_tokens`` when every row hit ``stop``.
    A list of prompts of different lengths is left-padded to ``T`` with
    ``pad_id`` (so every row's new tokens line up at the right); padding keys
    are masked out and each row's positions start at its first real token, so
    every row gets the tokens it would get alone.
    """
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    toks = list(stream(model, ids, max_new_tokens, cache=cache, temperature=temperature, top_k=top_k,
                       top_p=top_p, generator=generator, stop=stop, attention_mask=valid))
    ids = ids if valid is None else ids.masked_fill(~valid, pad_id)
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
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """Like `generate`, but recompute the whole sequence at every step (no cache).

    ``cache`` is accepted for a drop-in signature and must be None.
    """
    if cache is not None:
        raise ValueError("generate_naive recomputes everything and uses no cache; pass cache=None")
    _check_sampling(temperature, top_k, top_p)
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    B, T = ids.shape
    _check_len(model, T, 0, max_new_tokens)
    stops = _stop_set(stop, ids.device)
    toks = list(_loop(_naive_stepper(model, ids, valid), B, max_new_tokens, temperature, top_k, top_p,
                      generator, stops, ids.device))
    ids = ids if valid is None else ids.masked_fill(~valid, pad_id)
    return torch.cat([ids, torch.stack(toks, dim=1)], dim=1) if toks else ids
