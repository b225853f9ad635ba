"""The vLLM cross-check: its arithmetic, its comparisons, and the record the book reads.

vLLM itself runs in CI through `make crosscheck` (its own environment); these tests
need only the stored record, so they run everywhere.
"""

import copy
import json

import pytest

from kvlib.config import PRESETS
from vllmcheck import capacity_line, compare, load_record, vllm_python
from kvlib.memory import pool_capacity

pytestmark = pytest.mark.cpu_only("runs vLLM/kvpress records (vllmcheck, kvpresscheck)")

SMOLLM2 = PRESETS["smollm2-135m"]
CHECKS = {  # every comparison issue 27 asks for, by the name the record gives it
    "mixed: capacity", "small: capacity", "tokens", "prefix caching: cached tokens per request",
    "prefix caching: tokens", "chunked prefill: step of each first token", "chunked prefill: tokens",
    "preemption: count", "preemption: tokens", "fp8 cache: agreement with fp32", "n-gram speculation: tokens",
    "n-gram speculation: accepted/proposed", "throughput", "compiled: tokens", "serving: tokens",
    "serving: cached tokens", "serving: preemptions", "schedule: engine steps per phase",
}


@pytest.fixture(scope="module")
def record():
    return load_record()


def test_the_pool_arithmetic_gives_vllms_own_line():
    """vLLM 0.32 printed, for SmolLM2 in fp32 with 1 GiB, block size 32 and max_model_len 1024:
    'CPU KV cache size: 23,296 tokens, Maximum concurrency for 1,024 tokens per request: 22.75x'
    (tried by hand on 2026-12-01, before kvlib had this function)."""
    blocks, tokens, conc = pool_capacity(SMOLLM2, 2**30, 1024, 32, "fp32")
    assert (blocks, tokens, f"{conc:.2f}") == (728, 23_296, "22.75")
    line = "CPU KV cache size: 23,296 tokens, Maximum concurrency for 1,024 tokens per request: 22.75x"
    assert capacity_line(line) == (23_296, 1024, 22.75)


@pytest.mark.parametrize("kwargs, error", [
    ({"memory_bytes": -1}, ValueError), ({"max_len": 0}, ValueError), ({"block_size": 0}, ValueError),
    ({"dtype": "fp9"}, ValueError), ({"memory_bytes": 1.5}, TypeError),
])
def test_the_pool_arithmetic_refuses_bad_input(kwargs, error):
    args = {"memory_bytes": 2**30, "max_len": 1024, "block_size": 32, "dtype": "fp32", **kwargs}
    with pytest.raises(error):
        pool_capacity(SMOLLM2, **args)


def test_a_line_that_is_not_the_capacity_line_is_refused():
    with pytest.raises(ValueError, match="not vLLM's capacity line"):
        capacity_line("Using LBHNC KV cache layout.")


def test_the_stored_record_has_every_check_and_none_failed(record):
    checks = {c["name"]: c for c in record["checks"]}
    assert CHECKS <= set(checks), CHECKS - set(checks)
    bad = {n: c for n, c in checks.items() if c["status"] not in ("pass", "report")}
    assert not bad
    assert all(c["detail"] for c in checks.values())  # a report always says why
    for name in ("tokens", "prefix caching: cached tokens per request", "chunked prefill: step of each first token",
                 "preemption: tokens", "mixed: capacity"):
        assert checks[name]["status"] == "pass", name


def test_the_record_holds_both_engines_for_every_scenario(record):
    names = {s["name"] for s in record["scenarios"]}
    assert names == {"mixed", "small", "fp8", "ngram", "compiled", "serving"}
    assert set(record["vllm"]) == names and {"mixed", "small", "fp8", "ngram", "serving"} <= set(record["kvlib"])
    assert all("error" not in record["vllm"][n] for n in ("mixed", "small"))


def test_the_record_capacity_line_is_what_kvlib_memory_computes(record):
    """Recomputed here from the settings the record ran with, not copied from it."""
    for s in record["scenarios"]:
        if s["name"] not in ("mixed", "small", "serving"):
            continue
        llm = s["llm"]
        line = next(ln for ln in record["vllm"][s["name"]]["log"] if "Maximum concurrency" in ln)
        tokens, max_len, conc = capacity_line(line)
        blocks, want_tokens, want_conc = pool_capacity(SMOLLM2, llm["kv_cache_memory_bytes"], llm["max_model_len"],
                                                       llm["block_size"], "fp32")
        assert (tokens, max_len, conc) == (want_tokens, llm["max_model_len"], round(want_conc, 2))
        assert record["vllm"][s["name"]]["cache_config"]["num_gpu_blocks"] == blocks


# -- compare(), on a record it must judge: a mutant of the stored one ---------------------------------
def _checks(record, mutate=None):
    r = copy.deepcopy(record)
    if mutate:
        mutate(r)
    return {c.name: c.status for c in compare(SMOLLM2, r["scenarios"], r["vllm"], r["kvlib"])}


def test_compare_passes_the_stored_record_as_it_was_judged(record):
    assert _checks(record) == {c["name"]: c["status"] for c in record["checks"]}


def _first(r, side, scenario, phase=0):
    reqs = r[side][scenario]["phases"][phase]["requests"]
    return reqs[sorted(reqs)[0]]


