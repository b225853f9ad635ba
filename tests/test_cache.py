import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib import DynamicCache, StaticCache

pytestmark = pytest.mark.device

L, B, H, D = 3, 2, 2, 4


def kv(T, seed=0, b=B, h=H, d=D, dtype=torch.float32, device="cpu"):
    """Drawn on the CPU (a CPU generator), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, T, d, generator=g), torch.randn(b, h, T, d, generator=g)
    return k.to(device, dtype), v.to(device, dtype)


def fill(cache, chunks, device="cpu"):
    """Push the same chunks into every layer; return the reference full tensors per layer."""
    outs = None
    for step, T in enumerate(chunks):
        for layer in range(cache.n_layer):
            k, v = kv(T, seed=100 * step + layer, device=device)
            outs = cache.update(k, v, layer)
    return outs


def reference(chunks, layer, device="cpu"):
    ks, vs = zip(*[kv(T, seed=100 * step + layer, device=device) for step, T in enumerate(chunks)])
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6), grow=st.booleans())
def test_static_equals_dynamic_equals_concatenation(chunks, grow, device):
    total = sum(chunks)
    dyn = DynamicCache(L)
    sta = StaticCache(L, B, H, 1 if grow else total, D, grow=grow, device=device)
    fill(dyn, chunks, device=device)
    fill(sta, chunks, device=device)
    assert dyn.seq_len == sta.seq_len == total
    for layer in range(L):
        k_ref, v_ref = reference(chunks, layer, device=device)
        for cache in (dyn, sta):
            k, v = cache.layer_kv(layer)
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_update_returns_everything_so_far(device):
    cache = StaticCache(1, B, H, 8, D, device=device)
    k1, v1 = kv(3, seed=1, device=device)
    k2, v2 = kv(1, seed=2, device=device)
    cache.update(k1, v1, 0)
    k_all, v_all = cache.update(k2, v2, 0)
    assert torch.equal(k_all, torch.cat([k1, k2], dim=2)) and torch.equal(v_all, torch.cat([v1, v2], dim=2))


def test_growth_doubles_and_keeps_contents(device):
    cache = StaticCache(L, B, H, 2, D, grow=True, device=device)
    caps = []
    for step in range(9):
        for layer in range(L):
            cache.update(*kv(1, seed=100 * step + layer, device=device), layer)
        caps.append(cache.capacity)
    assert caps == [2, 2, 4, 4, 8, 8, 8, 8, 16]
    for layer in range(L):
        k_ref, v_ref = reference([1] * 9, layer, device=device)
        k, v = cache.layer_kv(layer)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_overflow_without_growth_is_a_clear_error(device):
    cache = StaticCache(1, B, H, 4, D, device=device)
    cache.update(*kv(3, device=device), 0)
    with pytest.raises(IndexError, match=r"3 tokens cached \+ 2 new > max_len=4.*grow=True"):
        cache.update(*kv(2, device=device), 0)


@pytest.mark.parametrize("make", [lambda d: DynamicCache(L), lambda d: StaticCache(L, B, H, 16, D, device=d)])
def test_crop_and_reset(make, device):
    cache = make(device)
    fill(cache, [5, 2], device=device)
    cache.crop(4)
    assert cache.seq_len == 4
    k_ref, _ = reference([5, 2], 1, device=device)
    assert torch.equal(cache.layer_kv(1)[0], k_ref[:, :, :4])
    cache.crop(-1)  # negative: drop from the end, like HF's crop
    assert cache.seq_len == 3
    cache.crop(10)  # keep at most 10: nothing to do
    assert cache.seq_len == 3
    # appending after a crop continues from the cropped length
    k_new, v_new = kv(1, seed=9, device=device)
    k_all, _ = cache.update(k_new, v_new, 0)
    assert torch.equal(k_all, torch.cat([reference([5, 2], 0, device=device)[0][:, :, :3], k_new], dim=2))
    with pytest.raises(IndexError, match="cannot drop 10 tokens"):
        cache.crop(-10)
    cache.reset()
    assert cache.seq_len == 0 and cache.layer_kv(0) is None
    fill(cache, [2], device=device)
    assert cache.seq_len == 2


@pytest.mark.parametrize("cls", [DynamicCache, StaticCache])
def test_legacy_round_trip(cls, device):
    src = DynamicCache(L)
    fill(src, [3, 1], device=device)
    past = src.to_legacy()
    assert isinstance(past, tuple) and len(past) == L and all(len(p) == 2 for p in past)
    rebuilt = cls.from_legacy(past)
    again = rebuilt.to_legacy()
    for (k0, v0), (k1, v1) in zip(past, again):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # and it keeps working as a cache afterwards (a static one needs room)
    rebuilt = cls.from_legacy(past) if cls is DynamicCache else cls.from_legacy(past, max_len=8)
    rebuilt.update(*kv(1, seed=5, device=device), 0)
    assert rebuilt.get_seq_length(0) == 5


def test_empty_cache_has_no_legacy_form(device):
    with pytest.raises(ValueError, match="layer 0 is empty"):
        DynamicCache(2).to_legacy()
    with pytest.raises(TypeError, match="past_key_values"):
        DynamicCache.from_legacy(((torch.zeros(1),),))


@pytest.mark.parametrize("dtype,nbytes_per", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
def test_nbytes_formula(dtype, nbytes_per, device):
    S, max_len = 7, 12
    dyn = DynamicCache(L)
    sta = StaticCache(L, B, H, max_len, D, dtype=dtype, device=device)
    for layer in range(L):
        dyn.update(*kv(S, dtype=dtype, device=device), layer)
        sta.update(*kv(S, dtype=dtype, device=device), layer)
    assert dyn.nbytes == 2 * L * B * H * S * D * nbytes_per  # grows with what is stored
    assert sta.nbytes == 2 * L * B * H * max_len * D * nbytes_per  # the whole reservation


# -- bad input: one test each -----------------------------------------------------------
@pytest.fixture(params=["dynamic", "static"])
def filled(request, device):
    cache = DynamicCache(L) if request.param == "dynamic" else StaticCache(L, B, H, 16, D, device=device)
    cache.update(*kv(2, device=device), 0)
    return cache


def test_mismatched_batch(filled, device):
    with pytest.raises(ValueError, match="batch=2 but update\\(layer=1\\) got batch=3"):
        filled.update(*kv(1, b=3, device=device), 1)


def test_mismatched_heads(filled, device):
    with pytest.raises(ValueError, match="kv_heads=2 but update\\(layer=0\\) got kv_heads=4"):
        filled.update(*kv(1, h=4, device=device), 0)


def test_mismatched_head_dim(filled, device):
    with pytest.raises(ValueError, match="head_dim=4 but update\\(layer=0\\) got head_dim=8"):
        filled.update(*kv(1, d=8, device=device), 0)


def test_mismatched_dtype(filled, device):
    with pytest.raises(TypeError, match="holds torch.float32 but update\\(layer=0\\) got torch.float16"):
        filled.update(*kv(1, dtype=torch.float16, device=device), 0)


def test_mismatched_device(filled, device):
    k, v = kv(1, device=device)
    with pytest.raises(TypeError, match=f"lives on {device} but update\\(layer=0\\) got a tensor on meta"):
        filled.update(k.to("meta"), v.to("meta"), 0)


def test_k_and_v_shapes_must_agree(filled, device):
    k, _ = kv(1, device=device)
    with pytest.raises(ValueError, match="k and v must both be"):
        filled.update(k, torch.randn(B, H, 2, D, device=device), 0)


def test_layer_out_of_range(filled, device):
    with pytest.raises(IndexError, match="layer 3 is out of range for a cache of 3 layers"):
        filled.update(*kv(1, device=device), 3)


def test_bad_static_sizes(device):
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        StaticCache(2, 1, 1, 0, 4, device=device)
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        DynamicCache(0)


# -- kvlib 0.2: an abstract protocol in Hugging Face's order --------------------------------------------
def test_cache_is_abstract_and_names_what_a_subclass_must_write(device):
    class Half(kvlib.Cache):
        def update(self, key_states, value_states, layer_idx):
            return key_states, value_states

    with pytest.raises(TypeError, match="abstract methods .*crop.*get_seq_length.*layer_kv.*nbytes.*reset"):
        Half(2)


def test_the_old_argument_order_fails_with_a_hint(device):
    cache = DynamicCache(2)
    with pytest.raises(TypeError, match=r"layer index goes last: update\(k, v, layer_idx\)"):
        cache.update(0, *kv(1, device=device))
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        cache.update(*kv(1, device=device), 0.0)


def test_hf_names_and_seq_len_agree(device):
    cache = DynamicCache(2)
    cache.update(*kv(3, device=device), layer_idx=0)  # keywords as Hugging Face names them
    cache.update(key_states=kv(3, device=device)[0], value_states=kv(3, device=device)[1], layer_idx=1)
    assert cache.get_seq_length() == cache.seq_len == 3
    assert not hasattr(cache, "get_seq_len")  # kvlib 0.1's alias is gone: one name, Hugging Face's
    assert cache.spec == kvlib.CacheSpec(B, H, D, torch.float32, device)
    assert cache.crop_length(-1) == 2 and cache.crop_length(10) == 3


def test_a_plain_cache_places_a_step_after_its_contents(device):
    cache = DynamicCache(1)
    tokens = torch.zeros(2, 3, dtype=torch.long, device=device)
    assert cache.positions(tokens).tolist() == [[0, 1, 2]] * 2 and cache.mask(tokens) is None
    cache.update(*kv(5, b=2, device=device), 0)
    assert cache.positions(tokens).tolist() == [[5, 6, 7]] * 2
