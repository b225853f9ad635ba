"""kvlib is device-agnostic, proven on the CPU with PyTorch's ``meta`` device.

A ``meta`` tensor has a shape, a dtype and a device but no values: every op runs shape-only,
mixing it with a CPU tensor raises, and so does any read back to the host (``.item()``,
``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``). So a model built on ``meta`` that runs a
prefill and three decode steps through a cache proves two things at once, without a GPU:

* every tensor the cache allocates follows the model's device (a cache that allocated on the
  CPU would raise when attention mixed its tensors with the model's, or be caught below);
* the step makes no host round-trip (a GPU would stall at each one).

The paths with an inherent round-trip (the engine must see sampled tokens; speculative
decoding's accepted count decides what the cache keeps) run on ``meta`` under `host_reads`,
which counts each read and answers it with a fixed value, so the count per step can be
asserted against the number each module's "Host round-trips" docstring section gives.
"""

from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager

import pytest
import torch

import kvlib
from kvlib import DynamicCache, ModelConfig, PaddedBatch, StaticCache, Transformer
from kvlib.evict import H2OCache, SinkCache, WindowCache
from kvlib.fp8 import FP8Cache
from kvlib.generate import decode_step, prefill
from kvlib.hybrid import HybridCache, Recompute
from kvlib.layers import chunked, full, shared, window
from kvlib.mla import LatentCache, MLAAttention, MLAConfig
from kvlib.quant import CastCache, QuantizedCache

pytestmark = pytest.mark.cpu_only("runs on PyTorch's meta device, the CPU's stand-in for a GPU; on a GPU the device tests run there")

META = torch.device("meta")
CFG = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=96)

# Every module whose decode path reads back to the host, and why; each is counted below.
# Any other kvlib module's decode path makes no round-trip (the meta tests).
HOST_ROUND_TRIPS = {
    "kvlib.engine": "the sampled tokens, once per step: the host stops sequences and grows block tables",
    "kvlib.speculative": "each examined guess's p/q and each draw: the accepted count decides what the cache keeps",
    "kvlib.generate": "with stop tokens, 'has every row stopped?' every sync_every steps; stream() yields ints",
    "kvlib.paged.batch": "a step's tokens given as a tensor are read once, for the host's block tables",
}


def meta_model(config: ModelConfig = CFG) -> Transformer:
    model = Transformer(config, device="meta").eval()
    assert model.device == META
    return model


def ids(B: int, T: int) -> torch.Tensor:
    return torch.zeros(B, T, dtype=torch.long, device=META)