@pytest.mark.parametrize("mutate, check", [
    (lambda r: _first(r, "kvlib", "mixed")["tokens"].__setitem__(3, 0), "tokens"),
    (lambda r: _first(r, "vllm", "mixed", 2).__setitem__("cached_tokens", 7),
     "prefix caching: cached tokens per request"),
    (lambda r: _first(r, "kvlib", "small").__setitem__("first_step", 99), "chunked prefill: step of each first token"),
    (lambda r: _first(r, "vllm", "small", 1)["tokens"].pop(), "preemption: tokens"),
    (lambda r: r["kvlib"]["small"]["phases"][1]["counters"].__setitem__("preemptions", 0), "preemption: count"),
    (lambda r: r["vllm"]["mixed"]["cache_config"].__setitem__("num_gpu_blocks", 727), "mixed: capacity"),
    (lambda r: r["vllm"]["mixed"].__setitem__("error", "ValueError: no"), "mixed: vLLM starts"),
    (lambda r: r["kvlib"]["small"]["phases"][1].__setitem__("steps", 141), "schedule: engine steps per phase"),
])
def test_compare_fails_a_record_where_the_engines_disagree(record, mutate, check):
    assert _checks(record, mutate)[check] == "fail"


def test_the_vllm_environment_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLIB_VLLM_PYTHON", "off")
    assert vllm_python() is None
    monkeypatch.setenv("KVLIB_VLLM_PYTHON", str(tmp_path / "python"))
    assert vllm_python() == tmp_path / "python"


def test_against_a_record_finds_what_moved(record):
    """`--against`: a token, a hit or a first step that moved between two runs is named; timings are not."""
    from vllmcheck.__main__ import _facts

    same = copy.deepcopy(record)
    same["vllm"]["mixed"]["phases"][0]["seconds"] *= 2  # a timing: not a fact
    assert _facts(same) == _facts(record)
    moved = copy.deepcopy(record)
    _first(moved, "vllm", "serving", 1)["cached_tokens"] += 32
    assert {k for k in _facts(record) if _facts(record)[k] != _facts(moved).get(k)} == {
        ("vllm", "serving", 1, sorted(moved["vllm"]["serving"]["phases"][1]["requests"])[0])}


def test_kvlibs_fp8_rows_are_compared_by_count_across_machines(record):
    """kvlib's FP8 tokens part between CPUs (an AVX-512 EPYC parted 2 of 8 rows from the record's machine):
    their count is a fact, their values are not; vLLM's FP8 rows and every fp32 row still are."""
    from vllmcheck.__main__ import _facts

    other_cpu = copy.deepcopy(record)
    _first(other_cpu, "kvlib", "fp8", 0)["tokens"][5] += 1
    assert _facts(other_cpu) == _facts(record)
    shorter = copy.deepcopy(record)
    _first(shorter, "kvlib", "fp8", 0)["tokens"].pop()
    assert _facts(shorter) != _facts(record)
    for side, name in (("vllm", "fp8"), ("kvlib", "mixed")):
        moved = copy.deepcopy(record)
        _first(moved, side, name, 0)["tokens"][5] += 1
        assert _facts(moved) != _facts(record), (side, name)


def test_a_scenario_vllm_refused_here_is_left_out_and_nothing_else(record):
    """A CPU without AVX-512 or AMX: vLLM refuses its FP8 cache, so that scenario cannot be compared with a
    record made where it ran; every other fact still is, and a report's status never is."""
    from vllmcheck.__main__ import _facts, refused

    here = copy.deepcopy(record)
    here["vllm"]["fp8"] = {"error": "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."}
    for c in here["checks"]:
        if c["name"].startswith("fp8"):
            c["name"], c["status"] = "fp8 cache", "report"
    skip = refused(here)
    assert skip == {"fp8"} and not refused(record)
    assert _facts(here, skip) == _facts(record, skip)
    assert _facts(here) != _facts(record)  # without the skip the missing run shows
    _first(here, "kvlib", "mixed", 0)["tokens"][0] += 1  # a fact elsewhere still counts
    assert _facts(here, skip) != _facts(record, skip)


def test_the_command_says_how_to_get_vllm_when_there_is_none(monkeypatch, capsys):
    from vllmcheck.__main__ import main

    monkeypatch.setenv("KVLIB_VLLM_PYTHON", "off")
    assert main([]) == 2
    assert "make vllm" in capsys.readouterr().err


def test_settle_writes_the_record_and_names_what_moved(tmp_path, capsys):
    """Every runner's last step: the record written, then compared fact by fact with the stored one."""
    from vllmcheck import settle

    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps({"tokens": [1, 2, 3], "seconds": 9.0}))
    facts = lambda r: {"tokens": tuple(r["tokens"])}  # noqa: E731 - timings are not facts
    failed: list[str] = []
    settle({"tokens": [1, 2, 3], "seconds": 1.0}, tmp_path / "out" / "new.json", stored, facts, failed)
    assert failed == [] and json.loads((tmp_path / "out" / "new.json").read_text())["seconds"] == 1.0
    settle({"tokens": [1, 2, 4], "seconds": 9.0}, None, stored, facts, failed)
    assert failed == ["against the stored record"] and "tokens" in capsys.readouterr().err
