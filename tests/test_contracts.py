"""The numbers a learner measures with, and the state no public call may corrupt (kvlib 0.3).

Each test here failed on kvlib 0.2: a prefill kept the model's activations alive under a cache,
quantized caches reported 0 bytes written, a paged step could be committed twice or half-way,
speculative decoding leaked paged blocks, a reused Hugging Face cache could return old keys,
and the latent cache's spec was a bare tuple that stopped checking dtypes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvlib
from kvlib import DynamicCache, PRESETS, Transformer
from kvlib.check import storage_bytes
from kvlib.mla import LatentCache
from kvlib.packed import PackedBatch, pack
from kvlib.paged import PagedCache
from kvlib.quant import CastCache, FP8Cache, QuantizedCache
from kvlib.speculative import PromptLookupDraft, speculative_generate

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def tiny(device):
    model = Transformer(PRESETS["tiny"], device=device)
    model.reset_parameters(seed=0)
    return model.eval()


def prompt(n: int, seed: int = 0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved
    return torch.randint(0, PRESETS["tiny"].vocab_size, (1, n), generator=g).to(device)


# -- a prefill keeps no activation alive -------------------------------------------------------------
CACHES = {
    "dynamic": lambda n: DynamicCache(n),
    "quantized (all in the window)": lambda n: QuantizedCache(n, 4, residual=64),
    "quantized (flushed)": lambda n: QuantizedCache(n, 4, residual=8, block=16),
    "cast to the same dtype": lambda n: CastCache(n, torch.float32),
    "fp8": lambda n: FP8Cache(n),
}


@pytest.mark.parametrize("name", CACHES)
@torch.inference_mode()
def test_after_a_prefill_the_storage_held_is_nbytes(tiny, name, device):
    """0.2: the tiny model's 50-token prefill left 89,600 bytes held against an nbytes of 25,600."""
    cache = CACHES[name](tiny.config.n_layer)
    tiny(prompt(50, device=device), cache)
    assert storage_bytes(cache) == cache.nbytes
    tiny(prompt(1, seed=1, device=device), cache)  # and after a decode step
    assert storage_bytes(cache) == cache.nbytes


def test_storage_bytes_sees_a_kept_view(device):
    """The measure itself: a cache holding a view is charged for the storage under it."""
    big = torch.randn(1, 2, 5, 12, device=device)
    cache = DynamicCache(1)
    cache.keys[0], cache.values[0] = big[..., :4], big[..., 4:8]  # what 0.2's first update kept
    assert storage_bytes(cache) == big.nbytes == 3 * cache.nbytes // 2  # the unused q part too


# -- bytes_written is what a step wrote ---------------------------------------------------------------
@torch.inference_mode()
def test_a_prefill_writes_what_a_quantized_cache_stores(tiny, device):
    """0.2: QuantizedCache, FP8Cache and HFQuantizedCache all reported bytes_written = 0 after a prefill."""
    n = tiny.config.n_layer
    for cache in (QuantizedCache(n, 4, residual=64), FP8Cache(n)):
        tiny(prompt(50, device=device), cache)
        assert cache.bytes_written == cache.nbytes > 0  # every stored byte is new: written once
    flushed = QuantizedCache(n, 4, residual=8, block=16)
    tiny(prompt(50, device=device), flushed)
    # the window's copy of the prefill, the quantized blocks, and the window compacted after the flush
    row = 2 * tiny.config.n_kv_head * tiny.config.head_dim * 4  # K and V of one token, one layer, fp32
    assert flushed.bytes_written == n * 50 * row + flushed.nbytes


def test_hf_quantized_cache_counts_its_writes(device):
    hf = pytest.importorskip("transformers")
    from kvlib.hf import HFQuantizedCache

    try:
        cache = HFQuantizedCache(2)
    except ValueError:
        pytest.skip(f"transformers {hf.__version__} has no fp8 QuantizedCache (tests/test_hf.py checks the error)")
    k = torch.randn(1, 2, 5, 8, device=device)
    for layer in range(2):
        cache.update(k, k, layer)
    assert cache.bytes_written == cache.nbytes > 0
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # a decode step: HF re-concatenates the fp8 codes
    assert cache.bytes_written == cache.nbytes + 2 * 2 * 5 * 8  # layer 0's old codes, copied once more


def test_a_packed_batch_counts_the_whole_re_concatenation(device):
    """0.2 counted only the new tokens, though every step re-concatenates every sequence."""
    H, D = 2, 4
    batch = PackedBatch(1, [3, 2])
    ids, _ = pack([[1, 2, 3], [4, 5]])
    k = torch.randn(1, H, 5, D, device=device)
    batch.positions(ids[None])
    batch.update(k, k, 0)
    assert batch.bytes_written == 2 * k.nbytes == batch.nbytes  # the prefill: one copy of each
    step = torch.randn(1, H, 2, D, device=device)
    batch.positions(torch.zeros(1, 2, dtype=torch.long, device=device))
    batch.update(step, step, 0)
    assert batch.bytes_written == 2 * k.nbytes + batch.nbytes  # the decode step rewrote all 7 tokens


# -- a paged step is committed once, whole -------------------------------------------------------------
def pool_state(cache: PagedCache):
    return ([t.clone() for t in cache.keys + cache.values], {s: (cache.block_table(s), cache.tokens(s))
            for s in cache.seqs}, list(cache.allocator.refcount), cache.allocator.num_free, cache.version)