def held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor an object holds: its attributes, lists, tuples, dicts and dataclasses (a
    `kvlib.quant.QTensor`'s codes and scales), recursively."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in held_tensors(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in held_tensors(x, seen)]
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__") and type(obj).__module__.startswith("kvlib"):
        return [t for x in vars(obj).values() for t in held_tensors(x, seen)]
    return []


def assert_on_meta(cache, *outputs: torch.Tensor) -> None:
    held = held_tensors(cache)
    assert held, f"{type(cache).__name__} holds no tensor: the check would pass on anything"
    off = {(type(t).__name__, str(t.device), tuple(t.shape)) for t in held if t.device != META}
    assert not off, f"{type(cache).__name__} holds tensors off the model's device: {sorted(off)}"
    for out in outputs:
        assert out.device == META


def decode3(model, cache, logits):
    for _ in range(3):
        logits = decode_step(model, logits.argmax(-1), cache)  # argmax on meta: no read
    return logits


# -- every cache: prefill, then 3 decode steps, all on meta --------------------------------------------
CACHES = {
    "dynamic": lambda m: DynamicCache(CFG.n_layer),
    "static": lambda m: StaticCache.for_model(m, 2, 16),  # the model's device, with nothing passed
    "cast-fp16": lambda m: CastCache(CFG.n_layer),
    "quant-8bit": lambda m: QuantizedCache(CFG.n_layer, 8, residual=2, block=2),  # flushes in prefill and decode
    "quant-4bit": lambda m: QuantizedCache(CFG.n_layer, 4, residual=2, block=2),
    "quant-2bit-sym-token": lambda m: QuantizedCache(CFG.n_layer, 2, key_dim="token", residual=1, block=4,
                                                     symmetric=True),
    "fp8": lambda m: FP8Cache(CFG.n_layer),
    "fp8-per-head": lambda m: FP8Cache(CFG.n_layer, per_head=True),
    "fp8-fixed-scale": lambda m: FP8Cache(CFG.n_layer, scale=0.5),
    "window": lambda m: WindowCache(CFG.n_layer, 4),  # evicts from the second decode step on
    "sink": lambda m: SinkCache.for_model(m, 1, 3),
}


@pytest.mark.parametrize("name", CACHES)
def test_cache_lives_on_the_model_device_and_never_reads_back(name):
    model = meta_model()
    cache = CACHES[name](model)
    logits = decode3(model, cache, prefill(model, ids(2, 3), cache))
    assert_on_meta(cache, logits)
    assert cache.seq_len > 0


def test_h2o_cache_with_its_own_attention():
    model = meta_model()
    cache = H2OCache(CFG.n_layer, heavy=2, recent=2)
    model.set_attention_impl(cache.attention)
    logits = decode3(model, cache, prefill(model, ids(2, 2), cache))
    assert_on_meta(cache, logits)
    assert cache.n_evicted > 0  # the heavy-hitter choice ran on the device


@pytest.mark.parametrize("press", ["snapkv", "pyramidkv", "tova", "expected_attention", "streaming_llm"])
def test_press_prefill_and_decode(press):
    model = meta_model()
    p = kvlib.press.as_press(press)
    if hasattr(p, "window_size"):
        p = dataclasses.replace(p, window_size=4)  # a prompt longer than the window
    cache, logits = kvlib.press.prefill(model, ids(2, 12), p, 0.5)
    logits = decode3(model, cache, logits)
    assert_on_meta(cache, logits)
    assert cache.get_seq_length(0) < 12 + 3  # compressed


HYBRID = {
    "window": (window(4), full()),
    "window+sinks": (window(3, sinks=1), full()),
    "chunked": (chunked(4), full()),
    "shared": (full(), shared(0)),
}


@pytest.mark.parametrize("layers", HYBRID)
@pytest.mark.parametrize("kind", [HybridCache, Recompute])
def test_hybrid_caches(layers, kind):
    model = meta_model(CFG.replace(layers=HYBRID[layers]))
    cache = kind.for_model(model)
    logits = decode3(model, cache, prefill(model, ids(2, 6), cache))  # a chunk past the window, then decodes
    assert_on_meta(cache, logits)


def test_padded_batch():
    model = meta_model()
    valid = torch.ones(2, 5, dtype=torch.bool, device=META)
    cache = PaddedBatch(DynamicCache(CFG.n_layer), valid)
    logits = decode3(model, cache, prefill(model, ids(2, 5), cache))
    assert_on_meta(cache, logits)


@pytest.mark.parametrize("absorbed", [True, False])
def test_latent_cache_mla(absorbed):
    cfg = MLAConfig(d_model=32, n_head=4, d_c=8, d_nope=8, d_rope=4, d_v=8)
    with META:
        layer = MLAAttention(cfg)
    cache = LatentCache.for_model(layer)
    y = layer(torch.zeros(2, 5, 32, device=META), cache=cache, absorbed=absorbed)
    for _ in range(3):
        y = layer(torch.zeros(2, 1, 32, device=META), cache=cache, absorbed=absorbed)
    assert_on_meta(cache, y)


@pytest.mark.parametrize("packed", [False, True])
def test_paged_cache_and_its_batch(packed):
    model = meta_model()
    cache = kvlib.PagedCache.for_model(model, num_blocks=16, block_size=4)  # the model's device
    a, _ = cache.add([])
    b, _ = cache.add([])
    rows, steps = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[[1], [2]]] * 3
    with torch.inference_mode():
        for r in [rows] + steps:
            x = ids(1, sum(map(len, r))) if packed else ids(2, len(r[0]))
            with cache.step([a, b], r, packed=packed) as batch:  # host ints: the tables are host-side
                logits = model(x, batch)
            assert_on_meta(batch, logits)
    assert_on_meta(cache)
    assert cache.num_tokens(a) == 8


def test_generate_without_stop_tokens_never_reads_back():
    out = kvlib.generate(meta_model(), [[1, 2, 3], [4, 5]], 4, pad_id=0)  # lists: checked on the host
    assert out.device == META and out.shape == (2, 3 + 4)


