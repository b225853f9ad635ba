"""The GPU record's format (``kv-bench-gpu/1``): what `kvbench.check_gpu_record` accepts and refuses,
and `kvbench.load_gpu_record` (None while no GPU has written the record).

The record here is synthetic, built in the test from the format's description (SCHEMA): no file
is committed as if measured, and these numbers are nobody's measurement.
"""

import copy
import json

import pytest

from kvbench import gpurecord
from kvbench.gpurecord import FORMAT, check_gpu_record, load_gpu_record

pytestmark = pytest.mark.cpu_only("pure Python: formulas, tables and simulations with no tensors on a device")


def shape(n_layer: int) -> dict:
    return {
        "config": {"n_layer": n_layer, "n_head": 32, "n_kv_head": 8, "d_model": 4096, "d_ff": 14336,
                   "vocab_size": 128256},
        "dtype": "bf16", "weight_bytes": 16_060_522_496,
        "decode": [{"batch": b, "context": 1024, "step_s": 0.01, "bytes_read": 10**10, "bandwidth_bytes_s": 1e12,
                    "hbm_fraction": 0.5, "graphs_step_s": None, "graphs_error": "synthetic"} for b in (1, 32)],
        "attention": [{"context": c, "batch": 1, "backend": "flash", "step_s": 0.001, "bytes_read": 10**9,
                       "bandwidth_bytes_s": 1e12} for c in (4096, 32768)],
        "paged": {"context": 4096, "batch": 8, "block_size": 16, "contiguous_step_s": 0.001,
                  "paged_step_s": 0.002, "ratio": 2.0},
        "prefill": {"tokens": 2048, "step_s": 0.1, "flops": 10**13, "flop_s": 1e14},
        "roofline": {"predicted_step_s": 0.01, "measured_step_s": 0.01, "ratio": 1.0, "band": [0.8, 1.25],
                     "within": True, "hardware": "measured"},
    }


def synthetic() -> dict:
    return {
        "format": FORMAT,
        "machine": {"gpu": "a synthetic GPU", "capability": "9.0", "memory_bytes": 85_899_345_920,
                    "driver": "0.0", "cuda": "0.0", "torch": "0.0", "python": "3.12.0", "date": "2026-12-05",
                    "tf32": False},
        "suite": {"passed": 10, "failed": 0, "skipped": 2, "errors": 0, "seconds": 1.0,
                  "command": "python -m pytest --device cuda -q tests"},
        "hbm": {"copy_bytes": 2**31, "bandwidth_bytes_s": 2e12, "spec_bytes_s": None},
        "shapes": {"smollm2-135m": shape(30), "llama-3.1-8b": shape(32)},
        "targets": [
            {"name": "decode_b1_hbm_fraction", "shape": "llama-3.1-8b", "value": 0.5, "target": 0.6, "met": False,
             "reason": "decode at batch 1 read 1,000 GB/s, 50% of the 2,000 GB/s the HBM copies at"},
            {"name": "roofline_within_band", "shape": "llama-3.1-8b", "value": 1.0, "band": [0.8, 1.25],
             "met": True, "reason": None},
        ],
        "seconds": 60.0,
    }


def test_a_record_with_every_part_is_accepted():
    r = synthetic()
    assert check_gpu_record(r) is r


def edited(edit) -> dict:
    r = copy.deepcopy(synthetic())
    edit(r)
    return r


@pytest.mark.parametrize("edit, words", [
    (lambda r: r.update(format="kv-bench-cpu/1"), "not a GPU record: format 'kv-bench-cpu/1'"),
    (lambda r: r.pop("format"), "not a GPU record: format None"),
    (lambda r: r.pop("hbm"), "the record lacks ['hbm']"),
    (lambda r: r["machine"].pop("driver"), "machine lacks ['driver']"),
    (lambda r: r["suite"].pop("skipped"), "suite lacks ['skipped']"),
    (lambda r: r["hbm"].pop("bandwidth_bytes_s"), "hbm lacks ['bandwidth_bytes_s']"),
    (lambda r: r["shapes"].pop("llama-3.1-8b"), "shape 'llama-3.1-8b' lacks ['config'"),
    (lambda r: r["shapes"]["smollm2-135m"].pop("roofline"), "shape 'smollm2-135m' lacks ['roofline']"),
    (lambda r: r["shapes"]["llama-3.1-8b"]["decode"][1].pop("hbm_fraction"),
     "shape 'llama-3.1-8b' decode[1] lacks ['hbm_fraction']"),
    (lambda r: r["shapes"]["llama-3.1-8b"]["attention"][0].pop("backend"),
     "shape 'llama-3.1-8b' attention[0] lacks ['backend']"),
    (lambda r: r["shapes"]["llama-3.1-8b"]["paged"].pop("ratio"), "shape 'llama-3.1-8b' paged lacks ['ratio']"),
    (lambda r: r["shapes"]["llama-3.1-8b"]["roofline"].pop("band"), "roofline lacks ['band']"),
    (lambda r: r["shapes"]["llama-3.1-8b"]["decode"][1].update(batch=8),
     "shape 'llama-3.1-8b' has decode at batches [1, 8], expected [1, 32]"),
    (lambda r: r["shapes"]["smollm2-135m"]["decode"].pop(), "has decode at batches [1], expected [1, 32]"),
    (lambda r: r["targets"].pop(), "targets ['decode_b1_hbm_fraction'], expected"),
    (lambda r: r["targets"][0].update(reason=None), "'decode_b1_hbm_fraction' is not met and gives no reason"),
    (lambda r: r["targets"][0].update(reason="  "), "'decode_b1_hbm_fraction' is not met and gives no reason"),
    (lambda r: r["targets"][1].pop("met"), "target 'roofline_within_band' lacks ['met']"),
])
def test_a_record_missing_what_the_book_reads_is_refused_by_name(edit, words):
    with pytest.raises(ValueError) as e:
        check_gpu_record(edited(edit))
    assert words in str(e.value)


def test_a_failed_section_keeps_its_keys_and_is_accepted():
    """A section that failed on the GPU holds None for each number and an ``error``: still a record."""
    def fail(r):
        r["shapes"]["llama-3.1-8b"]["paged"] = dict.fromkeys(gpurecord.PART_KEYS["paged"]) | {"error": "OOM"}
    check_gpu_record(edited(fail))


def test_not_a_dict_is_a_type_error():
    with pytest.raises(TypeError, match="a GPU record is a dict"):
        check_gpu_record([synthetic()])


def test_load_gpu_record_is_none_while_no_gpu_has_written_it(tmp_path):
    assert load_gpu_record(tmp_path / "bench_gpu.json") is None


def test_load_gpu_record_reads_and_checks_a_file(tmp_path):
    path = tmp_path / "bench_gpu.json"
    path.write_text(json.dumps(synthetic()), encoding="utf-8")
    assert load_gpu_record(path) == synthetic()
    path.write_text(json.dumps(edited(lambda r: r.pop("suite"))), encoding="utf-8")
    with pytest.raises(ValueError, match=r"the record lacks \['suite'\]"):
        load_gpu_record(path)


def test_the_default_record_lives_beside_the_cpu_record():
    assert gpurecord.RECORD.parent.name == "data" and gpurecord.RECORD.parent.parent.name == "kvbench"
    assert gpurecord.RECORD.name == "bench_gpu.json"
