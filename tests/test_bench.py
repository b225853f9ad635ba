import json

import pytest
import torch

from kvlib import bench


def test_timeit_reports_the_median():
    calls = []
    t = bench.timeit(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and len(t["all"]) == 5 and min(t["all"]) == t["min"] <= t["median"]
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        bench.timeit(lambda: None, repeats=0)


def test_matvec_bandwidth_measures_both_layouts():
    r = bench.matvec_bandwidth(64, 32, count=3, repeats=2)
    assert set(r) == {"in_out", "out_in"} and all(v > 0 for v in r.values())
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        bench.matvec_bandwidth(0, 3)


@pytest.mark.smollm2
def test_quick_bench_runs_end_to_end(tmp_path):
    """``python -m kvlib.bench --quick`` runs every section and writes JSON (a smoke test, no timing claims)."""
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    try:
        assert bench.main(["--quick", "--threads", "1", "--json", str(out)]) == 0  # 0: every token sequence agreed
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert set(r) >= {"machine", "generation", "decode", "hf", "roofline", "targets"}
    assert all(g["identical"] for g in r["generation"].values()) and r["hf"]["identical"]