# -- the inherent round-trips, counted -----------------------------------------------------------------
@contextmanager
def host_reads():
    """Count every read of a ``meta`` tensor back to the host, answering it with a fixed value
    (0, 0.0, True, or zeros for ``tolist``) so the code runs on; other tensors read normally."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    original = {n: getattr(torch.Tensor, n) for n in names}
    answer = {"item": 0, "__bool__": True, "__int__": 0, "__float__": 0.0, "__index__": 0}
    reads: list[str] = []

    def fake(name):
        def read(self, *args, **kwargs):
            if self.device != META:
                return original[name](self, *args, **kwargs)
            reads.append(name)
            return torch.zeros(self.shape, dtype=torch.long).tolist() if name == "tolist" else answer[name]
        return read

    for n in names:
        setattr(torch.Tensor, n, fake(n))
    try:
        yield reads
    finally:
        for n, f in original.items():
            setattr(torch.Tensor, n, f)


def test_host_reads_counts_reads_and_leaves_cpu_tensors_alone():
    with host_reads() as reads:
        t = torch.ones(2, device=META)
        assert bool(t.all()) and int(t.sum()) == 0 and t.tolist() == [0, 0]
        assert torch.ones(2).tolist() == [1.0, 1.0]  # a CPU tensor reads its values, uncounted
    assert reads == ["__bool__", "__int__", "tolist"]
    with pytest.raises(RuntimeError, match="meta"):
        torch.ones(1, device=META).item()  # restored: a meta read raises again


def test_engine_reads_back_once_per_step():
    model = meta_model()
    cache = kvlib.PagedCache.for_model(model, num_blocks=32, block_size=4)
    engine = kvlib.Engine(model, cache)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], [9]):
        engine.add(prompt, 4)
    with host_reads() as reads:
        out = engine.run()
    assert all(len(o[0]) == 4 for o in out.values())
    assert engine.stats.steps == 4  # every prompt fits the first step: 4 steps that all sample
    assert reads == ["tolist"] * engine.stats.steps  # HOST_ROUND_TRIPS["kvlib.engine"]
    assert_on_meta(cache)


class FixedDraft:
    """Proposes ``[7, 7]`` every time (a draft that does not depend on the context)."""

    vocab_size = CFG.vocab_size

    def propose(self, context_ids, k):
        return [7] * k


def test_speculative_reads_per_verify_step():
    model = meta_model()
    with host_reads() as reads:
        out, stats = kvlib.speculative.speculative_generate(model, [1, 2, 3], 7, FixedDraft(), k=2)
    assert out.device == META and out.shape == (1, 3 + 7)
    # Each read answers 0.0 / True: p/q = 0 rejects the first guess, whose residual has mass (True),
    # and a draw reads argmax and "is it one-hot?" (True). So, as the module docstring counts:
    # the prompt's ids once, 2 for the prefill's draw, and per verify step 1 (p/q) + 1 (mass) + 2 (draw),
    # or 2 (the bonus draw) for the last step, which proposes nothing (only one token is still wanted).
    assert stats.proposed_per_step == [2, 2, 2, 2, 1, 0] and stats.accepted_per_step == [0] * 6
    assert len(reads) == 1 + 2 + 5 * (1 + 1 + 2) + 2
    assert reads[:3] == ["tolist", "__int__", "__bool__"]


# -- timers wait for the device (CUDA faked: no GPU here) ----------------------------------------------
@pytest.fixture
def cuda_log(monkeypatch):
    """A log of what a timer does: "fn" per call of the timed function, "sync" per
    ``torch.cuda.synchronize``, and the fake CUDA events' records and waits."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing  # elapsed_time needs it

        def record(self, stream=None):
            self.name = "end" if log and log[-1] == "fn" else "start"
            log.append(f"record {self.name}")

        def synchronize(self):
            log.append(f"wait {self.name}")

        def elapsed_time(self, other):
            return 2.0  # ms

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return log


def test_timeit_waits_for_cuda_around_every_timed_call(cuda_log):
    kvlib.timing.timeit(lambda: cuda_log.append("fn"), warmup=1, repeats=2, device="cuda")
    assert cuda_log == ["fn"] + ["sync", "fn", "sync"] * 2


