"""The disk tier (`kvlib.distributed.disk`, `kvlib.distributed.tiered`): a returning prompt loads
its longest stored prefix and gets the logits and tokens of a full prefill; and whatever happens
to the files (concurrent writers and readers with evictions, a writer killed mid-write, a flipped
byte, a full budget, a full disk), a lookup ends in a miss or a clear error, never wrong K/V."""

import errno
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import kvlib
from kvlib.distributed import chunkfile, disk
from kvlib.generate import prefill as full_prefill
from kvlib.distributed.cachekind import cache_kind
from kvlib.distributed.disk import DiskStore, StoreError
from kvlib.distributed.tiered import crossover, load_vs_recompute, prefill

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")

CFG = kvlib.ModelConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=97, max_seq_len=512)
L, H, D, CT = 2, 2, 8, 8  # the tiny model's layers, KV heads, head_dim; tokens per chunk


def tiny_model() -> kvlib.Transformer:
    model = kvlib.Transformer(CFG)
    model.reset_parameters(seed=0, std=0.2)  # std 0.2: no near-ties between the top logits
    return model.eval()


def open_store(root, **kw) -> DiskStore:
    kw.setdefault("budget_bytes", 1 << 20)
    return DiskStore(root, model_id="tiny-seed0", n_layer=L, n_kv_head=H, head_dim=D, chunk_tokens=CT, **kw)