def same_state(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def test_no_public_method_commits_a_paged_step():
    """0.2's PagedCache.commit_step was public, checked nothing, and doubled a sequence when called twice."""
    public = [n for n in dir(PagedCache) if not n.startswith("_")]
    assert not [n for n in public if "commit" in n or "drop" in n], public


@torch.inference_mode()
def test_a_second_commit_raises_and_changes_nothing(tiny, device):
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    sid, _ = cache.add()
    tokens = torch.tensor([[1, 2, 3]], device=device)
    batch = cache.step([sid], tokens)
    tiny(tokens, batch)
    batch.commit()
    before = pool_state(cache)
    with pytest.raises(ValueError, match="already committed"):
        batch.commit()
    assert same_state(pool_state(cache), before) and cache.num_tokens(sid) == 3


@torch.inference_mode()
def test_committing_a_step_that_did_not_run_every_layer_raises_and_changes_nothing(tiny):
    """0.2: commit_step on an unrun batch took a block from the free list, then failed with a TypeError."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    sid, _ = cache.add()
    batch = cache.step([sid], [[1, 2, 3]])
    before = pool_state(cache)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] were never written"):
        batch.commit()
    assert same_state(pool_state(cache), before) and cache.num_tokens(sid) == 0


@torch.inference_mode()
def test_speculative_decoding_gives_back_every_paged_block(tiny, device):
    """0.2 never freed its sequence: each call leaked blocks (64 free became 59)."""
    cache = PagedCache.for_model(tiny, num_blocks=64, block_size=4, prefix_caching=False)
    free = cache.allocator.num_free
    ids = prompt(12, device=device)[0].tolist()
    out, _ = speculative_generate(tiny, ids, 8, PromptLookupDraft(), cache=cache)
    assert cache.allocator.num_free == free and len(cache) == 0
    assert torch.equal(out, kvlib.generate(tiny, ids, 8))
    with pytest.raises(ValueError):  # freed on an error too
        speculative_generate(tiny, ids, 8, Bad(), cache=cache)
    assert cache.allocator.num_free == free and len(cache) == 0


class Bad:
    def propose(self, context_ids, k):
        return [10**9]  # outside the vocabulary: the call raises mid-way


# -- the latent cache's spec --------------------------------------------------------------------------
def test_the_latent_cache_has_a_real_spec_and_keeps_checking_it(device):
    """0.2: spec was a tuple, and a float64 update into a float32 cache went through."""
    cache = LatentCache(2)
    cache.update(torch.randn(1, 1, 3, 8, device=device), torch.randn(1, 1, 3, 4, device=device), 0)
    assert cache.spec == kvlib.CacheSpec(1, 1, 8, torch.float32, torch.device("cpu"), value_dim=4)
    with pytest.raises(TypeError, match="float64"):
        cache.update(torch.randn(1, 1, 1, 8, dtype=torch.float64, device=device), torch.randn(1, 1, 1, 4, dtype=torch.float64, device=device), 1)
    with pytest.raises(TypeError, match="meta"):
        cache.update(torch.randn(1, 1, 1, 8, device="meta"), torch.randn(1, 1, 1, 4, device="meta"), 1)
    with pytest.raises(ValueError, match="value width=4"):
        cache.update(torch.randn(1, 1, 1, 8, device=device), torch.randn(1, 1, 1, 5, device=device), 1)


def test_spec_is_re_derived_after_reset_and_fixed_where_allocated(device):
    cache = DynamicCache(1)
    cache.update(torch.randn(2, 1, 3, 4, device=device), torch.randn(2, 1, 3, 4, device=device), 0)
    assert cache.spec.batch == 2
    cache.reset()
    assert cache.spec is None  # an empty cache has no shape yet
    cache.update(torch.randn(5, 1, 1, 4, device=device), torch.randn(5, 1, 1, 4, device=device), 0)
    assert cache.spec.batch == 5
    static = kvlib.StaticCache(1, 2, 1, 8, 4)
    static.reset()
    assert static.spec.batch == 2  # preallocated: fixed
    with pytest.raises(ValueError, match="batch=2"):
        static.update(torch.randn(5, 1, 1, 4, device=device), torch.randn(5, 1, 1, 4, device=device), 0)
    with pytest.raises(AttributeError):
        cache.spec = None  # read-only: no public way to unfix it


# -- a light first import --------------------------------------------------------------------------
def test_import_kvlib_loads_no_simulator_profiler_plotting_or_hugging_face():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import kvlib\n"
        "new = set(sys.modules) - before\n"
        "heavy = sorted(m for m in new if m.split('.')[0] in ('matplotlib', 'transformers', 'ipywidgets')\n"
        "               or 'profiler' in m or m in ('kvlib.simulate', 'kvlib.hardware', 'kvlib.timing'))\n"
        "print(heavy, sorted(m for m in new if m.startswith('kvlib')))\n"
        "assert kvlib.memory.__name__ == 'kvlib.memory' and kvlib.PagedCache.__name__ == 'PagedCache'\n"
        "assert callable(kvlib.generate) and callable(kvlib.attention)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    heavy, loaded = out.split("] [")
    assert heavy == "[", f"import kvlib loaded {heavy}]"
    assert "kvlib.simulate" not in loaded and "kvlib.paged" not in loaded
