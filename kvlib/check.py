"""Check your own cache class against the protocol every kvlib cache obeys.

    from kvlib.check import check_cache
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: MyCache(...))

``check_cache`` builds fresh caches with the factory and runs each property
below; the first one that fails raises `CacheCheckError` naming the property
and what differed; when all pass it returns their names (``verbose=True`` prints
them on one line). kvlib's own test suite runs these same properties on every
kvlib cache (``tests/test_conformance.py``).

The keys and values fed are what a model gives a cache: views into one larger
activation (the fused QKV projection), not tensors of their own. A cache that keeps
such a view keeps the whole activation alive, which `storage_bytes` sees.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from .cache import Cache

Factory = Callable[[int, int, int, int, torch.dtype], Cache]  # (n_layer, batch, n_kv_head, head_dim, dtype)

L, B, H, D = 3, 2, 2, 4
CHUNKS = [3, 1, 1, 2]  # a prefill of 3, then decode steps, then a chunk of 2


class CacheCheckError(AssertionError):
    """A cache broke one of the protocol's properties."""


def _kv(T: int, seed: int, dtype: torch.dtype, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``(batch, H, T, D)`` as a model makes them: views into one ``(batch, T, 3·H·D)``
    projection output (queries, keys, values side by side), so neither owns its storage."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, T, 3 * H * D, generator=g).to(dtype)  # (B, T, 3·H·D): the fused projection

    def part(i: int) -> torch.Tensor:
        return qkv[..., i * H * D:(i + 1) * H * D].view(batch, T, H, D).transpose(1, 2)  # (B, H, T, D), a view

    return part(1), part(2)


def storage_bytes(cache: Cache) -> int:
    """Bytes of every distinct storage the cache's attributes reach, each counted once.

    This is the memory the cache really keeps alive: a tensor that is a view of a larger
    one counts the whole storage under it. Attributes a cache names in ``beside_kv``
    (positions, scores kept beside K/V, which its ``nbytes`` leaves out) are skipped.
    """
    return sum({_storage_key(t): t.untyped_storage().nbytes() for t in _held_tensors(cache)}.values())


def _storage_key(t: torch.Tensor) -> tuple:
    """Which storage ``t`` lies in: views of one tensor share it."""
    return t.device, t.untyped_storage().data_ptr()


_OPAQUE = (torch.nn.Module, torch.Generator, type, types.FunctionType, types.MethodType, types.ModuleType,
           torch.dtype, torch.device, str, bytes, int, float, bool)


def _held_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, lists, tuples and dicts."""
    out, seen = [], set()

    def walk(x: object, depth: int) -> None:
        if x is None or id(x) in seen or depth > 8 or isinstance(x, _OPAQUE):
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for y in x:
                walk(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)
        elif hasattr(x, "__dict__"):
            skip = set(getattr(x, "beside_kv", ())) if isinstance(x, Cache) else set()
            for name, y in vars(x).items():
                if name not in skip:
                    walk(y, depth + 1)

    walk(root, 0)
    return out


def _fail(prop: str, msg: str) -> None:
    raise CacheCheckError(f"[{prop}] {msg}")


def _expect_equal(prop: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        _fail(prop, f"{what}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        _fail(prop, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.equal(got, want):
        _fail(prop, f"{what}: values differ (max |diff| {(got.float() - want.float()).abs().max():.3g})")


def _filled(
    make: Factory, dtype: torch.dtype, chunks=CHUNKS, exact: bool = True
) -> tuple[Cache, list[torch.Tensor], list[torch.Tensor]]:
    """A cache fed ``chunks`` in every layer, and the concatenated K and V it should hold.
    With ``exact=False`` (properties about bytes or errors) a lossy cache's values are not compared."""
    cache = make(L, B, H, D, dtype)
    ks, vs = [[] for _ in range(L)], [[] for _ in range(L)]
    for step, T in enumerate(chunks):
        for layer in range(L):
            k, v = _kv(T, 100 * step + layer, dtype)
            k_all, v_all = cache.update(k, v, layer)
            ks[layer].append(k)
            vs[layer].append(v)
            if not exact:
                continue
            _expect_equal("update returns everything so far", f"keys of layer {layer} after step {step}",
                          k_all, torch.cat(ks[layer], dim=2))
            _expect_equal("update returns everything so far", f"values of layer {layer} after step {step}",
                          v_all, torch.cat(vs[layer], dim=2))
    return cache, [torch.cat(k, dim=2) for k in ks], [torch.cat(v, dim=2) for v in vs]


def check_update(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``update`` returns all keys/values so far, per layer, and ``seq_len`` counts them."""
    cache, ks, _ = _filled(make, dtype)
    total = sum(CHUNKS)
    if cache.seq_len != total:
        _fail("seq_len counts tokens", f"seq_len is {cache.seq_len} after {total} tokens")
    for layer in range(L):
        if cache.get_seq_length(layer) != total:
            _fail("seq_len counts tokens", f"get_seq_length({layer}) is {cache.get_seq_length(layer)}, expected {total}")


LONG = CHUNKS + [1] * 13  # 20 tokens: past the budget of the small evicting caches a check builds


def check_tokens_seen(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``tokens_seen`` counts every token given, evicted or not, as a recompute over the whole text does
    (its next position); ``tokens_held`` is what ``layer_kv(0)`` returns, and never more than that."""
    cache = make(L, B, H, D, dtype)
    total = 0
    for step, T in enumerate(LONG):
        for layer in range(L):
            cache.update(*_kv(T, 100 * step + layer, dtype), layer)
        total += T
        seen, held = getattr(cache, "tokens_seen", None), cache.tokens_held
        if seen != total:
            _fail("tokens seen", f"tokens_seen is {seen} after {total} tokens (it holds {held}): a cache that "
                  f"evicts must still count every token it was given, or the next token's position is wrong")
        kv = cache.layer_kv(0)
        shown = 0 if kv is None else kv[0].shape[2]
        if held != shown or held > seen:
            _fail("tokens seen", f"tokens_held is {held} but layer_kv(0) returns {shown} keys after {total} tokens")


def check_layers_independent(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """Writing layer 1 must not change what layer 0 holds."""
    cache, ks, vs = _filled(make, dtype, [2])
    cache.update(*_kv(1, 999, dtype), 1)
    k0, v0 = cache.layer_kv(0)
    _expect_equal("layers are independent", "layer 0 keys after writing layer 1", k0, ks[0])
    _expect_equal("layers are independent", "layer 0 values after writing layer 1", v0, vs[0])


def check_crop_and_reset(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``crop(n)`` keeps the first n tokens, ``crop(-k)`` drops k, and updates continue from there;
    ``reset()`` empties the cache."""
    cache, ks, _ = _filled(make, dtype)
    cache.crop(4)
    if cache.seq_len != 4:
        _fail("crop keeps a prefix", f"seq_len is {cache.seq_len} after crop(4)")
    _expect_equal("crop keeps a prefix", "layer 2 keys after crop(4)", cache.layer_kv(2)[0], ks[2][:, :, :4])
    cache.crop(-1)
    if cache.seq_len != 3:
        _fail("crop keeps a prefix", f"seq_len is {cache.seq_len} after crop(-1) from 4")
    if cache.tokens_seen != 3:
        _fail("crop keeps a prefix", f"tokens_seen is {cache.tokens_seen} after crop(-1) from 4")
    held = storage_bytes(cache)
    if held != cache.nbytes:
        _fail("crop keeps a prefix", f"after crop the cache keeps {held} bytes of storage alive but nbytes says "
              f"{cache.nbytes}: does crop keep a view of the old tensors instead of a copy?")
    k_new, v_new = _kv(1, 7, dtype)
    k_all, _ = cache.update(k_new, v_new, 0)
    _expect_equal("crop keeps a prefix", "layer 0 keys after crop then update", k_all,
                  torch.cat([ks[0][:, :, :3], k_new], dim=2))
    cache.reset()
    if cache.seq_len != 0 or cache.layer_kv(0) is not None:
        _fail("reset empties", f"after reset seq_len={cache.seq_len}, layer_kv(0)={cache.layer_kv(0) is not None}")


def check_nbytes(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``nbytes`` is at least what the stored keys and values need: 2·L·B·H·S·D·bytes."""
    cache, _, _ = _filled(make, dtype, exact=False)
    need = 2 * L * B * H * sum(CHUNKS) * D * torch.empty((), dtype=dtype).element_size()
    if not isinstance(cache.nbytes, int) or cache.nbytes < need:
        _fail("nbytes counts storage", f"nbytes is {cache.nbytes!r}, but the stored K/V alone need {need}")


def check_storage(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """After a prefill and after each later step, the storage the cache keeps alive
    (`storage_bytes`, each storage once) equals its ``nbytes``: no view of an activation kept."""
    cache = make(L, B, H, D, dtype)
    for step, T in enumerate(CHUNKS):
        for layer in range(L):
            cache.update(*_kv(T, 100 * step + layer, dtype), layer)
        held = storage_bytes(cache)
        if held != cache.nbytes:
            what = "the prefill" if step == 0 else f"step {step}"
            _fail("storage equals nbytes", f"after {what} the cache keeps {held} bytes of storage alive but "
                  f"nbytes says {cache.nbytes} ({held / max(cache.nbytes, 1):.2f}x): does it store a view of "
                  f"the keys it was given instead of a copy?")


def _snapshot(cache: Cache) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """Each held storage's bytes: {(device, ptr): (the storage as uint8, a copy of it)}."""
    snap = {}
    for t in _held_tensors(cache):
        key = _storage_key(t)
        if key not in snap:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())  # (nbytes,)
            snap[key] = (raw, raw.clone())
    return snap


def _lower_bound_written(cache: Cache, before: dict) -> int:
    """Bytes an update must at least have written: the bytes that changed in storage held before,
    plus the non-zero bytes of every new storage (a freshly zeroed block's zeros are an allocation,
    not a write), and no more of a new buffer than ``layer_kv`` shows (one filled part way)."""
    shown: dict[tuple, int] = {}
    for layer in range(L):
        for t in cache.layer_kv(layer) or ():
            shown[_storage_key(t)] = shown.get(_storage_key(t), 0) + t.nbytes
    total = 0
    for key, (raw, _) in _snapshot(cache).items():
        old = before.get(key)
        if old is not None and old[0].numel() == raw.numel():
            total += int((old[1] != raw).sum())  # bytes rewritten in place (an equal byte is not seen)
        else:
            total += min(shown.get(key, raw.numel()), int((raw != 0).sum()))
    return total


def check_bytes_written(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """Every update adds to ``bytes_written`` at least the bytes it really wrote into the
    cache's storage: the bytes that changed, and every new storage (a ``torch.cat`` copies all)."""
    cache = make(L, B, H, D, dtype)
    for step, T in enumerate(CHUNKS):
        for layer in range(L):
            k, v = _kv(T, 100 * step + layer, dtype)
            before, counted = _snapshot(cache), cache.bytes_written
            cache.update(k, v, layer)
            grew, wrote = cache.bytes_written - counted, _lower_bound_written(cache, before)
            reads_another = callable(getattr(cache, "owner", None)) and cache.owner(layer) != layer  # shared
            if (grew <= 0 and not reads_another) or grew < wrote:
                _fail("bytes written counts writes",
                      f"update(layer={layer}) of step {step} wrote at least {wrote} bytes into the cache's "
                      f"storage, but bytes_written grew by {grew}")


def check_reset_new_batch(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """After ``reset()``, or ``crop(0)``, the cache takes a batch of another size, and holds only the new tokens."""
    for empty in ("reset()", "crop(0)"):
        cache, _, _ = _filled(make, dtype, [2], exact=False)
        cache.reset() if empty == "reset()" else cache.crop(0)
        k, v = _kv(3, 55, dtype, batch=B + 1)
        try:
            keys, values = cache.update(k, v, 0)
        except Exception as e:  # a crash here (a RuntimeError from a stale buffer) is what this property catches
            _fail("reset then a new batch size", f"after {empty}, an update with batch {B + 1} (was {B}) raised "
                  f"{type(e).__name__}: {e}")
        for what, got, want in (("keys", keys, k), ("values", values, v)):
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=0.5, rtol=0.1):
                _fail("reset then a new batch size", f"{what} after {empty} and a batch of {B + 1}: shape "
                      f"{tuple(got.shape)}, expected the new tokens alone, {tuple(want.shape)} (a lossy cache "
                      f"may round them)")
        if cache.seq_len != 3 or cache.tokens_seen != 3:
            _fail("reset then a new batch size", f"seq_len is {cache.seq_len} and tokens_seen "
                  f"{cache.tokens_seen} after {empty} and 3 new tokens")


def check_legacy(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``to_legacy()`` gives ``((k, v), ...)`` per layer, equal to what was stored."""
    cache, ks, vs = _filled(make, dtype)
    past = cache.to_legacy()
    if len(past) != L:
        _fail("legacy format", f"to_legacy() has {len(past)} layers, expected {L}")
    for layer, (k, v) in enumerate(past):
        _expect_equal("legacy format", f"legacy keys of layer {layer}", k, ks[layer])
        _expect_equal("legacy format", f"legacy values of layer {layer}", v, vs[layer])


def check_rejects_bad_updates(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """A mismatched batch or head count raises ValueError/TypeError instead of corrupting the cache:
    afterwards it reports the same lengths and holds the same keys, and takes a good update."""
    cache, _, _ = _filled(make, dtype, [2], exact=False)
    before = (cache.tokens_seen, cache.tokens_held, cache.layer_kv(0)[0].clone())
    for bad in (torch.randn(B + 1, H, 1, D), torch.randn(B, H + 1, 1, D)):
        k = bad.to(dtype)
        try:
            cache.update(k, k.clone(), 0)
        except (ValueError, TypeError, IndexError):
            pass
        else:
            _fail("rejects bad updates", f"update with shape {tuple(k.shape)} into a cache of batch {B}, "
                  f"{H} KV heads did not raise")
        after = (cache.tokens_seen, cache.tokens_held, cache.layer_kv(0)[0])
        if after[:2] != before[:2] or not torch.equal(after[2], before[2]):
            _fail("rejects bad updates", f"a refused update changed the cache: (tokens_seen, tokens_held) "
                  f"{before[:2]} -> {after[:2]}")
    cache.update(*_kv(1, 77, dtype), 0)
    if cache.tokens_seen != before[0] + 1:
        _fail("rejects bad updates", f"after a refused update, a good one left tokens_seen at {cache.tokens_seen}")


def check_generation(make: Factory) -> None:
    """Used by a model, the cache must give the tokens of full recompute (a tiny random Llama)."""
    from .config import ModelConfig
    from .generate import generate, generate_naive
    from .model import Transformer

    cfg = ModelConfig(n_layer=L, n_head=2 * H, n_kv_head=H, d_model=2 * H * D, d_ff=32, vocab_size=61, max_seq_len=64)
    model = Transformer(cfg)
    model.reset_parameters(seed=0, std=0.2)  # sharp logits: no argmax ties
    ids = torch.randint(0, 61, (B, 5), generator=torch.Generator().manual_seed(1))
    want = generate_naive(model, ids, 8)
    got = generate(model, ids, 8, cache=make(L, B, H, D, torch.float32))
    if not torch.equal(got, want):
        diff = (got != want).nonzero()[0].tolist()
        _fail("generation equals recompute", f"tokens differ from full recompute, first at (row, pos) {diff}")


PROPERTIES = [check_update, check_tokens_seen, check_layers_independent, check_crop_and_reset, check_nbytes, check_storage,
              check_bytes_written, check_reset_new_batch, check_legacy, check_rejects_bad_updates,
              check_generation]


def property_name(prop: Callable) -> str:
    """A property's short name: ``check_crop_and_reset`` -> ``"crop and reset"``."""
    return prop.__name__.removeprefix("check_").replace("_", " ")


def check_cache(make: Factory, *, verbose: bool = False, not_applicable: dict[str, str] | None = None) -> list[str]:
    """Run every property on caches made by ``make(n_layer, batch, n_kv_head, head_dim, dtype)``.

    Returns the names of the properties checked (all of them passed: the first failure
    raises `CacheCheckError`). With ``verbose=True`` it also prints one summary line,
    ``ok  MyCache: all 10 properties hold (update, ...)``.

    A cache that by design breaks a property (one that evicts does not return "everything
    so far") declares it: ``not_applicable={"update": "it evicts"}``, by property name.
    Declared properties are not run, and the summary line names them with their reasons.

    Example

    >>> def make(n_layer, batch, n_kv_head, head_dim, dtype):
    ...     return kvlib.DynamicCache(n_layer)
    >>> names = kvlib.check.check_cache(make, verbose=True)
    ok  DynamicCache: all 11 properties hold (update, tokens seen, layers independent, ...)
    >>> len(names)
    11
    """
    want = "a factory function make(n_layer, batch, n_kv_head, head_dim, dtype) -> Cache"
    if isinstance(make, type):
        raise TypeError(f"check_cache takes {want}, got the class {make.__name__} itself: wrap it, e.g. "
                        f"check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: {make.__name__}(n_layer))")
    if not callable(make):
        raise TypeError(f"check_cache takes {want}, got {type(make).__name__}")
    names = {property_name(prop): prop for prop in PROPERTIES}
    skip = dict(not_applicable or {})
    unknown = sorted(set(skip) - set(names))
    if unknown:
        raise ValueError(f"not_applicable names no property: {unknown}; the properties are {sorted(names)}")
    if not all(isinstance(why, str) and why.strip() for why in skip.values()):
        raise ValueError("each not-applicable property needs its reason, as a non-empty string")
    passed = []
    for name, prop in names.items():
        if name not in skip:
            prop(make)
            passed.append(name)
    if verbose:
        kind = type(make(L, B, H, D, torch.float32)).__name__
        line = f"ok  {kind}: all {len(passed)} properties hold ({', '.join(passed)})"
        if skip:
            line = (f"ok  {kind}: {len(passed)} properties hold ({', '.join(passed)}); not applicable: "
                    + "; ".join(f"{name} ({why})" for name, why in skip.items()))
        print(line)
    return passed
