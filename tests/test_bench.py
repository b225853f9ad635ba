import json
import os
import re

import numpy as np
import pytest
import torch

import kvbench
from kvlib import prepack

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")


def test_load_average_is_none_where_the_os_has_none(monkeypatch):
    monkeypatch.delattr(os, "getloadavg", raising=False)  # Windows has no os.getloadavg
    assert kvbench.load_average() is None
    m = kvbench.machine_info(2)
    assert m["loadavg_start"] is None
    assert "n/a at start, n/a at end" in kvbench.header(m | {"loadavg_end": None})

    def unavailable():
        raise OSError("load average unobtainable")

    monkeypatch.setattr(os, "getloadavg", unavailable, raising=False)
    assert kvbench.load_average() is None


def test_header_shows_the_load_average(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 0.5), raising=False)
    m = kvbench.machine_info(2) | {"loadavg_end": kvbench.load_average()}
    assert m["loadavg_start"] == 1.5 and "1.50 at start, 1.50 at end" in kvbench.header(m)


def test_json_keeps_ints_as_ints():
    r = {"bytes": 123, "ms": 1.5, "identical": True, "measured": None, "contexts": (16, 64),
         "rows": [{"n": 3}], "np": np.int64(7), "t": torch.tensor(2.5)}
    out = json.loads(json.dumps(kvbench.json_ready(r)))
    assert out == {"bytes": 123, "ms": 1.5, "identical": True, "measured": None, "contexts": [16, 64],
                   "rows": [{"n": 3}], "np": 7, "t": 2.5}
    assert type(out["bytes"]) is int and type(out["rows"][0]["n"]) is int and type(out["np"]) is int
    assert type(out["identical"]) is bool and type(out["ms"]) is float
    assert '"bytes": 123,' in json.dumps(kvbench.json_ready(r))
    with pytest.raises(TypeError, match="cannot write"):
        kvbench.json_ready({"x": object()})


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        kvbench.main(["--threads", "0"])
    assert "--threads must be a positive int, got 0" in capsys.readouterr().err


@pytest.mark.smollm2
def test_quick_bench_runs_end_to_end(tmp_path):
    """``python -m kvbench --quick`` runs every section and writes JSON (a smoke test, no timing claims)."""
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    try:
        assert kvbench.main(["--quick", "--threads", "1", "--json", str(out)]) == 0  # 0: every token sequence agreed
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert set(r) >= {"machine", "generation", "decode", "hf", "hf_bf16", "roofline", "same_bytes", "precision",
                      "split_kv", "targets"}
    packed = {"bf16 packed"} if prepack.available() else set()  # only where oneDNN has a bf16 path
    assert set(r["precision"]) == {"fp32", "bf16", "int8", "int4"} | packed
    default = "bf16" if os.environ.get(prepack.ENV) == "0" else (packed or {"bf16"}).pop()
    assert r["precision"]["fp32"]["bf16_default"] == default  # what load_smollm2(dtype=bf16) gives here
    assert r["precision"]["fp32"]["agreement"] == 1.0 and r["precision"]["bf16"]["agreement_bf16"] == 1.0
    assert set(r["attention"]) == {str(c) for c in kvbench.QUICK.attention_contexts} and set(r["threads"]) >= {"1"}
    speed = ("decode / bare", "bf16 (", "bf16 decode speedup", "int8 decode", "int4 decode", "attention at")
    assert all(t["why"] for t in r["targets"] if t["pass"] is False and t["claim"].startswith(speed))
    assert all(g["identical"] for g in r["generation"].values()) and r["hf"]["identical"]
    assert type(r["roofline"][f"decode_ctx{kvbench.QUICK.contexts[0]}"]["bytes"]) is int  # ints stay ints


