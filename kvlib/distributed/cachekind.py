"""Which stored K/V may stand in for a recompute: a cache's *kind*, part of every chunk's key.

A chunk on disk saves a later request from recomputing its tokens' keys and values. That is
only sound if the request would have computed the same numbers. The weights and the cache's
shape settle most of it (`kvlib.distributed.disk.fingerprint`); the cache settles the rest:

* an **exact** cache (`kvlib.DynamicCache`, `kvlib.StaticCache`, a `kvlib.hybrid.HybridCache`
  whose every layer is full) gives back what the model wrote: its kind is ``"exact"``;
* a **lossy** cache (`kvlib.quant.QuantizedCache`, `kvlib.fp8.FP8Cache`, `CastCache`,
  `kvlib.hf.HFQuantizedCache`) gives back rounded K/V, and the model's later layers attended
  over those, so every layer's K/V depend on the cache's settings. Its kind names the class
  and its settings, e.g. ``"QuantizedCache(bits=2, ...)"``: a 2-bit prefix is served only to a
  request that runs the same 2-bit cache, never to an exact one;
* an **evicting** cache (`kvlib.evict.WindowCache`, `SinkCache`, `H2OCache`,
  `kvlib.press.PressCache`, a `HybridCache` with window, chunked or shared layers) does not hold
  the whole prefix, so there is nothing whole to store: `cache_kind` refuses it.

A cache class it does not know (your own) raises a ``TypeError``: pass ``kind=`` yourself
(``"exact"`` if it returns what it was given). The kind is a string: it goes into the
`fingerprint` (with the weights' name and the cache's shape), the fingerprint into every
`chunk_key` of the chain, and both into each chunk file's metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

from ..cache import Cache, DynamicCache, StaticCache

EXACT = "exact"
MAX_KIND_CHARS = 256  # a kind goes into every chunk file's header, so the store bounds its length
# exact class (not subclasses: CastCache and LatentCache are DynamicCaches that store other numbers)
_EXACT_CLASSES = (DynamicCache, StaticCache)
# lossy classes, by module and name (kvlib.hf is not imported for this), and the settings that shape their K/V
_LOSSY = {
    ("kvlib.quant", "QuantizedCache"): ("bits", "key_dim", "value_dim", "group_size", "residual", "block",
                                        "symmetric"),
    ("kvlib.fp8", "FP8Cache"): ("per_head", "scale"),
    ("kvlib.quant", "CastCache"): ("store_dtype",),
    ("kvlib.hf", "HFQuantizedCache"): ("backend", "kwargs"),
}
_EVICTING = {("kvlib.evict", "_Budgeted")}  # WindowCache, SinkCache, H2OCache and kvlib.press.PressCache


def fingerprint(model_id: str, n_layer: int, n_kv_head: int, head_dim: int, dtype: torch.dtype,
                kind: str = EXACT) -> str:
    """What must be equal for two K/V to be interchangeable: the weights, the cache's shape, and
    the kind of cache that made them (`cache_kind`: exact, or lossy with its settings)."""
    return f"{model_id}|layers={n_layer}|kv_heads={n_kv_head}|head_dim={head_dim}|dtype={dtype}|cache={kind}"


def chunk_key(parent: str | None, fp: str, tokens: Sequence[int]) -> str:
    """``key_i = sha256(key_{i-1}, fingerprint, tokens of chunk i)``, as 64 hex digits.

    Chaining makes the key depend on every earlier token, because a chunk's K/V do: the same
    256 tokens after another prefix hold other keys and values (attention mixed them in).
    """
    return hashlib.sha256(json.dumps([parent or "", fp, list(tokens)]).encode()).hexdigest()


def _names(cache: Cache) -> list[tuple[str, str]]:
    return [(c.__module__, c.__name__) for c in type(cache).__mro__]


def cache_kind(cache: object) -> str:
    """``"exact"`` for a cache that returns the K/V it was given, ``"Class(setting=value, ...)"``
    for a lossy one; ``ValueError`` for a cache that evicts tokens, ``TypeError`` for one it
    does not know. Two caches share stored prefixes only if their kinds are equal.

    >>> from kvlib.distributed.cachekind import cache_kind
    >>> cache_kind(kvlib.DynamicCache(2))
    'exact'
    >>> cache_kind(kvlib.quant.QuantizedCache(2, bits=2, group_size=8))
    "QuantizedCache(bits=2, key_dim='channel', value_dim='token', group_size=8, residual=32, block=32, symmetric=False)"
    """
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a kvlib Cache, got {type(cache).__name__}")
    name = type(cache).__name__
    if type(cache) in _EXACT_CLASSES:
        return EXACT
    if any(n in _EVICTING for n in _names(cache)):
        raise ValueError(f"a {name} evicts tokens, so it does not hold the whole prefix: the disk tier "
                         "cannot store or serve its K/V; use an exact cache (DynamicCache, StaticCache) "
                         "or a quantized one, which keeps every token")
    if (type(cache).__module__, name) == ("kvlib.hybrid", "HybridCache"):
        others = sorted({str(k) for k in cache.layers if k.kind != "full"})
        if others:
            raise ValueError(f"this HybridCache has {', '.join(others)} layers, which do not hold every token "
                             "of their own: the disk tier stores and serves whole prefixes of full layers only")
        return EXACT
    settings = _LOSSY.get((type(cache).__module__, name))
    if settings is None:
        raise TypeError(f"the disk tier does not know whether a {name} returns the K/V it was given: pass "
                        f"kind='{EXACT}' if it does, or a string naming its class and settings if it rounds "
                        "them, so that its prefixes are served only to requests that run the same cache")
    return f"{name}(" + ", ".join(f"{s}={getattr(cache, s)!r}" for s in settings) + ")"


def check_kind(kind: object) -> str:
    """``kind`` if it is a string of 1 to `MAX_KIND_CHARS` characters (what `cache_kind` returns);
    else a ``TypeError``/``ValueError``."""
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str such as '{EXACT}' (see cache_kind), got {type(kind).__name__}")
    if not 0 < len(kind) <= MAX_KIND_CHARS:
        raise ValueError(f"kind must be a str of 1 to {MAX_KIND_CHARS} characters such as '{EXACT}' "
                         f"(see cache_kind), got {len(kind)} characters")
    return kind


def resolve_kind(kv: object, kind: str | None = None) -> str:
    """The kind of the K/V in ``kv``: ``cache_kind(kv)`` for a `Cache`, checked against ``kind``
    where both are known; ``kind`` for a cache class `cache_kind` does not know (else its
    ``TypeError``); for anything else (per-layer ``(k, v)`` pairs) ``kind``, default exact."""
    if kind is not None:
        check_kind(kind)
    if not isinstance(kv, Cache):
        return EXACT if kind is None else kind
    try:
        known = cache_kind(kv)
    except TypeError:
        if kind is None:
            raise
        return kind
    if kind is not None and kind != known:
        raise ValueError(f"kind={kind!r}, but this {type(kv).__name__} is of kind {known}")
    return known
