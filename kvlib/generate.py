"""Turning a model into text: sampling, prefill, decode, and the two loops.

``generate_naive`` feeds the whole sequence through the model at every step,
the O(N²) baseline. ``generate`` runs one *prefill* over the prompt, then one
*decode step* per new token against a KV cache. Both share the sampling and
stopping code below, so any difference in their output is the cache's fault.

**Host round-trips.** None per decode step in `generate` without stop tokens. With stop tokens it asks "has every row
stopped?" every ``sync_every`` steps (one read, inherent: it decides whether to go on), and
trims once at the end. `stream` reads each token, inherent: it hands the caller an ``int``.
Prompts are checked once, at the API boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .cache import Cache, StaticCache
from .hybrid import HybridCache
from .model import Transformer, check_token_range
from .padding import PaddedBatch, pad, position_ids
from .sampling import SamplingParams, sample, sampling_params
from .validate import int_at_least


# -- the two phases ---------------------------------------------------------------------
@torch.inference_mode()  # no autograd graph may grow through the cache
def prefill(model: Transformer, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run the whole prompt ``(B, T)`` through the model at once, filling ``cache``.

    Returns the logits for the next token, ``(B, vocab)``.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.DynamicCache(model.config.n_layer)
    >>> kvlib.prefill(model, torch.tensor([[1, 2, 3]]), cache).shape, cache.seq_len
    (torch.Size([1, 128]), 3)
    """
    check_cache_arg(cache, "prefill")
    return model(tokens, cache, last_only=True)[:, -1]


