"""vLLM past one process (`vllmcheck.distributed`): the stored record, judged here.

vLLM itself runs only behind ``make distcheck`` (its own environment); these tests need only
the record (``vllmcheck/data/vllm_distributed_cpu.json``), so they run everywhere. What they
recompute rather than read: kvlib's greedy tokens for the record's prompts, vLLM's refusal
rule, each rank's pool from the cache-size arithmetic, and the disk connector's bytes.
"""

import copy
import dataclasses
import json
import math
import os
import re
import sys
import time

import pytest
import torch

import kvlib
from kvlib.config import PRESETS
from vllmcheck import capacity_line
from vllmcheck.distributed import (
    _log_lines, checks, facts, load_record, loaded, main, outcome, reason, run_scenario,
)
from kvlib.memory import kv_bytes_per_token, pool_capacity

pytestmark = pytest.mark.cpu_only("runs vLLM/kvpress records (vllmcheck, kvpresscheck)")

SMOLLM2 = PRESETS["smollm2-135m"]
OUTCOMES = {"ran", "refused", "failed serving", "timed out", "crashed"}


@pytest.fixture(scope="module")
def record():
    return load_record()


@pytest.fixture(scope="module")
def scenarios(record):
    return {s["name"]: s for s in record["scenarios"]}


@pytest.fixture(scope="module")
def smollm2():
    model, _ = kvlib.load_smollm2()  # fp32, one process
    return model


@pytest.fixture(scope="module")
def kvlib_rows(scenarios, smollm2):
    """kvlib's tokens for tp3's prompts, computed here (never read from the record)."""
    s = scenarios["tp3"]
    return [greedy(smollm2, p, s["max_tokens"]) for p in s["prompts"]]


def greedy(model, prompt, n):
    """kvlib's greedy continuation of one prompt, alone (no padding), in fp32."""
    ids = torch.tensor([prompt])
    return kvlib.generate(model, ids, n, temperature=0.0)[0, len(prompt):].tolist()


def rows_that_differ(vllm_rows, kvlib_rows):
    return [i for i, (a, b) in enumerate(zip(vllm_rows, kvlib_rows, strict=True)) if a != b]


# -- tensor parallelism: size 3 runs, and its tokens are one process's ------------------------------
def test_tp3_ran_on_three_ranks(record, scenarios):
    r = record["vllm"]["tp3"]
    assert outcome(r) == "ran", r.get("error")
    assert scenarios["tp3"]["llm"]["tensor_parallel_size"] == 3
    assert r["parallel_config"] == {"tensor_parallel_size": 3, "distributed_executor_backend": "mp", "world_size": 3}
    assert SMOLLM2.n_kv_head % 3 == 0 and SMOLLM2.n_head % 3 == 0  # one KV head, three query heads per rank


def test_tp3_tokens_equal_kvlib_single_process(record, kvlib_rows):
    """Greedy fp32 tokens, vLLM over three ranks against kvlib in one process: the all-reduce sums
    each layer's three partial outputs in another order than one matmul does, so logits differ in
    the last bits; 16 tokens of these prompts have no near-tie for that to flip (an exact match is
    what was measured, and what is asserted)."""
    theirs = record["vllm"]["tp3"]["passes"][0]["tokens"]
    assert len(kvlib_rows) == 4 and all(len(t) == 16 for t in theirs)
    assert rows_that_differ(theirs, kvlib_rows) == []


def test_a_moved_token_is_a_row_that_differs(record, kvlib_rows):
    """The comparison above can fail: one token of vLLM's third row changed, and only that row differs."""
    theirs = copy.deepcopy(record["vllm"]["tp3"]["passes"][0]["tokens"])
    theirs[2][5] += 1
    assert rows_that_differ(theirs, kvlib_rows) == [2]