def test_the_stored_bench_record_is_a_full_run():
    """kvbench.load_record() is what `python -m kvbench --compile --json` wrote: every section, the
    machine it ran on, and token sequences that agreed (a record with differing tokens must not be shipped)."""
    from kvbench import load_record

    r = load_record()
    assert set(r) >= {"machine", "generation", "decode", "hf", "hf_bf16", "same_bytes", "precision", "split_kv",
                      "compile", "targets"}
    assert r["machine"]["threads"] == 2 and r["machine"]["date"]
    assert all(g["identical"] for g in r["generation"].values()) and r["hf"]["identical"]
    with pytest.raises(ValueError, match="no stored bench record 'gpu'"):
        load_record("gpu")


def test_bare_matvecs_refuses_what_it_cannot_time():
    from kvlib import ModelConfig, Transformer
    from kvbench import bare_matvecs
    from kvlib.wquant import quantize_weights

    cfg = ModelConfig(n_layer=1, n_head=2, n_kv_head=1, d_model=32, d_ff=64, vocab_size=64, max_seq_len=32)
    model = Transformer(cfg)
    assert bare_matvecs(model, repeats=0) > 0  # one sweep
    with pytest.raises(ValueError, match="repeats must be an int >= 0, got -1"):
        bare_matvecs(model, repeats=-1)
    with pytest.raises(TypeError, match="kvlib.wquant layers"):
        bare_matvecs(quantize_weights(model, "int8"), repeats=0)


def test_every_target_chapter_11_makes_says_why_when_it_misses():
    """A miss of a speed target carries the measured bound behind it; a pass carries none."""
    from kvbench import load_record

    r = load_record()
    speed = ("decode / bare", "bf16 (", "bf16 decode speedup", "int8 decode", "int4 decode", "attention at",
             "kvlib Engine")
    for t in r["targets"]:
        if t["claim"].startswith(speed) and t["pass"] is False:
            assert re.search(r"\d+\.\d", t["why"] or ""), t  # a measured figure, not a phrase
        if t["pass"] is True:
            assert t["why"] is None, t
    names = {t["claim"].split(" >=")[0].split(" <=")[0] for t in r["targets"]}
    assert "kvlib best decode / llama.cpp on the same weights" in names


def test_the_engine_targets_read_the_engine_as_vllm_runs_it_where_measured():
    """With both levers measured, the >= 1.0 target reads the packed and compiled Engine, and the
    pause target the packed Engine's pause; the report shows both rows. Without, the older fields."""
    import copy

    from kvbench import load_record
    from kvbench.plan import FULL
    from kvbench.report import table_rows, targets

    r = copy.deepcopy(load_record())
    claim = lambda ts, start: next(t for t in ts if t["claim"].startswith(start))  # noqa: E731
    before = targets(r, FULL)
    assert claim(before, "kvlib Engine, fp32")["measured"] == r["serving"]["vs_compiled_packed"]
    v = r["serving"]
    v |= {"kvlib_packed_compiled_tok_s": 123.0, "packed_compiled_vs_eager": 1.27, "compile_s_packed_compiled": 2.5,
          "vs_compiled_packed_compiled": 0.61, "identical_requests_packed_compiled": v["requests"]}
    r["chunked_packed"] = dict(r["chunked"], max_pause_ms=0.5 * r["chunked_masked"]["max_pause_ms"])
    after = targets(r, FULL)
    assert claim(after, "kvlib Engine, fp32")["measured"] == 0.61
    pause = claim(after, "longest pause")
    assert pause["measured"] == 0.5 and pause["pass"] is True and "prepacked" in pause["claim"]
    v["identical_requests_packed_compiled"] -= 1  # a request whose tokens differ fails the target
    assert claim(targets(r, FULL), "kvlib Engine, fp32")["pass"] is False
    rows = [" ".join(map(str, row)) for row in table_rows(r, FULL)]
    assert any("prepacked and compiled / plain" in row and "123.0 tok/s" in row for row in rows)
    assert any("varlen, fp32 prepacked / masked row" in row and "0.50x" in row for row in rows)