@torch.inference_mode()
def decode_step(model: Transformer, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Feed one new token per sequence ``(B,)`` or ``(B, 1)``; returns next logits ``(B, vocab)``.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)
    >>> cache = kvlib.DynamicCache(model.config.n_layer)
    >>> new = [kvlib.prefill(model, torch.tensor([[1, 2, 3]]), cache).argmax(-1)]  # greedy, by hand
    >>> for _ in range(4):
    ...     new.append(kvlib.decode_step(model, new[-1], cache).argmax(-1))
    >>> torch.cat(new).tolist() == kvlib.generate(model, [1, 2, 3], 5)[0, 3:].tolist()
    True
    """
    if not isinstance(token, torch.Tensor):
        raise TypeError(f"token must be a tensor of token ids, (B,) or (B, 1), got {type(token).__name__} "
                        f"{token!r}: pass torch.tensor([{token!r}])" if isinstance(token, int) else
                        f"token must be a tensor of token ids, (B,) or (B, 1), got {type(token).__name__}")
    if token.dim() == 1:
        token = token[:, None]  # (B, 1)
    if token.dim() != 2 or token.shape[1] != 1:
        raise ValueError(f"decode_step feeds one token per sequence, (B,) or (B, 1); got shape {tuple(token.shape)}"
                         f" (use prefill for several tokens)")
    check_cache_arg(cache, "decode_step")
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
    try:  # once, at the API boundary: the forward itself skips this check off the CPU
        check_token_range(ids if valid is None else ids[valid], model.config.vocab_size)
    except IndexError as err:
        raise IndexError(f"prompt {err}") from None
    if valid is not None:
        ids = ids.masked_fill(~valid, 0)  # pad ids never reach a real token's output; keep them in range
        valid = valid.to(model.device)
    return ids.to(device=model.device, dtype=torch.long), valid


def _check_len(model: Transformer, prompt_len: int, cache: Cache | None, max_new_tokens: int) -> None:
    """The whole generation's positions fit ``max_seq_len``: ``tokens_seen + prompt + new``, or less for a
    cache whose positions count slots (`Cache.position_end`)."""
    int_at_least("max_new_tokens", max_new_tokens, 0)
    past = 0 if cache is None else cache.tokens_seen
    end = prompt_len + max_new_tokens if cache is None else cache.position_end(prompt_len + max_new_tokens)
    if end > model.config.max_seq_len:
        raise ValueError(
            f"{past} tokens seen + {prompt_len} prompt + {max_new_tokens} new = {past + prompt_len + max_new_tokens} "
            f"tokens exceeds max_seq_len={model.config.max_seq_len}"
        )


def check_cache_arg(cache: object, who: str) -> None:
    """``cache`` is None or a kvlib `Cache`; else a ``TypeError`` that says what to pass instead."""
    if cache is None or isinstance(cache, Cache):
        return
    from .paged import PagedCache  # on the error path only: a plain generate never loads the pool

    if isinstance(cache, PagedCache):
        raise TypeError(
            f"{who} take a kvlib Cache, and a PagedCache is a pool of blocks shared by many sequences, not one "
            f"sequence's cache: run it with kvlib.Engine(model, paged_cache).run(prompts), or drive one step "
            f"yourself with `with paged_cache.step(seq_ids, tokens) as batch: model(tokens, batch)`")
    raise TypeError(f"cache must be a kvlib Cache (DynamicCache, StaticCache, ...) or None, "
                    f"got {type(cache).__name__}")


# -- the shared loop ---------------------------------------------------------------------------
def _loop(
    next_logits: Callable[[torch.Tensor | None], torch.Tensor],
    batch: int,
    params: SamplingParams,
    device: torch.device,
    sync_every: int = 1,
) -> Iterator[torch.Tensor]:
    """Yield ``(B,)`` tokens. ``next_logits(None)`` starts; ``next_logits(tok)`` continues.

    A sequence that emits a stop token is finished: it repeats that token
    until every sequence in the batch has finished (as HF pads finished rows).
    Asking "has every row finished?" reads a value back from the device; it is
    asked every ``sync_every`` steps (``stream`` asks every step, `generate`
    rarely, and trims the extra steps afterwards).
    """
    generator = params.make_generator(device)
    stops = torch.tensor(params.stop, device=device) if params.stop else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    fill = torch.zeros(batch, dtype=torch.long, device=device)
    tok = None
    for step in range(params.need_max_new_tokens()):
        with torch.inference_mode():  # scoped per step: a suspended generator must not leak the mode
            logits = next_logits(tok)  # (B, vocab)
            tok = sample(logits, params, generator=generator)
            tok = torch.where(finished, fill, tok)
        yield tok
        if stops is not None:
            just = torch.isin(tok, stops) & ~finished
            fill = torch.where(just, tok, fill)
            finished |= just
            if (step + 1) % sync_every == 0 and bool(finished.all()):
                return


def _cached_stepper(model: Transformer, ids: torch.Tensor, cache: Cache):
    """Prefill, then one decode step per token; the cache supplies positions and masks."""

    def next_logits(tok):
        return prefill(model, ids, cache) if tok is None else decode_step(model, tok, cache)

    return next_logits


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
        key_valid = torch.cat(masks, dim=1)  # no cache to ask: pass positions and padding explicitly
        return model(full, positions=position_ids(key_valid), key_valid=key_valid, last_only=True)[:, -1]

    return next_logits


def _default_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    if model.config.hybrid:  # windows, chunks, shared layers: a policy per layer
        return HybridCache.for_model(model.config)
    return StaticCache.for_model(model.config, batch, max_len, dtype=model.dtype, device=model.device)


def _trim_finished(toks: torch.Tensor, stop: tuple[int, ...]) -> torch.Tensor:
    """Cut ``(B, n)`` new tokens after the step at which every row had emitted a stop token."""
    if not stop or toks.shape[1] == 0:
        return toks
    hit = torch.isin(toks, torch.tensor(stop, device=toks.device))  # (B, n)
    if not bool(hit.any(dim=1).all()):
        return toks  # some row never stopped: every step was needed
    first = hit.int().argmax(dim=1)  # (B,) each row's first stop
    return toks[:, : int(first.max()) + 1]


# -- public entry points ------------------------------------------------------------------------
def stream(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
    **sampling_kwargs,
) -> Iterator:
    """Cached generation that yields each new token as soon as it exists.

    For a ``list[int]`` prompt it yields ``int``s; for a batch (a tensor, or a
    list of lists) it yields ``(B,)`` tensors. Prompts of different lengths
    are left-padded (see `generate`). ``cache=None`` allocates a `StaticCache`
    of exactly prompt + ``max_new_tokens`` slots; a cache you pass in may
    already hold a conversation, and the prompt is appended after it.
    How tokens are picked: ``sampling=SamplingParams(...)``, or its fields as
    keywords (``temperature``, ``top_k``, ``top_p``, ``stop``, ``seed``, ``generator``).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)  # sharp logits: no near ties
    >>> new = list(kvlib.stream(model, [1, 2, 3], 5))  # five ints, one per step
    >>> len(new), new == kvlib.generate(model, [1, 2, 3], 5)[0, 3:].tolist()
    (5, True)
    """
    params = sampling_params(sampling, max_new_tokens, **sampling_kwargs)
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    toks = _stream(model, ids, valid, params, cache, sync_every=1)
    if isinstance(prompt_ids, torch.Tensor) or ids.shape[0] > 1 or valid is not None:
        return toks
    return (int(tok[0]) for tok in toks)


def _stream(model, ids: torch.Tensor, valid: torch.Tensor | None, params: SamplingParams, cache, sync_every: int):
    """The checks (at call time), then the lazy loop."""
    n_new = params.need_max_new_tokens()
    B, T = ids.shape
    check_cache_arg(cache, "generate and stream")
    past = 0 if cache is None else cache.tokens_seen
    if valid is not None and past > 0:
        raise ValueError(f"padded prompts need an empty cache; this one has already seen {past} tokens")
    _check_len(model, T, cache, n_new)
    if cache is None and n_new > 0:
        cache = _default_cache(model, B, T + n_new)
    if valid is not None and cache is not None:
        cache = PaddedBatch(cache, valid)  # the cache now knows which prompt slots are pads
    return _loop(_cached_stepper(model, ids, cache), B, params, ids.device, sync_every)


def generate(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
    **sampling_kwargs,
) -> torch.Tensor:
    """Prefill once, then one cached decode step per token.

    Returns prompt + new tokens as a ``(B, T + n)`` LongTensor, like Hugging
    Face's ``generate``; ``n < max_new_tokens`` when every row hit ``stop``.
    A list of prompts of different lengths is left-padded to ``T`` with
    ``pad_id`` (so every row's new tokens line up at the right); padding keys
    are masked out and each row's positions start at its first real token, so
    every row gets the tokens it would get alone. Sampling as in `stream`.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)  # sharp logits: no near ties
    >>> out = kvlib.generate(model, [1, 2, 3], max_new_tokens=5)
    >>> out.shape, out[0, :3].tolist()  # the prompt, then 5 new tokens
    (torch.Size([1, 8]), [1, 2, 3])
    >>> kvlib.generate(model, [[1, 2, 3], [4, 5]], 5).shape  # a batch, left-padded
    torch.Size([2, 8])
    """
    params = sampling_params(sampling, max_new_tokens, **sampling_kwargs)
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    # Ask "all stopped?" rarely, then trim: unless a cache or generator of the caller's would see the extra steps.
    own = cache is None and params.generator is None
    toks = list(_stream(model, ids, valid, params, cache, sync_every=16 if own else 1))
    return _join(ids, valid, pad_id, toks, params)


def _join(ids, valid, pad_id, toks, params) -> torch.Tensor:
    ids = ids if valid is None else ids.masked_fill(~valid, pad_id)
    if not toks:
        return ids
    return torch.cat([ids, _trim_finished(torch.stack(toks, dim=1), params.stop)], dim=1)


def generate_naive(
    model: Transformer,
    prompt_ids,
    max_new_tokens: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    cache: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_id: int = 0,
    **sampling_kwargs,
) -> torch.Tensor:
    """Like `generate`, but recompute the whole sequence at every step (no cache).

    ``cache`` is accepted for a drop-in signature and must be None.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)  # sharp logits: no near ties
    >>> slow = kvlib.generate_naive(model, [1, 2, 3], max_new_tokens=5)
    >>> torch.equal(slow, kvlib.generate(model, [1, 2, 3], max_new_tokens=5))  # the cache changes no token
    True
    """
    if cache is not None:
        raise ValueError("generate_naive recomputes everything and uses no cache; pass cache=None")
    params = sampling_params(sampling, max_new_tokens, **sampling_kwargs)
    n_new = params.need_max_new_tokens()
    ids, valid = _as_batch(prompt_ids, model, attention_mask, pad_id)
    B, T = ids.shape
    _check_len(model, T, None, n_new)
    toks = list(_loop(_naive_stepper(model, ids, valid), B, params, ids.device, sync_every=16))
    return _join(ids, valid, pad_id, toks, params)