def test_each_ranks_pool_holds_a_third_of_each_tokens_bytes(record, scenarios):
    """vLLM's ``kv_cache_memory_bytes`` is per rank. A rank stores its one KV head of three, so a
    token costs it a third of the single-process bytes, and the same bytes hold three times the
    tokens: kvlib's arithmetic (`pool_capacity` on one rank's widths) gives vLLM's logged line
    and the tensors each worker allocated."""
    llm, r = scenarios["tp3"]["llm"], record["vllm"]["tp3"]
    rank = dataclasses.replace(SMOLLM2, n_head=SMOLLM2.n_head // 3, n_kv_head=SMOLLM2.n_kv_head // 3,
                               head_dim=SMOLLM2.head_dim)
    assert kv_bytes_per_token(rank, "fp32") * 3 == kv_bytes_per_token(SMOLLM2, "fp32")
    blocks, tokens, conc = pool_capacity(rank, llm["kv_cache_memory_bytes"], llm["max_model_len"], llm["block_size"],
                                         "fp32")
    assert (r["cache_config"]["num_gpu_blocks"], r["cache_config"]["kv_cache_size_tokens"]) == (blocks, tokens)
    line = next(ln for ln in r["log"] if "KV cache size" in ln)
    assert capacity_line(line.split(") ", 1)[1]) == (tokens, llm["max_model_len"], round(conc, 2))
    whole, *_ = pool_capacity(SMOLLM2, llm["kv_cache_memory_bytes"], llm["max_model_len"], llm["block_size"], "fp32")
    assert blocks // 3 <= whole <= blocks // 3 + 1  # one process: a third of the blocks
    pools = sorted(r["rank_pools"], key=lambda p: p["rank"])
    assert [p["rank"] for p in pools] == [0, 1, 2]
    for p in pools:  # what each worker allocated: per layer, (blocks, its 1 KV head, block size, K then V)
        assert p["layers"] == SMOLLM2.n_layer and p["dtype"] == "torch.float32"
        assert p["shape"] == [blocks, 1, llm["block_size"], 2 * SMOLLM2.head_dim]
        assert p["bytes"] == blocks * llm["block_size"] * kv_bytes_per_token(rank, "fp32")
        assert p["bytes"] == math.prod(p["shape"]) * 4 * SMOLLM2.n_layer
    said = {m.group(1) for ln in r["log"] for m in [re.match(r"\((Worker_TP\d)\) Explicitly set", ln)] if m}
    assert said == {"Worker_TP0", "Worker_TP1", "Worker_TP2"}  # each worker logs its own pool


# -- sizes that do not divide the heads: vLLM refuses, in its words ----------------------------------
@pytest.mark.parametrize("name, size", [("tp2", 2), ("tp4", 4)])
def test_vllm_refuses_a_size_that_does_not_divide_the_heads(record, scenarios, name, size):
    r = record["vllm"][name]
    assert scenarios[name]["llm"]["tensor_parallel_size"] == size and SMOLLM2.n_head % size != 0
    assert outcome(r) == "refused" and "passes" not in r
    want = f"Total number of attention heads ({SMOLLM2.n_head}) must be divisible by tensor parallel size ({size})."
    assert reason(r["error"]) == want


# -- KV connectors and offloading: each ran or says why not -----------------------------------------
def test_every_connector_outcome_is_well_formed(record, scenarios):
    kinds = {s["kind"] for s in scenarios.values()}
    assert kinds == {"tp", "refusal", "connector"}
    names = {n for n, s in scenarios.items() if s["kind"] == "connector"}
    assert names == {"example-connector", "offloading", "simple-offload", "lmcache"}
    for n in names:
        r = record["vllm"][n]
        assert outcome(r) in OUTCOMES
        if outcome(r) == "ran":
            assert len(r["passes"]) == 2 and r["reset_prefix_cache"] is True
        else:
            assert re.fullmatch(r"\w+: .+", reason(r["error"])), r["error"]
            assert r["raised_at"].startswith(("vllm/", "lmcache")) or "lmcache" in r["error"]
    assert record["vllm_version"] == "0.32.0"


def test_the_disk_connector_loads_the_stored_prefix_and_the_tokens_hold(record, scenarios, smollm2):
    """ExampleConnector writes each layer's K and V of a prompt's full blocks as safetensors; a
    second pass, with vLLM's own prefix cache emptied, reads them back instead of computing them.
    It stores the prompt less its last token, rounded down to whole blocks (vLLM 0.32's
    ``align_to_block_size(len(prompt) - 1)``, example_connector.py)."""
    s, r = scenarios["example-connector"], record["vllm"]["example-connector"]
    assert outcome(r) == "ran", r.get("error")
    n, bs = len(s["prompts"][0]), s["llm"]["block_size"]
    stored = (n - 2) // bs * bs
    first, second = r["passes"]
    assert first["cached_tokens"] == [0] and loaded(r) == stored == 96
    assert second["counters"]["vllm:external_prefix_cache_hits"] == stored
    assert "vllm:external_prefix_cache_hits" not in first["counters"]
    assert any(f"Inject KV cache of {stored} tokens" in ln for ln in r["log"])
    files = second["storage"]
    payload = stored * kv_bytes_per_token(SMOLLM2, "fp32")  # every layer's K and V of the stored tokens
    assert files["files"] == SMOLLM2.n_layer and all(x.endswith(".safetensors") for x in files["names"])
    assert 0 < files["bytes"] - payload <= 256 * files["files"]  # plus each file's small JSON header
    want = greedy(smollm2, s["prompts"][0], s["max_tokens"])
    assert first["tokens"] == second["tokens"] == [want]


