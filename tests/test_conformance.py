"""Every kvlib cache against `kvlib.check.check_cache`: each property holds, or the cache says why not.

The registry below is the list of kvlib's `Cache` classes. `test_the_registry_lists_every_cache`
fails when a new cache class appears without an entry, so a cache cannot skip the checks by
being forgotten. Three classes are not standalone caches and are checked by their own tests:
`PagedBatch` and `PackedPagedBatch` (one forward over a paged pool, rectangular or packed:
tests/test_paged.py, tests/test_engine.py) and `PackedBatch` (one packed row whose steps have
fixed lengths: tests/test_packed.py and test_contracts.py).
"""

from __future__ import annotations

import inspect
import pkgutil

import pytest
import torch

import kvlib
from kvlib import Cache, DynamicCache, PaddedBatch, StaticCache
from kvlib.check import PROPERTIES, check_cache, property_name
from kvlib.evict import H2OCache, SinkCache, WindowCache
from kvlib.hf import HFQuantizedCache
from kvlib.hybrid import HybridCache, Recompute
from kvlib.layers import chunked, full, shared, window
from kvlib.mla import LatentCache
from kvlib.press import PressCache, SnapKVPress
from kvlib.quant import CastCache, FP8Cache, QuantizedCache

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

LOSSY = "it returns dequantized keys and values, not the exact ones stored"
EVICTS = "it evicts beyond its budget, so it does not return everything so far"
NO_CROP = "it cannot be cropped"
PATTERNED = "a model must carry the same layer pattern; tests/test_hybrid.py checks it against the masked recompute"


class ObservedH2O(H2OCache):
    """H2O as a model drives it: its own attention runs right after each update (a query per key
    head), so it has the weights it ranks by. check_cache calls update alone; this adds the rest."""

    def update(self, key_states, value_states, layer_idx):
        keys, values = super().update(key_states, value_states, layer_idx)
        B, H, T, D = key_states.shape
        q = torch.ones(B, H, T, D, dtype=keys.dtype)
        S = keys.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # bottom-right causal
        self.attention(q, keys, values, mask)
        return keys, values


class ObservedPress(PressCache):
    """A press cache as `kvlib.press.prefill` drives it: its own attention runs right after each
    update (a query per key head), which compresses a layer after its prefill."""

    def update(self, key_states, value_states, layer_idx):
        keys, values = super().update(key_states, value_states, layer_idx)
        B, H, T, D = key_states.shape
        q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(T)).to(keys.dtype)
        S = keys.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # bottom-right causal
        self.attention(q, keys, values, mask)
        return keys, values


PRESSED = "it compresses each layer's prefill to half, so it holds fewer tokens than it was given"


def padded(n, b, h, d, dt):
    """A PaddedBatch whose prompt has no pads: the wrapper must then be invisible."""
    return PaddedBatch(DynamicCache(n), torch.ones(b, 3, dtype=torch.bool))


def has_fp8_hf() -> bool:
    try:
        HFQuantizedCache(1)
    except ValueError:
        return False
    return True