def synthetic_kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V where position j depends on tokens[:j+1] (as a model's do), the same in every process."""
    ks, vs = [torch.empty(L, H, D)], [torch.empty(L, H, D)]  # sliced off below: T may be 0
    for j in range(len(tokens)):
        seed = int(hashlib.sha256(json.dumps(tokens[: j + 1]).encode()).hexdigest()[:15], 16)
        g = torch.Generator().manual_seed(seed)
        ks.append(torch.randn(L, H, D, generator=g))
        vs.append(torch.randn(L, H, D, generator=g))
    k, v = torch.stack(ks, dim=2)[:, :, 1:], torch.stack(vs, dim=2)[:, :, 1:]  # (L, H, T, D)
    return [(k[i][None], v[i][None]) for i in range(L)]  # L x (1, H, T, D)


def assert_exact(prefix, tokens):
    """Every layer's loaded K/V are bit for bit the K/V of the first n tokens."""
    want = synthetic_kv(tokens[: prefix.n_tokens])
    for (k, v), got_k, got_v in zip(want, prefix.keys, prefix.values):
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def temps(root) -> list[Path]:
    return [p for p in Path(root).iterdir() if p.name.endswith(chunkfile.TEMP_SUFFIX)]


def rand_tokens(n, seed, lo=10, hi=97):  # two-digit ids: every chunk file has the same size
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- a returning prompt -------------------------------------------------------------------------
@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_a_returning_prompt_loads_its_prefix_and_prefills_only_the_rest(tmp_path, cache_kind):
    model, store = tiny_model(), open_store(tmp_path)
    first = rand_tokens(43, seed=1)
    served = prefill(model, first, store)
    assert (served.loaded, served.computed, served.stored) == (0, 43, 5)  # 5 full chunks of 8
    again = first[:35] + rand_tokens(20, seed=2)  # shares 35 tokens: 4 whole chunks
    cache = kvlib.DynamicCache(L) if cache_kind == "dynamic" else None
    served = prefill(model, again, store, cache)
    assert (served.loaded, served.computed, served.stored) == (32, 23, 2)
    ref_cache = kvlib.StaticCache.for_model(CFG, 1, len(again))
    ref = full_prefill(model, torch.tensor(again)[None], ref_cache)  # (1, vocab): a full prefill
    # The loaded K/V were computed in a prefill of other shapes (43 rows, not 55), and the rest
    # attends over them in a second call: the same math in another summation order, so fp32 last bits.
    torch.testing.assert_close(served.logits, ref, atol=1e-5, rtol=1e-5)
    for layer in range(L):
        torch.testing.assert_close(served.cache.layer_kv(layer)[0], ref_cache.layer_kv(layer)[0], atol=1e-5, rtol=1e-5)
    # Greedy tokens are identical because the top-2 margin is far wider than that drift:
    top2 = ref[0].topk(2).values
    assert top2[0] - top2[1] > 1000 * (served.logits - ref).abs().max()
    first_new = served.logits.argmax(-1)  # (1,)
    ours = kvlib.generate(model, first_new[:, None], 7, cache=served.cache)[0, :]  # the token, then 7 more
    assert ours.tolist() == kvlib.generate(model, torch.tensor(again)[None], 8)[0, len(again):].tolist()


def test_smollm2_end_to_end(tmp_path):
    model, tok = kvlib.load_smollm2()
    model = model.first_layers(8)  # real weights, real tokenizer; 8 of 30 layers to keep the test short
    ids = tok.encode(kvlib.data.tiny_shakespeare("val")[:400])
    store = DiskStore.for_model(tmp_path, model, model_id="SmolLM2-135M-Instruct-Q4_1", chunk_tokens=16)
    assert prefill(model, ids[:60], store).stored == 3
    again = ids[:50] + tok.encode(" And what say you, my lord?")
    served = prefill(model, again, store)
    assert (served.loaded, served.computed) == (48, len(again) - 48)
    ref = full_prefill(model, torch.tensor(again)[None], kvlib.StaticCache.for_model(model.config, 1, len(again)))
    torch.testing.assert_close(served.logits, ref, atol=1e-4, rtol=1e-4)  # fp32 summation order, 30 layers deep
    ours = kvlib.generate(model, served.logits.argmax(-1)[:, None], 7, cache=served.cache)[0]
    assert ours.tolist() == kvlib.generate(model, torch.tensor(again)[None], 8)[0, len(again):].tolist()


# -- concurrent readers and writers, with evictions -----------------------------------------------
BLOCKS = [rand_tokens(CT, seed=100 + b) for b in range(3)]  # prompts reuse these chunks after other prefixes


def fuzz_worker(root: str, seed: int, ops: int, budget: int, out: str, barrier) -> None:
    torch.set_num_threads(1)
    store, rng = open_store(root, budget_bytes=budget), random.Random(seed)
    counts = {"hits": 0, "hit_tokens": 0, "wrong": 0, "puts": 0}
    barrier.wait(timeout=60)  # every worker imported and ready: the loops below overlap
    counts["start"] = time.time()
    for _ in range(ops):
        tokens = sum((rng.choice(BLOCKS) for _ in range(rng.randint(1, 4))), []) + rand_tokens(rng.randint(0, 9), seed)
        if rng.random() < 0.5:
            store.put(tokens, synthetic_kv(tokens))
            counts["puts"] += 1
            counts["max_bytes"] = max(counts.get("max_bytes", 0), store.nbytes)  # the budget holds at every moment
        else:
            got = store.lookup(tokens)
            want = synthetic_kv(tokens[: got.n_tokens])
            same = all(torch.equal(a, k) and torch.equal(b, v) for (k, v), a, b in zip(want, got.keys, got.values))
            counts["wrong"] += not same
            counts["hits"] += got.n_tokens > 0
            counts["hit_tokens"] += got.n_tokens
    counts.update(evictions=store.evictions, corrupt=store.corrupt, end=time.time())
    Path(out).write_text(json.dumps(counts))


def run_processes(targets, timeout_s: float) -> list[int]:
    """Start every ``(fn, args)`` as a spawned process; join each within the time left; kill leftovers."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [p.exitcode for p in procs]


def test_concurrent_readers_and_writers_never_see_a_wrong_chunk(tmp_path):
    root = tmp_path / "store"
    file_bytes = 2 * L * H * CT * D * 4 + 1024  # a chunk's tensors and, generously, its header
    budget = 5 * file_bytes  # far fewer chunks than the prompts make: evictions all the time
    outs = [tmp_path / f"worker{i}.json" for i in range(3)]
    barrier = mp.get_context("spawn").Barrier(3)
    codes = run_processes([(fuzz_worker, (str(root), i, 150, budget, str(out), barrier))
                           for i, out in enumerate(outs)], 120)
    assert codes == [0, 0, 0]
    results = [json.loads(o.read_text()) for o in outs]
    assert max(r["start"] for r in results) < min(r["end"] for r in results)  # the three ran at once
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["hits"] for r in results) > 10 and sum(r["evictions"] for r in results) > 10
    assert max(r["max_bytes"] for r in results) <= budget  # every process saw the shared budget kept
    assert not temps(root) and open_store(root).nbytes <= budget


# -- a writer killed mid-write ------------------------------------------------------------------
def slow_writer(root: str, marker: str) -> None:
    """put() one chunk, with the write hooked to stop halfway (flushed to disk) and wait to be killed."""

    def half_then_wait(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        Path(marker).touch()
        time.sleep(60)

    chunkfile._write_pieces = half_then_wait
    tokens = rand_tokens(CT, seed=7)
    open_store(root).put(tokens, synthetic_kv(tokens))


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
def test_a_writer_killed_mid_write_leaves_no_chunk_and_its_temp_is_swept(tmp_path):
    root, marker = tmp_path / "store", tmp_path / "halfway"
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=slow_writer, args=(str(root), str(marker)))
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and p.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the writer never reached its write (exit code {p.exitcode})"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.join(10)
    assert p.exitcode == -signal.SIGKILL
    store = DiskStore(root, model_id="tiny-seed0", n_layer=L, n_kv_head=H, head_dim=D, chunk_tokens=CT,
                      budget_bytes=1 << 20, stale_temp_s=3600)  # opening sweeps; the dead writer's temp goes
    tokens = rand_tokens(CT, seed=7)
    assert store.files() == [] and store.lookup(tokens).n_tokens == 0
    assert not temps(root)
    store.put(tokens, synthetic_kv(tokens))  # the chunk can be stored again, whole
    assert_exact(store.lookup(tokens), tokens)


def test_lookup_ignores_temp_files_and_sweep_removes_only_stale_ones(tmp_path):
    store = open_store(tmp_path)
    tokens = rand_tokens(CT, seed=3)
    key = store.keys_for(tokens)[0]
    live = tmp_path / f".{key}.{os.getpid()}.abcd{chunkfile.TEMP_SUFFIX}"  # a writer in flight: this process
    live.write_bytes(chunkfile.st_save({"keys": torch.zeros(L, H, CT, D), "values": torch.zeros(L, H, CT, D)}))
    assert store.lookup(tokens).n_tokens == 0 and store.sweep() == 0 and live.exists()
    os.utime(live, (time.time() - 7200,) * 2)
    assert store.sweep(max_age_s=3600) == 1 and not live.exists()


# -- flipped bytes and collisions -----------------------------------------------------------------
def test_a_flipped_byte_in_the_tensor_data_is_a_miss_and_the_file_is_removed(tmp_path):
    store, tokens = open_store(tmp_path), rand_tokens(2 * CT, seed=4)
    store.put(tokens, synthetic_kv(tokens))
    second = store.path(store.keys_for(tokens)[1])
    data = bytearray(second.read_bytes())
    data[-5] ^= 0x01  # one bit of the last value
    second.write_bytes(bytes(data))
    got = store.lookup(tokens)
    assert got.n_tokens == CT and not second.exists() and store.corrupt == 1  # the prefix stops before it
    assert_exact(got, tokens)


def test_every_flipped_byte_in_the_header_is_a_miss(tmp_path):
    store, tokens = open_store(tmp_path), rand_tokens(CT, seed=5)
    store.put(tokens, synthetic_kv(tokens))
    path = store.path(store.keys_for(tokens)[0])
    good = path.read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    for i in range(header_end):  # the length prefix, then every byte of the JSON header
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bytes(bad))
        assert store.lookup(tokens).n_tokens == 0, f"byte {i} flipped: {bytes(good[max(0, i - 20):i + 20])!r}"
    # Every flip is damage (removed), except in the 2 * CT digits of the two-digit token ids:
    # a digit flipped in its lowest bit is another digit, so a whole file of other tokens, a miss.
    assert store.corrupt == header_end - 2 * CT


def test_a_hash_collision_is_a_miss(tmp_path, monkeypatch):
    # A key function that forgets the tokens: every first chunk collides with every other.
    monkeypatch.setattr(disk, "chunk_key", lambda parent, fp, toks: hashlib.sha256(f"{parent}{fp}".encode()).hexdigest())
    store, a, b = open_store(tmp_path), rand_tokens(CT, seed=10), rand_tokens(CT, seed=11)
    store.put(a, synthetic_kv(a))
    assert store.keys_for(a) == store.keys_for(b) and store.lookup(b).n_tokens == 0
    assert_exact(store.lookup(a), a)


def test_a_chunk_stored_after_another_prefix_is_a_miss(tmp_path, monkeypatch):
    # A key function that forgets the parent: the same chunk tokens after two prefixes collide.
    monkeypatch.setattr(disk, "chunk_key", lambda parent, fp, toks: hashlib.sha256(f"{fp}{toks}".encode()).hexdigest())
    store, tail = open_store(tmp_path), rand_tokens(CT, seed=12)
    x, y = rand_tokens(CT, seed=13) + tail, rand_tokens(CT, seed=14) + tail
    store.put(x[:CT], synthetic_kv(x[:CT]))
    store.put(y, synthetic_kv(y))  # y's second chunk sits under the key x's would have
    got = store.lookup(x)
    assert got.n_tokens == CT  # x's first chunk; its second is y's, whose K/V saw other tokens
    assert_exact(got, x)


# -- the budget and the disk ----------------------------------------------------------------------
def one_chunk_file_bytes(tmp_path) -> int:
    probe, tokens = open_store(tmp_path / "probe"), rand_tokens(CT, seed=0)
    probe.put(tokens, synthetic_kv(tokens))
    return probe.nbytes


def test_lru_evicts_the_least_recently_used_chunk(tmp_path):
    size = one_chunk_file_bytes(tmp_path)
    store = open_store(tmp_path / "s", budget_bytes=3 * size + size // 2)  # room for 3 chunks
    a, b, c, d = (rand_tokens(CT, seed=20 + i) for i in range(4))
    for t in (a, b, c):
        assert store.put(t, synthetic_kv(t)).written == 1
    assert store.lookup(a).n_tokens == CT  # a hit makes a the most recently used
    store.put(d, synthetic_kv(d))  # b is now the oldest
    assert [store.lookup(t).n_tokens for t in (a, b, c, d)] == [CT, 0, CT, CT]
    assert store.evictions == 1 and store.nbytes <= store.budget_bytes


def test_a_prefix_loses_its_tail_first_and_keeps_its_head(tmp_path):
    size = one_chunk_file_bytes(tmp_path)
    store = open_store(tmp_path / "s", budget_bytes=3 * size + size // 2)
    x, y, z = rand_tokens(2 * CT, seed=30), rand_tokens(CT, seed=31), rand_tokens(CT, seed=32)
    for t in (x, y):
        store.put(t, synthetic_kv(t))
    store.put(z, synthetic_kv(z))  # one must go: x's second chunk, older than its first
    assert [store.lookup(t).n_tokens for t in (x, y, z)] == [CT, CT, CT]
    long = rand_tokens(5 * CT, seed=33)  # more chunks than the budget holds: store the head, not the tail
    report = store.put(long, synthetic_kv(long))
    assert (report.written, report.no_room) == (3, 2) and store.lookup(long).n_tokens == 3 * CT


def test_a_budget_below_one_chunk_file_is_refused_with_the_smallest_that_fits(tmp_path):
    """The budget counts files, header included: a budget of the tensor bytes alone was accepted
    before, and then every put failed. Now the constructor names the smallest budget that fits."""
    tensors = 2 * L * H * CT * D * 4
    need = open_store(tmp_path / "probe").chunk_file_bytes()
    assert need > tensors  # the header: shapes, fingerprint, keys, token ids, checksum
    for budget in (tensors, need - 1):
        with pytest.raises(ValueError, match=f"budget_bytes={budget} cannot hold one chunk file of {need} bytes.*"
                                             f"at least {need}"):
            open_store(tmp_path / "s", budget_bytes=budget)
    store = open_store(tmp_path / "s", budget_bytes=need)  # the smallest: a chunk of the largest ids fits
    tokens = [2**31 - 1] * CT
    assert store.put(tokens, synthetic_kv(tokens)).written == 1 and store.nbytes <= need
    assert_exact(store.lookup(tokens), tokens)
    huge = [10**400] * CT  # ids far past 2**31 make a longer header than the budget allows for: a clear error
    with pytest.raises(StoreError, match=f"exceeds budget_bytes={need}"):
        store.put(huge, synthetic_kv(huge))
    assert len(store) == 1 and not temps(tmp_path / "s")


def test_a_full_disk_raises_a_clear_error_and_leaves_no_temp(tmp_path, monkeypatch):
    store, tokens = open_store(tmp_path), rand_tokens(3 * CT, seed=41)
    writes = []

    def fills_up_on_the_second_chunk(f, data):
        writes.append(len(data))
        f.write(data[: len(data) // 2])
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write(data[len(data) // 2 :])

    monkeypatch.setattr(chunkfile, "_write_pieces", fills_up_on_the_second_chunk)
    with pytest.raises(StoreError, match="No space left on device") as info:
        store.put(tokens, synthetic_kv(tokens))
    assert info.value.errno == errno.ENOSPC and not temps(tmp_path) and len(store) == 1
    assert_exact(store.lookup(tokens), tokens)  # the chunk before the failure, whole
    writes.clear()
    model = tiny_model()
    served = prefill(model, tokens, open_store(tmp_path / "m"))  # a request survives a failed store
    assert (served.computed, served.stored) == (3 * CT, 1)  # the chunk before the failure
    assert "No space left" in served.store_error and not temps(tmp_path / "m")


# -- the cache's kind: lossy K/V are never served as exact ----------------------------------------
def q2_cache() -> "kvlib.quant.QuantizedCache":
    return kvlib.quant.QuantizedCache(L, bits=2, residual=0, block=CT)  # every whole block in 2 bits


def test_a_quantized_prefix_is_never_served_to_an_exact_request(tmp_path):
    """A 2-bit cache's prefill stored its dequantized K/V under the exact model's keys, and a later
    exact request loaded them as its own. Now chunks are keyed by the cache's kind."""
    model, store = tiny_model(), open_store(tmp_path)
    first = rand_tokens(43, seed=60)
    q2 = q2_cache()
    served = prefill(model, first, store, q2)
    assert served.stored == 5 and served.kind == cache_kind(q2) != "exact"
    again = first[:35] + rand_tokens(20, seed=61)
    assert store.lookup(again).n_tokens == 0 and store.lookup(again, kind=served.kind).n_tokens == 32
    exact = prefill(model, again, store)  # an exact request: the 2-bit chunks are not its prefix
    assert (exact.loaded, exact.computed, exact.kind) == (0, len(again), "exact")
    ref = full_prefill(model, torch.tensor(again)[None], kvlib.StaticCache.for_model(CFG, 1, len(again)))
    torch.testing.assert_close(exact.logits, ref, atol=1e-5, rtol=1e-5)
    assert exact.logits.argmax() == ref.argmax()
    # the same 2-bit cache gets the 2-bit prefix; another setting (4 bits) does not
    same = prefill(model, again, store, q2_cache())
    assert (same.loaded, same.kind) == (32, served.kind)
    q4 = kvlib.quant.QuantizedCache(L, bits=4, residual=0, block=CT)
    assert prefill(model, again, store, q4).loaded == 0
    # and by hand: a lossy prefix will not fill an exact cache, nor an exact one a lossy cache
    with pytest.raises(ValueError, match=r"made by a cache of kind QuantizedCache\(bits=2.*is of kind exact"):
        store.lookup(again, kind=served.kind).fill(kvlib.DynamicCache(L))
    with pytest.raises(ValueError, match="kind exact.*kind QuantizedCache"):
        store.lookup(again).fill(q2_cache())
    with pytest.raises(ValueError, match="kind='exact', but this QuantizedCache is of kind QuantizedCache"):
        store.put(first, q2, kind="exact")


def test_the_kind_names_the_class_and_its_settings():
    assert cache_kind(kvlib.DynamicCache(L)) == cache_kind(kvlib.StaticCache.for_model(CFG, 1, 8)) == "exact"
    assert cache_kind(kvlib.hybrid.HybridCache.for_model(CFG)) == "exact"  # every layer full
    assert cache_kind(kvlib.quant.CastCache(L, torch.float16)) == "CastCache(store_dtype=torch.float16)"
    assert cache_kind(kvlib.quant.FP8Cache(L)) == "FP8Cache(per_head=False, scale=None)"
    assert cache_kind(q2_cache()) != cache_kind(kvlib.quant.QuantizedCache(L, bits=2, residual=0, block=CT,
                                                                            symmetric=True))


def test_every_class_the_kind_names_is_where_it_says():
    """The kinds match classes by module and name (kvlib.hf is not imported for them): a class
    that moves module must move here too, or its caches are refused as unknown (FP8Cache, when it
    moved to kvlib.fp8 in 0.5)."""
    import importlib
    from kvlib.distributed import cachekind

    for module, name in [*cachekind._LOSSY, *cachekind._EVICTING, ("kvlib.hybrid", "HybridCache")]:
        cls = getattr(importlib.import_module(module), name)
        assert (cls.__module__, cls.__name__) == (module, name)


@pytest.mark.parametrize("make", [
    lambda: kvlib.evict.WindowCache(L, 32),  # each with room for the prompt: no eviction yet, still refused
    lambda: kvlib.evict.SinkCache(L, 4, 32, 10000.0),
    lambda: kvlib.evict.H2OCache(L, 8, 32),
    lambda: kvlib.press.PressCache(L, "snapkv", 0.5),
    lambda: kvlib.hybrid.HybridCache((kvlib.layers.window(16), kvlib.layers.full())),
], ids=["window", "sink", "h2o", "press", "hybrid-window"])
def test_caches_that_evict_tokens_are_refused(tmp_path, make):
    """They do not hold the whole prefix: nothing whole to store, and a loaded prefix would not be
    theirs. A window with room for the prompt was accepted before, and its chunks stored."""
    model, store, tokens = tiny_model(), open_store(tmp_path), rand_tokens(24, seed=62)
    with pytest.raises(ValueError, match="evicts tokens|do not hold every token"):
        prefill(model, tokens, store, make())
    assert len(store) == 0


def test_a_cache_class_of_your_own_names_its_kind(tmp_path):
    class Mine(kvlib.DynamicCache):
        pass

    model, store, tokens = tiny_model(), open_store(tmp_path), rand_tokens(24, seed=63)
    with pytest.raises(TypeError, match="does not know whether a Mine returns the K/V it was given.*kind='exact'"):
        prefill(model, tokens, store, Mine(L))
    assert prefill(model, tokens, store, Mine(L), kind="exact").stored == 3
    assert prefill(model, tokens, store).loaded == 16  # an exact request reads what it stored
    assert prefill(model, tokens, store, Mine(L), kind="mine, 3 bits").loaded == 0
    with pytest.raises(ValueError, match="1 to 256 characters"):
        store.lookup(tokens, kind="")


def test_for_model_takes_a_model_or_a_config(tmp_path):
    model = tiny_model()
    a = DiskStore.for_model(tmp_path / "a", model, model_id="m")
    b = DiskStore.for_model(tmp_path / "b", CFG, model_id="m")  # a config: fp32, as a fresh model
    assert a.fingerprint == b.fingerprint and a.shape == b.shape and b.dtype == torch.float32
    assert DiskStore.for_model(tmp_path / "c", CFG, model_id="m", dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="kvlib.Transformer or a kvlib.ModelConfig, got str"):
        DiskStore.for_model(tmp_path / "d", "tiny", model_id="m")


# -- misuse -------------------------------------------------------------------------------------
def test_bad_input_gets_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model_id"):
        DiskStore(tmp_path, model_id="", n_layer=L, n_kv_head=H, head_dim=D)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int, got 0"):
        DiskStore(tmp_path, model_id="m", n_layer=L, n_kv_head=H, head_dim=D, chunk_tokens=0)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        open_store(tmp_path, budget_bytes=1e6)
    with pytest.raises(ValueError, match="stale_temp_s must be a positive number of seconds, got 0"):
        open_store(tmp_path, stale_temp_s=0)
    store, tokens = open_store(tmp_path), rand_tokens(CT, seed=50)
    with pytest.raises(ValueError, match=r"\(T,\) or \(1, T\).*\(2, 8\)"):
        store.lookup(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="integer ids, got dtype torch.float32"):
        store.lookup(torch.zeros(8))
    with pytest.raises(ValueError, match="token ids must be non-negative, got -1"):
        store.lookup([1, -1])
    with pytest.raises(TypeError, match="a token id must be an int, got str '3'"):
        store.put([1, "3"], synthetic_kv([1, 3]))
    with pytest.raises(ValueError, match="token ids must be non-negative, got -2"):
        store.lookup(torch.tensor([[5, -2]]))
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0, got -1"):
        store.lookup(tokens, max_tokens=-1)
    with pytest.raises(ValueError, match="2 per-layer"):
        store.put(tokens, synthetic_kv(tokens)[:1])
    with pytest.raises(ValueError, match=r"must be \(1, 2, >= 8, 8\) for 8 tokens, got \(1, 2, 7, 8\)"):
        store.put(tokens, synthetic_kv(tokens[:7]))
    with pytest.raises(TypeError, match="torch.float16; this store holds torch.float32"):
        store.put(tokens, [(k.half(), v.half()) for k, v in synthetic_kv(tokens)])
    other = DiskStore(tmp_path / "o", model_id="m", n_layer=L, n_kv_head=H, head_dim=16, chunk_tokens=CT)
    with pytest.raises(ValueError, match=r"holds chunks \(2, 2, 8, 16\).*makes \(2, 2, 8, 8\)"):
        prefill(tiny_model(), tokens, other)
    full = kvlib.StaticCache.for_model(CFG, 1, 16)
    full_prefill(tiny_model(), torch.tensor(tokens)[None], full)
    with pytest.raises(ValueError, match="empty kvlib Cache"):
        prefill(tiny_model(), tokens, store, full)


# -- the measurement -----------------------------------------------------------------------------
def test_load_vs_recompute_measures_every_length_and_stores_the_formula_bytes(tmp_path):
    rows = load_vs_recompute(tiny_model(), rand_tokens(32, seed=60), [8, 32], tmp_path, model_id="tiny",
                             chunk_tokens=8, repeats=1)
    per_token = 2 * L * H * D * 4
    assert [r["tokens"] for r in rows] == [8, 32]
    for r in rows:  # the tensors, plus a header of under 1 KiB per chunk
        assert r["tokens"] * per_token < r["bytes"] < r["tokens"] * per_token + 1024 * r["tokens"] // 8
        assert r["load_s"] > 0 and r["recompute_s"] > 0
    with pytest.raises(ValueError, match=r"multiples of chunk_tokens=8.*\[12\]"):
        load_vs_recompute(tiny_model(), rand_tokens(32, seed=60), [12], tmp_path, model_id="tiny", chunk_tokens=8)


def test_crossover_is_the_shortest_length_from_which_loading_always_wins():
    rows = [{"tokens": n, "load_s": load, "recompute_s": rec}
            for n, load, rec in [(32, 2.0, 1.0), (64, 1.5, 2.0), (128, 3.0, 2.5), (256, 3.0, 5.0), (512, 4, 9)]]
    assert crossover(rows) == 256  # 64 wins alone, 128 loses again
    assert crossover(rows[:3]) is None and crossover(rows[3:]) == 256
