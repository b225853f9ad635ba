"""The reference cross-checks, written to run on any device: ``pytest --device cuda tests``
runs these on the GPU and skips the CPU-only rest (with a reason). On the CPU they run as well.

Then the machinery itself (tests/conftest.py), each check run in a pytest of its own over a small
test tree beside a copy of the conftest: a test marked neither `device` nor `cpu_only` fails to
collect; ``--device cuda`` (emulated on the CPU by KVLIB_TEST_COLLECT_AS=cuda) does not import a
module that is cpu_only as a whole but lists it with its reason; the CPU run still runs everything.
The subprocesses pass ``-o addopts=`` (pyproject's nbval options need nbval, which the GPU machine
lacks) and ``-p no:xdist``."""

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
                          "-o", "addopts=", "--device", name, str(tests / "test_config.py")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(says, run.stderr), run.stderr[-2000:]


# -- the markers' machinery ---------------------------------------------------------------------------------
TREE = {
    "test_marked_device.py": '''
import pytest
pytestmark = pytest.mark.device

def test_runs_anywhere(device):
    assert device.type in ("cpu", "cuda")
''',
    "test_mixed.py": '''
import pytest

@pytest.mark.device
def test_on_the_device(device):
    pass

@pytest.mark.cpu_only("reads the moon's weights, which the GPU machine lacks")
def test_on_the_cpu():
    pass
''',
    "test_whole_module_cpu_only.py": '''
import os
from pathlib import Path

import pytest

Path(os.environ["KVLIB_TEST_IMPORTED"]).write_text("imported")  # proof of import, read by the outer test

pytestmark = pytest.mark.cpu_only("builds the moon (nbformat)")

def test_on_the_cpu():
    pass
''',
}


def run_tree(tmp_path, files, *, collect_as=None):
    """``pytest`` over ``files`` (name -> text) beside a copy of tests/conftest.py, in a process of its own:
    (exit code, output, whether the cpu_only module was imported)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    shutil.copy(tests / "conftest.py", tmp_path / "conftest.py")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    marker = tmp_path / "imported.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("KVLIB_TEST_COLLECT_AS", "KVLIB_TEST_DEVICE")}
    env["KVLIB_TEST_IMPORTED"] = str(marker)
    if collect_as:
        env["KVLIB_TEST_COLLECT_AS"] = collect_as
    run = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    return run.returncode, run.stdout + run.stderr, marker.exists()


@pytest.mark.parametrize("text, says", [
    ("def test_forgot():\n    pass\n",
     r"test_new\.py::test_forgot: marked neither `device` nor `cpu_only`(.|\n)*choose one of the two markers: "
     r"@pytest\.mark\.device .*@pytest\.mark\.cpu_only\("),
    ("import pytest\n\n@pytest.mark.cpu_only('  ')\ndef test_says_nothing():\n    pass\n",
     r"test_new\.py::test_says_nothing: cpu_only needs a non-empty reason"),
    ("import pytest\npytestmark = pytest.mark.cpu_only('the moon')\n\n@pytest.mark.device\ndef test_contradicts(device):\n"
     "    pass\n",
     r"test_new\.py::test_contradicts: marked `device` in a module that is cpu_only as a whole"),
], ids=["neither marker", "an empty reason", "device inside a cpu_only module"])
def test_a_test_that_does_not_say_where_it_runs_fails_to_collect(tmp_path, text, says):
    """On every run (the CPU too), so a new test file must choose; the others still collect and pass."""
    import re

    rc, out, _ = run_tree(tmp_path, {"test_marked_device.py": TREE["test_marked_device.py"], "test_new.py": text})
    assert rc == 2 and "ERROR collecting test_new.py" in out and "1 error during collection" in out, out[-3000:]
    assert re.search(says, out), out[-3000:]


def test_collected_as_for_cuda_a_cpu_only_module_is_not_imported_but_listed_with_its_reason(tmp_path):
    rc, out, imported = run_tree(tmp_path, TREE, collect_as="cuda")
    assert rc == 0, out[-3000:]
    assert not imported, "the cpu_only module was imported: the GPU machine may lack what it imports"
    assert "cpu_only modules not collected (--device cuda)" in out, out[-3000:]
    assert "test_whole_module_cpu_only.py: builds the moon (nbformat)" in out, out[-3000:]
    assert "1 module(s) not collected: CPU-only as a whole" in out, out[-3000:]
    # a mixed module is collected: its cpu_only test is skipped with its reason, the device test runs
    assert "2 passed, 1 skipped" in out, out[-3000:]
    assert "cpu_only: reads the moon's weights, which the GPU machine lacks" in out, out[-3000:]


def test_on_the_cpu_every_test_runs_the_cpu_only_ones_too(tmp_path):
    rc, out, imported = run_tree(tmp_path, TREE)
    assert rc == 0 and imported and "4 passed" in out, out[-3000:]
    assert "skipped" not in out and "not collected" not in out, out[-3000:]


def test_without_nbval_the_suite_still_starts(tmp_path):
    """pyproject's addopts carry nbval's options; the GPU machine has no nbval. The conftest accepts
    them there, so ``pytest --device cuda tests`` needs no ``-o addopts=``. Emulated with ``-p no:nbval``."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parent.parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:nbval", "tests/test_padding.py"],
                         capture_output=True, text=True, cwd=repo, timeout=300)
    assert run.returncode == 0 and "unrecognized arguments" not in run.stderr, run.stdout[-2000:] + run.stderr[-2000:]