# name: (factory, {property: why it does not apply})
REGISTRY = {
    "DynamicCache": (lambda n, b, h, d, dt: DynamicCache(n), {}),
    "StaticCache": (lambda n, b, h, d, dt: StaticCache(n, b, h, 64, d, dtype=dt),
                    {"reset new batch": "it is preallocated for one batch size (its spec is fixed)"}),
    "StaticCache(grow)": (lambda n, b, h, d, dt: StaticCache(n, b, h, 1, d, dtype=dt, grow=True),
                          {"reset new batch": "it is preallocated for one batch size (its spec is fixed)"}),
    "CastCache(same dtype)": (lambda n, b, h, d, dt: CastCache(n, dt), {}),
    "CastCache(fp16)": (lambda n, b, h, d, dt: CastCache(n, torch.float16),
                        {p: LOSSY for p in ("update", "layers independent", "crop and reset", "legacy")}
                        | {"nbytes": "it stores 2 bytes a number by design",
                           "generation": "fp16 rounding may flip a near-tie"}),
    "QuantizedCache(exact window)": (lambda n, b, h, d, dt: QuantizedCache(n, 8, residual=10**6), {}),
    "QuantizedCache(4-bit)": (
        lambda n, b, h, d, dt: QuantizedCache(n, 4, residual=2, block=2),
        {p: LOSSY for p in ("update", "layers independent", "crop and reset", "legacy", "generation")}
        | {"nbytes": "it stores fewer bytes than the keys by design"}),
    "FP8Cache": (lambda n, b, h, d, dt: FP8Cache(n),
                 {p: LOSSY for p in ("update", "layers independent", "crop and reset", "legacy", "generation")}
                 | {"nbytes": "it stores 1 byte a number by design"}),
    "HFQuantizedCache": (lambda n, b, h, d, dt: HFQuantizedCache(n),
                         {p: LOSSY for p in ("update", "layers independent", "legacy", "generation")}
                         | {"crop and reset": NO_CROP, "nbytes": "it stores 1 byte a number by design"}),
    "LatentCache": (lambda n, b, h, d, dt: LatentCache(n), {}),
    "PaddedBatch": (padded, {"crop and reset": "reset is refused: a PaddedBatch belongs to one padded prompt",
                             "reset new batch": "reset is refused: a PaddedBatch belongs to one padded prompt",
                             "generation": "generate pads and wraps its own cache"}),
    "WindowCache": (lambda n, b, h, d, dt: WindowCache(n, 16), {}),
    "WindowCache(evicting)": (lambda n, b, h, d, dt: WindowCache(n, 3),
                              {p: EVICTS for p in ("update", "crop and reset", "nbytes", "legacy", "generation")}),
    "SinkCache": (lambda n, b, h, d, dt: SinkCache(n, 2, 14, 10000.0), {}),
    "SinkCache(evicting)": (lambda n, b, h, d, dt: SinkCache(n, 1, 2, 10000.0),
                            {p: EVICTS for p in ("update", "crop and reset", "nbytes", "legacy", "generation")}),
    "H2OCache": (lambda n, b, h, d, dt: ObservedH2O(n, 4, 12),
                 {"crop and reset": "its scores sum the attention of later queries, which a crop cannot take "
                                    "back, so it refuses crop(n) for 0 < n < tokens_seen (tests/test_evict.py)"}),
    "H2OCache(evicting)": (lambda n, b, h, d, dt: ObservedH2O(n, 1, 2),
                           {p: EVICTS for p in ("update", "crop and reset", "nbytes", "legacy", "generation")}),
    "HybridCache(all full)": (lambda n, b, h, d, dt: HybridCache([full()] * n), {}),
    "HybridCache(wide window)": (lambda n, b, h, d, dt: HybridCache([window(16, sinks=2), full(), chunked(16)][:n]),
                                 {"generation": PATTERNED}),
    "HybridCache(evicting, shared)": (
        lambda n, b, h, d, dt: HybridCache([window(2, sinks=1), shared(0), chunked(3)][:n]),
        {p: EVICTS for p in ("update", "crop and reset", "nbytes", "legacy")}
        | {"layers independent": "layer 1 reads layer 0's cache by design, and is updated after it",
           "generation": PATTERNED}),
    "Recompute": (lambda n, b, h, d, dt: Recompute([full()] * n),
                  {"crop and reset": "a one-pass reference (what a model without a cache runs): it refuses crop"}),
    "PressCache(ratio 0)": (lambda n, b, h, d, dt: PressCache(n, "snapkv", 0.0), {}),
    "PressCache(compressing)": (
        lambda n, b, h, d, dt: ObservedPress(n, SnapKVPress(window_size=1, kernel_size=1), 0.5),
        {p: PRESSED for p in ("update", "layers independent", "crop and reset", "nbytes", "legacy",
                              "reset new batch")}
        | {"generation": "it compresses only through its own attention, which generate() does not install, "
                         "and then it is lossy"}),
}


@pytest.mark.parametrize("name", REGISTRY)
def test_every_kvlib_cache_passes_check_cache(name):
    make, na = REGISTRY[name]
    if name == "HFQuantizedCache" and not has_fp8_hf():
        pytest.skip("this transformers has no 'fp8' QuantizedCache (tests/test_hf.py checks the error)")
    passed = check_cache(make, not_applicable=na)
    assert set(passed) | set(na) == {property_name(p) for p in PROPERTIES}


def test_every_new_property_runs_on_every_cache_or_is_declared():
    """The three properties of kvlib 0.3 (storage, bytes written, reset then a new batch) are run on
    nearly every cache: each exemption has a reason, and none exempts the storage property."""
    for name, (_, na) in REGISTRY.items():
        assert "storage" not in na and "bytes written" not in na, name
        assert all(isinstance(why, str) and len(why) > 10 for why in na.values()), name


def public_cache_classes() -> set[str]:
    """The names of kvlib's public, concrete `Cache` classes, found by walking every module."""
    classes = set()
    for info in pkgutil.walk_packages(kvlib.__path__, "kvlib."):
        if info.name == "kvlib.__main__":
            continue
        module = __import__(info.name, fromlist=["_"])
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Cache) and not inspect.isabstract(obj) and obj.__module__ == module.__name__:
                if not obj.__name__.startswith("_"):
                    classes.add(obj.__name__)
    return classes


def test_the_registry_lists_every_cache():
    classes = public_cache_classes()
    listed = {name.split("(")[0] for name in REGISTRY} | {"PagedBatch", "PackedPagedBatch", "PackedBatch"}
    assert classes == listed, f"not in the registry: {sorted(classes - listed)}; gone: {sorted(listed - classes)}"
