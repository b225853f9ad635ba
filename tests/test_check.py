"""kvlib.check passes kvlib's caches and catches broken ones, each with a clear message."""

import pytest
import torch

from kvlib import DynamicCache, StaticCache
from kvlib.check import PROPERTIES, CacheCheckError, check_cache

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

GOOD = {
    "dynamic": lambda n_layer, b, h, d, dtype: DynamicCache(n_layer),
    "static": lambda n_layer, b, h, d, dtype: StaticCache(n_layer, b, h, 64, d, dtype=dtype),
    "static-grow": lambda n_layer, b, h, d, dtype: StaticCache(n_layer, b, h, 1, d, dtype=dtype, grow=True),
}
FIXED_BATCH = {"reset new batch": "preallocated for one batch"}


@pytest.mark.parametrize("name", GOOD)
@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
def test_kvlib_caches_pass_every_property(name, prop):
    if name.startswith("static") and prop.__name__ == "check_reset_new_batch":
        with pytest.raises(CacheCheckError, match="batch"):  # its spec is fixed: it says so, by raising
            prop(GOOD[name])
        return
    prop(GOOD[name])


class ForgetsOldTokens(DynamicCache):
    """Keeps only the newest chunk: the classic 'k, v = k_new, v_new' bug."""

    def update(self, k, v, layer):
        self.validate_update(k, v, layer)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class SharedLayers(DynamicCache):
    """Stores every layer in one slot (forgot to index by layer)."""

    def update(self, k, v, layer):
        return super().update(k, v, 0) if layer == 0 else super().update(k, v, 0)

    def get_seq_length(self, layer=0):
        return super().get_seq_length(0)

    def layer_kv(self, layer):
        return super().layer_kv(0)


class CropIgnored(StaticCache):
    def crop(self, n):
        pass


class NoChecks(StaticCache):
    """Writes whatever it is given, like seed 003's cache with a larger buffer batch."""

    def validate_update(self, k, v, layer):
        pass

    def update(self, k, v, layer):
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        self.keys[layer][: k.shape[0], :, start:end] = k
        self.values[layer][: k.shape[0], :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class WrongNbytes(DynamicCache):
    @property
    def nbytes(self):
        return 0


class KeepsViews(DynamicCache):
    """kvlib 0.2's DynamicCache: the first update stores the caller's views of its activation."""

    def update(self, k, v, layer):
        if self.keys[layer] is None:
            self.validate_update(k, v, layer)
            self.keys[layer], self.values[layer] = k, v
            self.count_written(k, v)
            return k, v
        return super().update(k, v, layer)


class WritesUncounted(StaticCache):
    """Writes in place and reports nothing, as 0.2's quantized caches did."""

    def count_written(self, *tensors):
        pass


class ResetKeepsOldShape(DynamicCache):
    """A reset that leaves the last batch's shape behind, as a hand-kept spec would."""

    def reset(self):
        old = self.spec
        super().reset()
        self._stale = old

    def validate_update(self, k, v, layer_idx):
        stale = getattr(self, "_stale", None)
        if stale is not None and k.shape[0] != stale.batch:
            raise ValueError(f"holds batch={stale.batch}")
        super().validate_update(k, v, layer_idx)


BROKEN = {
    "forgets old tokens": (lambda n, b, h, d, dt: ForgetsOldTokens(n), "update returns everything so far"),
    "layers share storage": (lambda n, b, h, d, dt: SharedLayers(n), "update returns everything so far"),
    "crop ignored": (lambda n, b, h, d, dt: CropIgnored(n, b, h, 64, d, dtype=dt), "crop keeps a prefix"),
    "accepts a wrong batch": (lambda n, b, h, d, dt: NoChecks(n, b + 1, h, 64, d, dtype=dt), "update returns everything so far"),
    "nbytes is zero": (lambda n, b, h, d, dt: WrongNbytes(n), "nbytes counts storage"),
    "keeps a view of the activation": (lambda n, b, h, d, dt: KeepsViews(n), "storage equals nbytes"),
    "bytes written not counted": (lambda n, b, h, d, dt: WritesUncounted(n, b, h, 64, d, dtype=dt),
                                  "bytes written counts writes"),
    "reset keeps the old batch": (lambda n, b, h, d, dt: ResetKeepsOldShape(n), "reset then a new batch size"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_caches_fail_with_a_named_property(name):
    make, prop = BROKEN[name]
    na = FIXED_BATCH if name in ("crop ignored", "accepts a wrong batch", "bytes written not counted") else None
    if name == "nbytes is zero":  # the crop property compares storage with nbytes too, and would fail first
        na = {"crop and reset": "this broken cache is here to fail the nbytes property itself"}
    with pytest.raises(CacheCheckError, match=r"^\[" + prop):
        check_cache(make, not_applicable=na)


def test_check_cache_returns_every_property_and_prints_one_line(capsys):
    passed = check_cache(GOOD["dynamic"], verbose=True)
    assert passed == ["update", "tokens seen", "layers independent", "crop and reset", "nbytes", "storage",
                      "bytes written", "reset new batch", "legacy", "rejects bad updates", "generation"]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"ok  DynamicCache: all 11 properties hold ({', '.join(passed)})"]
    assert check_cache(GOOD["static-grow"], not_applicable=FIXED_BATCH) == [p for p in passed if p != "reset new batch"]
    assert capsys.readouterr().out == ""  # quiet by default


def test_a_failing_cache_prints_no_ok_line(capsys):
    make, _ = BROKEN["crop ignored"]  # passes the first two properties, then fails
    with pytest.raises(CacheCheckError):
        check_cache(make, verbose=True)
    assert "ok" not in capsys.readouterr().out


def test_check_cache_needs_a_factory():
    with pytest.raises(TypeError, match="factory function"):
        check_cache(DynamicCache(2))


def test_bytes_written_tells_the_three_policies_apart():
    """torch.cat rewrites the whole cache each step; in-place writes only the new token; doubling adds O(N)."""
    n, row = 64, 2 * 1 * 2 * 4 * 4  # K+V bytes of one token: 2 tensors * B * H * D * 4 bytes
    caches = {"cat": DynamicCache(1), "prealloc": StaticCache(1, 1, 2, n, 4), "doubling": StaticCache(1, 1, 2, 1, 4, grow=True)}
    for t in range(n):
        k = torch.randn(1, 2, 1, 4)
        for c in caches.values():
            c.update(k, k, 0)
    assert caches["cat"].bytes_written == row * n * (n + 1) // 2  # 1 + 2 + ... + n tokens copied
    assert caches["prealloc"].bytes_written == row * n
    assert row * n < caches["doubling"].bytes_written < 2 * row * n  # new tokens + (1 + 2 + 4 + ... + n/2)
