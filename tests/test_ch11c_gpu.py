"""Page 11B, Decode on a GPU (book/ch11c_gpu.ipynb), with and without a GPU record.

At this build no GPU has run `make gpucheck`, so `kvbench.load_gpu_record()` is None and the page
shows its predictions alone. The page's record cell must also work once a record exists: here it
runs on a synthetic record in the format of kvbench.gpurecord (kv-bench-gpu/1), built in the test
and never written where the book would read it as measured."""

import contextlib
import io
import json
from pathlib import Path

import matplotlib
import pytest
import torch

import kvbench
from kvbench.gpurecord import check_gpu_record
from kvlib import PRESETS, cost

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "ch11c_gpu.ipynb"
GPU = "NVIDIA H200 (synthetic, for a test)"


def _shape(config_key: str, step_s: dict[int, float], graphs_s: dict[int, float | None]) -> dict:
    """One shape of a record, its bytes counted as kvlib counts them (bf16, context 1024)."""
    c = PRESETS[config_key]
    hbm = 4.3e12
    decode = []
    for b in (1, 32):
        read = cost.step_bytes(c, b, 1024, dtype="bf16")["total"]
        decode.append({"batch": b, "context": 1024, "step_s": step_s[b], "bytes_read": read,
                       "bandwidth_bytes_s": read / step_s[b], "hbm_fraction": read / step_s[b] / hbm,
                       "graphs_step_s": graphs_s[b]})
    return {"config": {"n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
                       "d_model": c.d_model, "d_ff": c.d_ff, "vocab_size": c.vocab_size},
            "dtype": "bf16", "weight_bytes": 0, "decode": decode,
            "attention": [{"context": 4096, "batch": 1, "backend": "flash", "step_s": 1e-4,
                           "bytes_read": 1, "bandwidth_bytes_s": 2.5e12},
                          {"context": 32768, "batch": 1, "backend": "efficient", "step_s": 1e-3,
                           "bytes_read": 1, "bandwidth_bytes_s": 3.5e12}],
            "paged": {"context": 4096, "batch": 8, "block_size": 16, "contiguous_step_s": 1e-3,
                      "paged_step_s": 1.1e-3, "ratio": 1.1},
            "prefill": {"tokens": 2048, "step_s": 0.1, "flops": 1, "flop_s": 1e14},
            "roofline": {"predicted_step_s": 3e-3, "measured_step_s": 4e-3, "ratio": 1.33,
                         "band": [0.8, 2.0], "within": True, "hardware": "measured"}}


def synthetic_record() -> dict:
    """A record as SCHEMA.md lays it out, with made-up times (never a measurement)."""
    return check_gpu_record({
        "format": "kv-bench-gpu/1",
        "machine": {"gpu": GPU, "capability": "9.0", "memory_bytes": 150_000_000_000, "driver": "570.00",
                    "cuda": "13.0", "torch": "2.11.0+cu130", "python": "3.12.0", "date": "2026-12-31",
                    "tf32": False},
        "suite": {"passed": 1, "failed": 0, "skipped": 0, "errors": 0, "seconds": 1.0,
                  "command": "python -m pytest --device cuda -q tests"},
        "hbm": {"copy_bytes": 2**30, "bandwidth_bytes_s": 4.3e12, "spec_bytes_s": 4.8e12},
        "shapes": {"smollm2-135m": _shape("smollm2-135m", {1: 4.1e-3, 32: 4.7e-3}, {1: 1.5e-4, 32: None}),
                   "llama-3.1-8b": _shape("llama-3-8b", {1: 5.3e-3, 32: 6.9e-3}, {1: 4.9e-3, 32: 6.4e-3})},
        "targets": [{"name": "decode_b1_hbm_fraction", "shape": "llama-3.1-8b", "value": 0.66,
                     "target": 0.6, "met": True, "reason": None},
                    {"name": "roofline_within_band", "shape": "llama-3.1-8b", "value": 1.33,
                     "band": [0.8, 2.0], "met": True, "reason": None}],
        "seconds": 500.0,
    })


def run_cells(ids: tuple[str, ...], record: dict | None, monkeypatch) -> tuple[dict, str]:
    """Execute the page's cells ``ids`` in order, with ``kvbench.load_gpu_record`` returning
    ``record``: the namespace they leave, and what they printed."""
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(PAGE.read_text())["cells"]}
    monkeypatch.setattr(kvbench, "load_gpu_record", lambda path=None: record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ns: dict = {}
    out = io.StringIO()
    threads, grad, rng = torch.get_num_threads(), torch.is_grad_enabled(), torch.get_rng_state()
    try:
        with contextlib.redirect_stdout(out):
            for cid in ids:
                exec(compile(cells[cid], f"{PAGE.name}:{cid}", "exec"), ns)
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)  # kvbook.setup() seeds torch: put the generator back
    return ns, out.getvalue()


CELLS = ("imports", "predict", "record")


def test_the_synthetic_record_has_the_schemas_form():
    record = synthetic_record()
    assert set(record["shapes"]) == set(kvbench.gpurecord.SHAPES)
    with pytest.raises(ValueError):  # and the check refuses one with a key gone
        bad = synthetic_record()
        del bad["shapes"]["llama-3.1-8b"]["decode"]
        check_gpu_record(bad)


def test_without_a_record_the_page_says_so_and_shows_no_measurement(monkeypatch):
    ns, out = run_cells(CELLS, None, monkeypatch)
    assert "GPU record: False" in out
    assert "measured" not in ns and "measured on:" not in out  # nothing presented as measured


def test_with_a_record_the_page_sets_each_measured_step_beside_kvlibs_count(monkeypatch):
    record = synthetic_record()
    ns, out = run_cells(CELLS, record, monkeypatch)
    assert "GPU record: True" in out and f"measured on: {GPU}" in out
    rows = ns["measured"]
    assert len(rows) == 4 and {r["GPU"] for r in rows} == {GPU}  # every row labelled with its GPU
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("SmolLM2-135M", 1), ("SmolLM2-135M", 32), ("Llama-3-8B", 1), ("Llama-3-8B", 32)]
    l3 = rows[2]
    assert l3["measured µs"] == pytest.approx(5.3e-3 * 1e6)  # the record's step, not a model's
    want = cost.step_bytes(PRESETS["llama-3-8b"], 1, 1024, dtype="bf16")["total"]
    assert l3["kvlib MB"] == pytest.approx(want / 1e6)  # kvlib's own count, beside the record's
    assert l3["HBM floor µs"] == pytest.approx(want / 4.3e12 * 1e6)  # bytes / measured copy bandwidth
    assert l3["HBM fraction"] == pytest.approx(record["shapes"]["llama-3.1-8b"]["decode"][0]["hbm_fraction"])
    assert l3["graph µs"] == pytest.approx(4.9e3)
    assert rows[1]["graph µs"] != rows[1]["graph µs"]  # a failed capture (None): nan, not a number
    assert {(b["tokens"], b["backend"]) for b in ns["backends"]} >= {(4096, "flash"), (32768, "efficient")}


def test_the_page_is_in_the_toc_as_a_section_of_chapter_11():
    toc = (ROOT / "_toc.yml").read_text()
    assert toc.index("book/ch11_decode_fast") < toc.index("book/ch11b_weight_formats") < toc.index(
        "book/ch11c_gpu") < toc.index("book/ch12_serving")