# -- the runner's judgement, on records it must fail -----------------------------------------------
def test_the_stored_record_was_judged_as_checks_judges_it(record):
    assert [(c["name"], c["status"]) for c in checks(record)] == [(c["name"], c["status"]) for c in record["checks"]]
    assert not [c for c in record["checks"] if c["status"] == "fail"]


@pytest.mark.parametrize("mutate, name", [
    (lambda r: r["vllm"]["tp3"]["passes"][0]["tokens"][1].__setitem__(0, 7), "tp3: tokens"),
    (lambda r: r["kvlib"]["tokens"][0].pop(), "tp3: tokens"),
    (lambda r: r["vllm"]["tp2"].pop("error"), "tp2: refused"),
    (lambda r: r["vllm"]["tp4"].__setitem__("error", "ValueError: out of memory"), "tp4: refused"),
    (lambda r: r["vllm"]["example-connector"]["passes"][1]["tokens"][0].__setitem__(3, 0),
     "example-connector: tokens"),
])
def test_checks_fail_a_record_where_vllm_and_kvlib_disagree(record, mutate, name):
    r = copy.deepcopy(record)
    mutate(r)
    assert {c["name"]: c["status"] for c in checks(r)}[name] == "fail"


def test_against_finds_what_moved_and_not_timings(record):
    same = copy.deepcopy(record)
    same["vllm"]["tp3"]["startup_seconds"] *= 2
    assert facts(same) == facts(record)
    moved = copy.deepcopy(record)
    moved["vllm"]["example-connector"]["passes"][1]["cached_tokens"] = [64]
    assert {k for k in facts(record) if facts(record)[k] != facts(moved).get(k)} == {("example-connector", 1)}
    assert facts(moved, {"tp3"}) == facts(record, {"tp3"})  # --only tp3 compares tp3 alone


def test_reason_and_outcome_read_vllms_errors():
    pyd = ("ValidationError: 1 validation error for VllmConfig\n  Value error, Total number of attention heads (9) "
           "must be divisible by tensor parallel size (2). [type=value_error, input_value=ArgsKwargs(...)]")
    assert reason(pyd) == "Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    assert reason("ModuleNotFoundError: No module named 'lmcache'") == "ModuleNotFoundError: No module named 'lmcache'"
    assert outcome({"vllm": "0.32.0"}) == "ran"
    assert outcome({"vllm": "0.32.0", "error": "X: y"}) == "refused"
    assert outcome({"vllm": "0.32.0", "error": "X: y", "passes": []}) == "failed serving"
    assert outcome({"error": "timed out after 5 s"}) == "timed out"
    assert outcome({"error": "vllm_distributed exited -9"}) == "crashed"


def test_log_lines_keep_the_process_and_drop_pids_and_times():
    said = "Explicitly set (0.06/16.71) GiB for KV cache"
    out = (f"(Worker_TP1 pid=1140) INFO 12-03 19:39:53 [cpu_worker.py:260] {said}\n"
           f"(Worker_TP1 pid=1140) INFO 12-03 19:39:54 [cpu_worker.py:260] {said}\n"
           "(MainProcess pid=839) INFO 12-03 19:39:53 [kv_cache_utils.py:2327] CPU KV cache size: 4,352 tokens\n"
           "(MainProcess pid=839) INFO 12-03 19:39:15 [model.py:733] Resolved architecture: LlamaForCausalLM\n")
    assert _log_lines(out) == [f"(Worker_TP1) {said}",
                               "(MainProcess) CPU KV cache size: 4,352 tokens"]


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")
def test_a_scenario_past_its_time_is_stopped_with_every_process_it_started(tmp_path):
    """A stand-in for vLLM that starts a worker and hangs: the runner stops both, by process group."""
    fake, pidfile = tmp_path / "python", tmp_path / "worker.pid"
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    fake.chmod(0o755)
    t0 = time.perf_counter()
    r = run_scenario(fake, {"name": "hang"}, tmp_path, timeout=2)
    assert outcome(r) == "timed out" and time.perf_counter() - t0 < 30
    worker = int(pidfile.read_text())
    for _ in range(50):  # the kill is sent; give the kernel a moment (a zombie awaiting its reaper is stopped)
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        stat = f"/proc/{worker}/stat"
        if os.path.exists(stat) and open(stat).read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {worker} still running")


def test_the_command_says_how_to_get_vllm_when_there_is_none(monkeypatch, capsys):
    monkeypatch.setenv("KVLIB_VLLM_PYTHON", "off")
    assert main([]) == 2
    assert "make vllm" in capsys.readouterr().err


def test_the_record_is_json_with_no_temporary_paths(record):
    text = json.dumps(record["scenarios"])
    assert "/tmp" not in text and all("storage" not in s for s in record["scenarios"])
