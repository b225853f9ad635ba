"""A cache's two lengths (issue 45): tokens seen (the text so far, the next position) and tokens held.

Each test here reproduces a result that kvlib 0.4 got silently wrong, or a contract it broke, because
some caller read "held" where it meant "seen". They use only names kvlib 0.4 had too (where they
can), so each one ran, and failed, against 0.4: the failures are quoted in CHANGELOG 0.5.0's note.
"""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib import DynamicCache
from kvlib.chat import ChatSession
from kvlib.check import CacheCheckError, check_cache, storage_bytes
from kvlib.evict import H2OCache, SinkCache, WindowCache
from kvlib.hybrid import HybridCache
from kvlib.layers import full, window
from kvlib.mla import LatentCache
from kvlib.press import PressCache, SnapKVPress
from kvlib.quant import CastCache, FP8Cache, QuantizedCache
from kvlib.speculative import PromptLookupDraft, speculative_generate

pytestmark = pytest.mark.device


@pytest.fixture
def tiny(device):
    model = kvlib.Transformer(kvlib.PRESETS["tiny"], device=device)
    model.reset_parameters(seed=0, std=0.2)  # sharp logits: no near ties
    return model


def newest_position(cache) -> int:
    """One past the newest position a cache holds in layer 0 (what it has seen, read from storage)."""
    return int(cache.kept_positions(0).max()) + 1


def window_first(max_seq_len: int = 256, device="cpu"):
    config = kvlib.PRESETS["tiny"].replace(layers=(window(8), full()), max_seq_len=max_seq_len)
    model = kvlib.Transformer(config, device=device)
    model.reset_parameters(seed=0, std=0.2)
    return model


@pytest.mark.parametrize("kind", ["window", "hybrid window-first"])
def test_a_chat_feeds_each_token_once_whatever_the_cache_holds(tiny, kind, device):
    model = tiny if kind == "window" else window_first(device=device)
    cache = (WindowCache(model.config.n_layer, 8) if kind == "window"
             else HybridCache.for_model(model.config))
    chat = ChatSession(model, cache=cache)
    chat.say(list(range(1, 7)), 6)  # 6 + 6 tokens: the 8-token window has evicted
    chat.say([11, 12, 13], 3)
    assert chat.turns[1].prefilled == 3 + 1  # the new turn and the last reply token, nothing else
    assert chat.turns[1].reused == 11
    assert newest_position(cache) == len(chat.history) - 1  # every token but the last reply's
    # and the reply is what a fresh cache of the same kind, fed the same steps, gives
    fresh = (WindowCache(model.config.n_layer, 8) if kind == "window"
             else HybridCache.for_model(model.config))
    want = ChatSession(model, cache=fresh)
    want.say(list(range(1, 7)), 6)
    assert want.say([11, 12, 13], 3) == chat.turns[1].reply


@pytest.mark.parametrize("make", [lambda n: WindowCache(n, 8), lambda n: SinkCache(n, 2, 8, 10000.0)])
def test_speculative_decoding_refuses_a_cache_that_evicts(tiny, make):
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="evicts"):
        speculative_generate(tiny, prompt, 36, PromptLookupDraft(), cache=make(tiny.config.n_layer))


def test_a_window_first_hybrid_model_keeps_to_max_seq_len(device):
    model = window_first(max_seq_len=32, device=device)
    with pytest.raises(ValueError, match="max_seq_len"):
        kvlib.generate(model, list(range(1, 11)), 30, cache=HybridCache.for_model(model.config))
    cache = HybridCache.for_model(model.config)
    model(torch.arange(1, 31, device=device)[None], cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.tensor([[1, 2, 3]], device=device), cache)  # positions 30..32: past the last one, 31


def test_crop_takes_a_length_of_text_and_refuses_what_is_evicted(tiny, device):
    cache = WindowCache(tiny.config.n_layer, 8)
    kvlib.generate(tiny, [1, 2, 3], 14, cache=cache)  # 16 tokens fed (the last one sampled, not fed)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(5)  # positions 0..4 are gone: 0.4 kept the 5 oldest held slots, positions 8..12
    cache.crop(15)
    assert newest_position(cache) == 15 and cache.tokens_seen == 15
    assert int(cache.positions(torch.tensor([[1]], device=device))[0, 0]) == 15
    sink = SinkCache(tiny.config.n_layer, 2, 6, tiny.config.rope_base)
    kvlib.generate(tiny, [1, 2, 3], 14, cache=sink)
    with pytest.raises(ValueError, match="evicted"):
        sink.crop(5)
    sink.crop(15)
    # the two sinks, and the window's tokens before 15 (it held 10..15: 16 fed, a window of 6)
    assert sink.kept_positions(0)[0, 0].tolist() == [0, 1, 10, 11, 12, 13, 14]