def test_timers_on_the_cpu_never_touch_cuda(cuda_log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    kvlib.timing.timeit(lambda: cuda_log.append("fn"), warmup=1, repeats=2)
    kvlib.timing.timeit(lambda: cuda_log.append("fn"), warmup=0, repeats=1, device="cpu")
    kvlib.timing.round_robin({"a": lambda: cuda_log.append("fn")}, repeats=1, warmup=0)
    assert kvlib.timing.fastest_of("cpu", 2)(lambda: cuda_log.append("fn")) >= 0
    assert cuda_log == ["fn"] * 8  # 3 + 1 + 1 + 3 calls, and nothing else


def test_round_robin_waits_for_cuda_once_cuda_is_in_use(cuda_log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    kvlib.timing.round_robin({"a": lambda: cuda_log.append("fn")}, repeats=2, warmup=0)
    assert cuda_log == ["sync", "fn", "sync"] * 2


def test_fastest_of_times_cuda_with_events(cuda_log):
    best = kvlib.timing.fastest_of("cuda", 2)(lambda: cuda_log.append("fn"))
    assert best == pytest.approx(0.002)  # the events' 2 ms, not the host's clock
    assert cuda_log == ["fn", "sync"] + ["record start", "fn", "record end", "wait end"] * 2


# -- the documented round-trips -------------------------------------------------------------------------
def round_trips_section(module: str) -> str | None:
    """The paragraph a module docstring opens with "**Host round-trips.**", or None without one."""
    doc = importlib.import_module(module).__doc__ or ""
    if "**Host round-trips.** " not in doc:
        return None
    return doc.split("**Host round-trips.** ", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("module", sorted(HOST_ROUND_TRIPS))
def test_each_inherent_round_trip_is_documented_where_it_happens(module):
    text = round_trips_section(module)
    assert text is not None, f"{module}'s docstring needs a 'Host round-trips' section: {HOST_ROUND_TRIPS[module]}"
    assert not text.startswith("None."), f"{module} says it makes none, but HOST_ROUND_TRIPS lists it"


@pytest.mark.parametrize("module", ["kvlib.quant", "kvlib.fp8", "kvlib.hybrid"])
def test_modules_that_say_none_make_none(module):
    assert round_trips_section(module).startswith("None"), "the meta tests above hold it to that"
    assert module not in HOST_ROUND_TRIPS


def test_quantize_on_an_accelerator_keeps_fp16_scales_without_reading():
    q = kvlib.quant.quantize(torch.zeros(1, 2, 8, 4, device=META), 4, dim=-2)  # fp32 in: CPU would check it
    assert q.scale.dtype == torch.float16 and q.scale.device == META and q.codes.device == META


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_on_an_accelerator_still_refuses_bad_input_on_the_device(monkeypatch, symmetric):
    """Its two value checks are queued on the device (torch._assert_async), never skipped: an inf
    input or scales past fp16 stop the program at the device's next sync instead of a silent NaN."""
    queued = []
    monkeypatch.setattr(torch, "_assert_async", lambda cond, msg="": queued.append((cond.device, msg)))
    kvlib.quant.quantize(torch.zeros(1, 2, 8, 4, device=META), 4, dim=-2, symmetric=symmetric)
    assert [d for d, _ in queued] == [META, META]
    assert "finite" in queued[0][1] and "65,504" in queued[1][1]
    queued.clear()
    kvlib.quant.quantize(torch.zeros(1, 2, 8, 4), 4, dim=-2, symmetric=symmetric)  # the CPU reads and raises
    assert queued == []


@pytest.mark.parametrize("padded", [False, True])
def test_attend_default_off_the_cpu_never_takes_a_padding_mask_for_causal(padded):
    """A press's prefill hands SDPA no mask where the model's is the plain causal one. Off the CPU
    that is decided on the device: both results, the right one kept. A single padded sequence's
    mask has the causal mask's shape; it must still be applied (before, the shape alone decided)."""
    from kvlib.attention import _causal_or_masked, attend, attend_default, causal_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in "qkv")
    mask = causal_mask(5, 5)[None, None].clone()  # (1, 1, T, S)
    if padded:
        mask[..., :2] = False  # the first two positions are padding
    want = attend(q, k, v, mask if padded else None, "sdpa")
    torch.testing.assert_close(_causal_or_masked(q, k, v, mask), want, rtol=0, atol=0)
    torch.testing.assert_close(attend_default(q, k, v, mask), want, rtol=0, atol=0)  # the CPU's read
    meta = attend_default(*(t.to(META) for t in (q, k, v, mask)))  # and no read on the device
    assert meta.device == META and meta.shape == want.shape


# -- the attention kernels and weight formats a model can run with ------------------------------------
KERNELS = {
    "reference": lambda m: m.set_attention_impl("reference"),
    "online-softmax": lambda m: m.set_attention_impl(kvlib.kernels.online_softmax_attention),
    "split-kv": lambda m: m.set_attention_impl(kvlib.kernels.split_kv(2)),
    "batch-invariant": lambda m: m.set_batch_invariant(True),
    "int8-weights": lambda m: kvlib.wquant.quantize_weights(m, "int8"),  # int4's kernel is torch's CPU-only one
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernels_and_weight_formats_run_on_the_model_device(name):
    model = meta_model()
    KERNELS[name](model)
    cache = DynamicCache(CFG.n_layer)
    logits = decode3(model, cache, prefill(model, ids(2, 5), cache))
    assert_on_meta(cache, logits)


def test_paged_attention_loop_reads_the_pool_in_place():
    pool = torch.zeros(4, 4, 2, 8, device=META)  # (blocks, block_size, H_kv, D)
    out = kvlib.paged.paged_attention_loop(torch.zeros(4, 8, device=META), pool, pool, [1, 2], 6)  # host table
    assert out.device == META and out.shape == (4, 8)


def test_graphed_is_the_function_itself_off_cuda_and_when_capture_fails():
    def fn():
        return 1
    assert kvlib.timing.graphed(fn, "cpu") is fn
    if not torch.cuda.is_available():  # capture cannot even start: the sweep runs eagerly
        assert kvlib.timing.graphed(fn, "cuda") is fn
