"""kvlib.check passes kvlib's caches and catches broken ones, each with a clear message."""

import pytest
import torch

from kvlib import DynamicCache, StaticCache
from kvlib.check import PROPERTIES, CacheCheckError, check_cache

GOOD = {
    "dynamic": lambda n_layer, b, h, d, dtype: DynamicCache(n_layer),
    "static": lambda n_layer, b, h, d, dtype: StaticCache(n_layer, b, h, 64, d, dtype=dtype),
    "static-grow": lambda n_layer, b, h, d, dtype: StaticCache(n_layer, b, h, 1, d, dtype=dtype, grow=True),
}


@pytest.mark.parametrize("name", GOOD)
@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
def test_kvlib_caches_pass_every_property(name, prop):
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


BROKEN = {
    "forgets old tokens": (lambda n, b, h, d, dt: ForgetsOldTokens(n), "update returns everything so far"),
    "layers share storage": (lambda n, b, h, d, dt: SharedLayers(n), "update returns everything so far"),
    "crop ignored": (lambda n, b, h, d, dt: CropIgnored(n, b, h, 64, d, dtype=dt), "crop keeps a prefix"),
    "accepts a wrong batch": (lambda n, b, h, d, dt: NoChecks(n, b + 1, h, 64, d, dtype=dt), "update returns everything so far"),
    "nbytes is zero": (lambda n, b, h, d, dt: WrongNbytes(n), "nbytes counts storage"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_caches_fail_with_a_named_property(name):
    make, prop = BROKEN[name]
    with pytest.raises(CacheCheckError, match=r"^\[" + prop):
        check_cache(make)


def test_check_cache_returns_every_property_and_prints_one_line(capsys):
    passed = check_cache(GOOD["static-grow"], verbose=True)
    assert passed == ["update", "layers independent", "crop and reset", "nbytes", "legacy",
                      "rejects bad updates", "generation"]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"ok  StaticCache: all 7 properties hold ({', '.join(passed)})"]
    assert check_cache(GOOD["dynamic"]) == passed and capsys.readouterr().out == ""  # quiet by default


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
