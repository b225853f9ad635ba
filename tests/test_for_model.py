"""One way to build a cache (issue 45): ``X.for_model(model_or_config, *settings)`` on every cache.

Each cache built for a model must be the cache a learner would build by hand for it: the model's
layers (and RoPE base, where the cache re-rotates keys), its dtype and device where the cache
allocates up front. Checked by running both on the same tokens: the logits must be identical
(the same class, the same settings and the same operations, so not one bit may differ). Before
0.5.0, 10 of these 13 classes had no ``for_model`` (AttributeError) and StaticCache's and
HybridCache's took a config only (``model.config`` of a Transformer: AttributeError).
"""

import pytest
import torch

import kvlib
from kvlib import evict, fp8, hybrid, mla, packed, press, quant
from kvlib.layers import full, window
from kvlib.paged import PagedCache

pytestmark = pytest.mark.device

CFG = kvlib.PRESETS["tiny"].replace(rope_base=500000.0)  # not the default 10000: for_model must read it
L = CFG.n_layer
TOKENS = torch.arange(3, 27)[None]  # 24 tokens: past every window and budget below

# (class, its settings after n_layer, the same cache built by hand)
CASES = {
    "dynamic": (kvlib.DynamicCache, (), lambda: kvlib.DynamicCache(L)),
    "static": (kvlib.StaticCache, (1, 32), lambda: kvlib.StaticCache(L, 1, CFG.n_kv_head, 32, CFG.head_dim)),
    "window": (evict.WindowCache, (8,), lambda: evict.WindowCache(L, 8)),
    "sink": (evict.SinkCache, (2, 8), lambda: evict.SinkCache(L, 2, 8, 500000.0)),
    "h2o": (evict.H2OCache, (4, 8), lambda: evict.H2OCache(L, 4, 8)),
    "press": (press.PressCache, ("expected_attention", 0.5),
              lambda: press.PressCache(L, "expected_attention", 0.5, rope_base=500000.0)),
    "cast": (quant.CastCache, (torch.float16,), lambda: quant.CastCache(L, torch.float16)),
    "quantized": (quant.QuantizedCache, (2,), lambda: quant.QuantizedCache(L, 2)),
    "fp8": (fp8.FP8Cache, (), lambda: fp8.FP8Cache(L)),
    "hybrid": (hybrid.HybridCache, (), lambda: hybrid.HybridCache(CFG.layer_kinds())),
    "recompute": (hybrid.Recompute, (), lambda: hybrid.Recompute(CFG.layer_kinds())),
    "packed": (packed.PackedBatch, ([24],), lambda: packed.PackedBatch(L, [24])),
}


def run(model: kvlib.Transformer, cache) -> torch.Tensor:
    """A prefill of ``TOKENS`` (chunked) and three decode steps: the logits of all four, ``(4, vocab)``."""
    if hasattr(cache, "attention"):  # H2O and the presses score tokens in an attention of their own
        model.set_attention_impl(cache.attention)
    if isinstance(cache, packed.PackedBatch):  # a packed batch is one prefill of its prompts
        return model(TOKENS.to(model.device), cache)[0, -1:]
    for chunk in TOKENS.to(model.device).split(8, dim=1):  # in chunks no longer than the evicting caches' recent part
        logits = model(chunk, cache)
    out = [logits[0, -1]]
    for t in (5, 6, 7):
        out.append(model(torch.tensor([[t]], device=model.device), cache)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("source", ["model", "config"])
def test_for_model_builds_the_cache_you_would_build_by_hand(name, source, device):
    torch.manual_seed(0)
    model = kvlib.Transformer(CFG, device=device).eval()
    cls, settings, by_hand = CASES[name]
    cache = cls.for_model(model if source == "model" else CFG, *settings)
    assert type(cache) is cls and cache.n_layer == L
    with torch.no_grad():
        assert torch.equal(run(model, cache), run(model, by_hand()))


def test_a_cache_that_rerotates_keys_takes_the_models_rope_base_unless_told(device):
    assert evict.SinkCache.for_model(CFG, 2, 8).rope_base == 500000.0
    assert press.PressCache.for_model(CFG, "snapkv", 0.5).rope_base == 500000.0
    assert evict.SinkCache.for_model(CFG, 2, 8, rope_base=1000.0).rope_base == 1000.0
    assert evict.SinkCache.for_model(CFG, 2, 8, 1000.0).rope_base == 1000.0  # given by position


def test_a_cache_that_allocates_up_front_takes_the_models_dtype_and_device(device):
    model = kvlib.Transformer(CFG, device=device).to(torch.bfloat16)
    assert kvlib.StaticCache.for_model(model, 1, 16).spec.dtype == torch.bfloat16
    assert PagedCache.for_model(model, 8, 4).dtype == torch.bfloat16
    assert kvlib.StaticCache.for_model(CFG, 1, 16, device=device).spec.dtype == torch.float32  # a config: fp32, as a new model
    assert kvlib.StaticCache.for_model(model, 1, 16, dtype=torch.float16).spec.dtype == torch.float16
    assert kvlib.StaticCache.for_model(model, 1, 16).keys[0].device == model.device


def test_a_cache_that_allocates_at_its_first_update_takes_the_dtype_the_model_writes(device):
    model = kvlib.Transformer(CFG, device=device).to(torch.bfloat16)
    cache = kvlib.DynamicCache.for_model(model)
    model(TOKENS.to(device), cache)
    assert cache.keys[0].dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"DynamicCache.for_model takes no dtype.*first update.*CastCache"):
        kvlib.DynamicCache.for_model(model, dtype=torch.float16)
    with pytest.raises(TypeError, match="WindowCache.for_model takes no device"):
        evict.WindowCache.for_model(model, 8, device="cpu")


