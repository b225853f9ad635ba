"""Check your own cache class against the protocol every kvlib cache obeys.

    from kvlib.check import check_cache
    check_cache(lambda n_layer, batch, n_kv_head, head_dim, dtype: MyCache(...))

``check_cache`` builds fresh caches with the factory and runs each property
below; the first one that fails raises `CacheCheckError` naming the property
and what differed; when all pass it returns their names (``verbose=True`` prints
them on one line). kvlib's own test suite runs these same properties on
`DynamicCache` and `StaticCache`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cache import Cache

Factory = Callable[[int, int, int, int, torch.dtype], Cache]  # (n_layer, batch, n_kv_head, head_dim, dtype)

L, B, H, D = 3, 2, 2, 4
CHUNKS = [3, 1, 1, 2]  # a prefill of 3, then decode steps, then a chunk of 2


class CacheCheckError(AssertionError):
    """A cache broke one of the protocol's properties."""


def _kv(T: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)


def _fail(prop: str, msg: str) -> None:
    raise CacheCheckError(f"[{prop}] {msg}")


def _expect_equal(prop: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        _fail(prop, f"{what}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        _fail(prop, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.equal(got, want):
        _fail(prop, f"{what}: values differ (max |diff| {(got.float() - want.float()).abs().max():.3g})")


def _filled(make: Factory, dtype: torch.dtype, chunks=CHUNKS) -> tuple[Cache, list[torch.Tensor], list[torch.Tensor]]:
    """A cache fed ``chunks`` in every layer, and the concatenated K and V it should hold."""
    cache = make(L, B, H, D, dtype)
    ks, vs = [[] for _ in range(L)], [[] for _ in range(L)]
    for step, T in enumerate(chunks):
        for layer in range(L):
            k, v = _kv(T, 100 * step + layer, dtype)
            k_all, v_all = cache.update(k, v, layer)
            ks[layer].append(k)
            vs[layer].append(v)
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
    k_new, v_new = _kv(1, 7, dtype)
    k_all, _ = cache.update(k_new, v_new, 0)
    _expect_equal("crop keeps a prefix", "layer 0 keys after crop then update", k_all,
                  torch.cat([ks[0][:, :, :3], k_new], dim=2))
    cache.reset()
    if cache.seq_len != 0 or cache.layer_kv(0) is not None:
        _fail("reset empties", f"after reset seq_len={cache.seq_len}, layer_kv(0)={cache.layer_kv(0) is not None}")


def check_nbytes(make: Factory, dtype: torch.dtype = torch.float32) -> None:
    """``nbytes`` is at least what the stored keys and values need: 2·L·B·H·S·D·bytes."""
    cache, _, _ = _filled(make, dtype)
    need = 2 * L * B * H * sum(CHUNKS) * D * torch.empty((), dtype=dtype).element_size()
    if not isinstance(cache.nbytes, int) or cache.nbytes < need:
        _fail("nbytes counts storage", f"nbytes is {cache.nbytes!r}, but the stored K/V alone need {need}")


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
    """A mismatched batch or head count raises ValueError/TypeError instead of corrupting the cache."""
    cache, _, _ = _filled(make, dtype, [2])
    k = torch.randn(B + 1, H, 1, D).to(dtype)
    try:
        cache.update(k, k.clone(), 0)
    except (ValueError, TypeError, IndexError):
        pass
    else:
        _fail("rejects bad updates", f"update with batch {B + 1} into a batch-{B} cache did not raise")


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


PROPERTIES = [check_update, check_layers_independent, check_crop_and_reset, check_nbytes, check_legacy,
              check_rejects_bad_updates, check_generation]


def property_name(prop: Callable) -> str:
    """A property's short name: ``check_crop_and_reset`` -> ``"crop and reset"``."""
    return prop.__name__.removeprefix("check_").replace("_", " ")


def check_cache(make: Factory, *, verbose: bool = False, not_applicable: dict[str, str] | None = None) -> list[str]:
    """Run every property on caches made by ``make(n_layer, batch, n_kv_head, head_dim, dtype)``.

    Returns the names of the properties checked (all of them passed: the first failure
    raises `CacheCheckError`). With ``verbose=True`` it also prints one summary line,
    ``ok  MyCache: all 7 properties hold (update, ...)``.

    A cache that by design breaks a property (one that evicts does not return "everything
    so far") declares it: ``not_applicable={"update": "it evicts"}``, by property name.
    Declared properties are not run, and the summary line names them with their reasons.
    """
    if not callable(make):
        raise TypeError(f"check_cache takes a factory function, got {type(make).__name__}")
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