def test_h2o_and_press_caches_refuse_a_crop_they_cannot_undo(tiny, device):
    h2o = H2OCache(tiny.config.n_layer, heavy=4, recent=4)
    tiny.set_attention_impl(h2o.attention)
    try:
        kvlib.generate(tiny, [1, 2, 3], 4, cache=h2o)
    finally:
        tiny.set_attention_impl("sdpa")
    with pytest.raises(ValueError, match="scores"):
        h2o.crop(3)
    h2o.crop(0)
    assert h2o.tokens_seen == 0
    cache, logits = kvlib.press.prefill(tiny, torch.arange(1, 21, device=device)[None], SnapKVPress(window_size=4), 0.5)
    kvlib.decode_step(tiny, logits.argmax(-1), cache)
    with pytest.raises(ValueError, match="compressed"):
        cache.crop(12)
    cache.crop(20)  # the decoded token goes, the compressed prompt stays
    assert cache.tokens_seen == 20 and cache.tokens_held == 10


CROPPED = {
    "DynamicCache": lambda: DynamicCache(1),
    "CastCache": lambda: CastCache(1, torch.float16),
    "FP8Cache": lambda: FP8Cache(1),
    "SinkCache": lambda: SinkCache(1, 2, 30, 10000.0),
    "HybridCache": lambda: HybridCache([full()]),
    "LatentCache": lambda: LatentCache(1),
}


@pytest.mark.parametrize("name", CROPPED)
def test_crop_keeps_no_view_alive(name, device):
    cache = CROPPED[name]()
    k = torch.randn(1, 2, 10, 8, device=device)
    cache.update(k, k.clone(), 0)
    cache.crop(2)
    assert storage_bytes(cache) == cache.nbytes  # 0.4: DynamicCache reported 128 bytes, 640 stayed alive


EMPTIED = CROPPED | {
    "WindowCache": lambda: WindowCache(1, 16),
    "QuantizedCache": lambda: QuantizedCache(1, 4, residual=2, block=2),
    "PressCache": lambda: PressCache(1, "snapkv", 0.0),
}


@pytest.mark.parametrize("name", EMPTIED)
def test_crop_to_zero_takes_a_new_batch_size(name, device):
    cache = EMPTIED[name]()
    k = torch.randn(2, 2, 5, 8, device=device)
    cache.update(k, k.clone(), 0)
    cache.crop(0)
    k3 = torch.randn(3, 2, 4, 8, device=device)
    keys, _ = cache.update(k3, k3.clone(), 0)  # 0.4: RuntimeError (a stale buffer) in seven caches
    assert keys.shape[0] == 3 and cache.get_seq_length(0) == 4


def test_check_cache_catches_a_cache_that_reports_held_as_seen():
    class HeldAsSeen(WindowCache):
        @property
        def tokens_seen(self) -> int:
            return self.tokens_held

    evicts = {p: "it evicts" for p in ("update", "crop and reset", "nbytes", "legacy", "generation")}
    with pytest.raises(CacheCheckError, match=r"^\[tokens seen\] tokens_seen is 3 after 4 tokens"):
        check_cache(lambda n, b, h, d, dt: HeldAsSeen(n, 3), not_applicable=evicts)
    assert "tokens seen" in check_cache(lambda n, b, h, d, dt: WindowCache(n, 3), not_applicable=evicts)


def test_misuse_gets_an_error_that_says_what_to_do(tiny):
    paged = kvlib.PagedCache.for_model(tiny, num_blocks=8, block_size=4)
    with pytest.raises(TypeError, match=r"PagedCache.*Engine.*step"):
        kvlib.generate(tiny, [1, 2, 3], 4, cache=paged)

    class MyPool(kvlib.PagedCache):  # a pool of one's own is still a pool, whatever its name
        pass

    with pytest.raises(TypeError, match=r"PagedCache.*Engine.*step"):
        kvlib.stream(tiny, [1, 2, 3], 4, cache=MyPool.for_model(tiny, num_blocks=8, block_size=4)).__next__()
    with pytest.raises(TypeError, match="must be a kvlib Cache"):
        kvlib.generate(tiny, [1, 2, 3], 4, cache="x")
    with pytest.raises(TypeError, match=r"torch.tensor\(\[42\]\)"):
        kvlib.decode_step(tiny, 42, DynamicCache(tiny.config.n_layer))
    with pytest.raises(TypeError, match=r"factory function make\(n_layer, batch, n_kv_head, head_dim, dtype\)"):
        check_cache(DynamicCache)
