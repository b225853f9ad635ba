"""The reference cross-checks, written to run on any device: ``pytest --device cuda tests``
runs these on the GPU and skips the CPU-only rest (with a reason). On the CPU they run as well."""

import pytest
import torch

import kvlib
from kvlib import DynamicCache, ModelConfig, SamplingParams, StaticCache, Transformer
from kvlib.generate import decode_step, prefill
from kvlib.quant import QuantizedCache

pytestmark = pytest.mark.device

CFG = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=96)


@pytest.fixture(scope="module")
def model(device):
    m = Transformer(CFG, device=device)
    m.reset_parameters(seed=0, std=0.2)  # sharp logits: no argmax ties
    return m.eval()


def ids(device, B=1, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, T), generator=g).to(device)


def test_everything_lives_on_the_model_device(model, device):
    assert model.device.type == device.type
    cache = StaticCache.for_model(CFG, 1, 8, device=device)
    assert all(t.device.type == device.type for t in cache.keys + cache.values)
    out = kvlib.generate(model, ids(device), 4)
    assert out.device.type == device.type


@pytest.mark.parametrize("make", [lambda d: DynamicCache(CFG.n_layer),
                                  lambda d: StaticCache.for_model(CFG, 2, 32, device=d)])
def test_cached_decoding_equals_full_recompute(model, device, make):
    x = ids(device, B=2)
    cache = make(device)
    with torch.inference_mode():
        got = [model(x, cache)[:, -1]]
        full = [model(x)[:, -1]]
        seq = x
        for _ in range(6):
            nxt = got[-1].argmax(-1, keepdim=True)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
            got.append(model(nxt, cache)[:, -1])
            full.append(model(seq)[:, -1])
    for a, b in zip(got, full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(kvlib.generate(model, x, 10), kvlib.generate_naive(model, x, 10))


def test_padded_batch_rows_equal_each_row_alone(model, device):
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    got = kvlib.generate(model, rows, 6, pad_id=0)
    for i, r in enumerate(rows):
        alone = kvlib.generate(model, torch.tensor([r], device=device), 6)[0, len(r):]
        assert torch.equal(got[i, -6:], alone)


def test_sampling_is_reproducible_from_a_seed(model, device):
    p = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    assert torch.equal(kvlib.generate(model, ids(device), sampling=p), kvlib.generate(model, ids(device), sampling=p))


def test_paged_engine_equals_generate(model, device):
    prompts = [ids(device, T=n, seed=n)[0].tolist() for n in (5, 17, 9)]
    want = [kvlib.generate(model, [p], 8)[0, len(p):].tolist() for p in prompts]
    cache = kvlib.PagedCache.for_model(CFG, num_blocks=24, block_size=4, device=device)
    assert cache.keys[0].device.type == device.type
    eng = kvlib.Engine(model, cache)
    for p in prompts:
        eng.add(p, 8)
    out = eng.run()
    assert [out[i][0] for i in range(3)] == want and cache.allocator.num_used == 0


def test_quantized_cache_at_8_bits_keeps_greedy_tokens(model, device):
    x = ids(device, T=12)
    cache = QuantizedCache(CFG.n_layer, bits=8, residual=4, block=4)
    got = kvlib.generate(model, x, 8, cache=cache)
    assert torch.equal(got, kvlib.generate(model, x, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks that a decode step never syncs")
def test_a_decode_step_never_waits_for_the_device(model, device):
    if device.type != "cuda":
        pytest.skip("the suite runs on the CPU: pytest --device cuda runs this")
    cache = StaticCache.for_model(CFG, 1, 16, device=device)
    prefill(model, ids(device), cache)
    tok = torch.zeros(1, dtype=torch.long, device=device)
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync now raises
    try:
        for _ in range(3):
            tok = decode_step(model, tok, cache).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name, says", [
    ("cuda:99", r"--device cuda:99: this torch .* sees \d+ CUDA device\(s\), so nothing would run there"),
    ("gpu", r"--device 'gpu' is not a torch device .*use cpu, cuda or cuda:N"),
    ("mps", r"--device mps: the suite runs on cpu or cuda"),
])
def test_a_device_this_machine_lacks_stops_the_run_with_the_reason(name, says, tmp_path):
    """Asked for a device it cannot use, pytest must stop with a usage error (exit 4) that says why,
    not skip every test and report a pass. cuda:99 is missing on every machine."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--device", name, str(tests / "test_config.py")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(says, run.stderr), run.stderr[-2000:]