def test_a_hybrid_model_gets_a_hybrid_cache_and_a_clear_error_otherwise(device):
    config = kvlib.PRESETS["tiny"].replace(layers=(window(8), full()))
    model = kvlib.Transformer(config, device=device)
    assert hybrid.HybridCache.for_model(model).layers == config.layer_kinds()
    for make in (lambda: kvlib.DynamicCache.for_model(model), lambda: kvlib.StaticCache.for_model(model, 1, 8),
                 lambda: evict.WindowCache.for_model(config, 8)):
        with pytest.raises(ValueError, match=r"layers differ \(.*\): use kvlib.hybrid.HybridCache.for_model"):
            make()


def test_the_latent_cache_is_built_for_an_mla_layer_or_its_config(device):
    cfg = mla.MLAConfig(d_model=64, n_head=4, d_c=16, d_nope=8, d_rope=8, d_v=8, n_layer=3)
    assert mla.LatentCache.for_model(cfg).n_layer == 3
    assert mla.LatentCache.for_model(mla.MLAAttention(cfg)).n_layer == 3
    with pytest.raises(TypeError, match="takes an MLAAttention or an MLAConfig, got ModelConfig"):
        mla.LatentCache.for_model(CFG)


@pytest.mark.parametrize("bad", ["tiny", 2, None])
def test_for_model_names_what_it_takes(bad):
    with pytest.raises(TypeError, match="takes a kvlib.Transformer or a kvlib.ModelConfig"):
        kvlib.DynamicCache.for_model(bad)


def test_wrappers_say_what_to_build_instead(device):
    with pytest.raises(TypeError, match=r"PaddedBatch\(kvlib.DynamicCache.for_model\(model\), valid\)"):
        kvlib.PaddedBatch.for_model(CFG, torch.ones(1, 4, dtype=torch.bool, device=device))
    for step in (kvlib.paged.PagedBatch, kvlib.paged.PackedPagedBatch):
        with pytest.raises(TypeError, match=r"opened by PagedCache.step: .*PagedCache.for_model\(model, num_blocks\)"):
            step.for_model(CFG)


def test_hugging_faces_quantized_cache_too(device):
    pytest.importorskip("transformers", minversion="5.21")
    from kvlib.hf import HFQuantizedCache

    assert HFQuantizedCache.for_model(kvlib.Transformer(CFG, device=device)).n_layer == L


def test_every_cache_class_is_built_here_or_says_what_to_build():
    """Every public `Cache` class of kvlib (and `PagedCache`, which is not one) is in `CASES`, or
    has a test of its own above: a new cache cannot be left without a working ``for_model``."""
    from test_conformance import public_cache_classes

    found = public_cache_classes()
    tested_above = {"LatentCache", "PaddedBatch", "PagedBatch", "PackedPagedBatch", "HFQuantizedCache"}
    listed = {cls.__name__ for cls, _, _ in CASES.values()} | tested_above
    assert found == listed, f"no for_model test: {sorted(found - listed)}; gone: {sorted(listed - found)}"
