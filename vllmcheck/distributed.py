"""vLLM past one process, where its CPU build allows it: tensor parallelism and KV connectors.

    python -m vllmcheck.distributed [--python VLLM_PY] [--json OUT] [--against RECORD] [--only NAME ...]

Chapter 13 shards the cache across processes with kvlib (`kvlib.distributed`). This runs
vLLM 0.32's CPU build on the same requests, each scenario in a fresh process of its own
environment (`vllmcheck.vllm_distributed`), and records what it did:

* ``tp3``: ``tensor_parallel_size=3`` (SmolLM2's 3 KV heads, one per rank; three worker
  processes, gloo between them), 4 prompts x 16 greedy tokens in fp32. Its tokens must
  equal kvlib's single process (`kvlib.generate`); each rank's pool, as vLLM logs and
  allocates it, is set beside kvlib's arithmetic (a rank stores 1/3 of a token's bytes);
* ``tp2``, ``tp4``: sizes that do not divide SmolLM2's 9 query heads. vLLM must refuse
  them; its words are recorded;
* ``example-connector``, ``offloading``, ``simple-offload``, ``lmcache``: vLLM's KV
  connectors that need no GPU library (``kv_transfer_config``, ``kv_offloading_size``),
  each serving one prompt twice, its own prefix cache emptied between: does it start on
  a CPU, and does the second pass load the stored prefix instead of computing it?

The record (``vllmcheck/data/vllm_distributed_cpu.json``, read back by `load_record`) is what
the chapter and the tests read where vLLM is not installed. Exits 1 if a check fails or
``--against`` finds a token, a refusal's text or a connector's outcome moved (timings
may move: they are not compared).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import read_record, runner_args, settle, vllm_checkpoint, vllm_python

#: The stored distcheck record, read where vLLM is not installed (`load_record`).
RECORD = Path(__file__).resolve().parent / "data" / "vllm_distributed_cpu.json"
ROOT = Path(__file__).resolve().parents[1]  # the checkout this kvlib is in: the child imports the same one
NEW_TOKENS = 16
PROMPT_LENGTHS = (24, 48, 80, 100)
CONNECTOR_PROMPT = 100  # three full blocks of 32 after the last token is set aside: what a connector stores
POOL_BYTES = 64 * 2**20  # each rank's pool (vLLM's kv_cache_memory_bytes is per rank)
TIMEOUT = 300  # seconds for one scenario, start-up included; a refusal takes about 15
ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "VLLM_LOGGING_LEVEL": "INFO"}
LOGGED = re.compile(r"KV cache|External Cache Hit|Inject KV|[Oo]ffload|[Cc]onnector|LMCache")


def prompts(text_ids: list[int]) -> list[list[int]]:
    """Four prompts of `PROMPT_LENGTHS` tokens, cut from four places of the text."""
    return [list(text_ids[100 + 1000 * i : 100 + 1000 * i + n]) for i, n in enumerate(PROMPT_LENGTHS)]


def connector_prompt(text_ids: list[int]) -> list[int]:
    """The connectors' one prompt: `CONNECTOR_PROMPT` tokens from another place of the text."""
    return list(text_ids[5000 : 5000 + CONNECTOR_PROMPT])


def scenarios(text_ids: list[int], storage: str | os.PathLike) -> list[dict]:
    """Every scenario, with vLLM's ``LLM(...)`` settings; ``storage``: a folder for the disk connector."""
    common = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True, "seed": 0,
              "kv_cache_memory_bytes": POOL_BYTES}
    tp = {**common, "distributed_executor_backend": "mp"}
    ps = prompts(text_ids)
    one = [connector_prompt(text_ids)]

    def connector(name: str, llm: dict, env: dict | None = None, folder: str | None = None) -> dict:
        return {"name": name, "kind": "connector", "llm": {**common, **llm}, "prompts": one,
                "max_tokens": NEW_TOKENS, "passes": 2, "env": env or {}, "storage": folder}

    return [
        {"name": "tp3", "kind": "tp", "llm": {**tp, "tensor_parallel_size": 3}, "prompts": ps,
         "max_tokens": NEW_TOKENS, "rank_pools": True},
        {"name": "tp2", "kind": "refusal", "llm": {**tp, "tensor_parallel_size": 2}, "prompts": ps[:1],
         "max_tokens": NEW_TOKENS},
        {"name": "tp4", "kind": "refusal", "llm": {**tp, "tensor_parallel_size": 4}, "prompts": ps[:1],
         "max_tokens": NEW_TOKENS},
        # saves each layer's KV of a prompt as safetensors under a folder named by the tokens' hash
        connector("example-connector", {"kv_transfer_config": {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}},
            folder=str(Path(storage) / "example-connector")),
        # vLLM's own CPU tier: kv_offloading_size (GiB) resolves to OffloadingConnector ...
        connector("offloading", {"kv_offloading_size": 0.25}),
        # ... or, with VLLM_USE_SIMPLE_KV_OFFLOAD=1, to SimpleCPUOffloadConnector
        connector("simple-offload", {"kv_offloading_size": 0.25}, env={"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}),
        # LMCache's connector, which needs the lmcache package (not in .venv-vllm)
        connector("lmcache", {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}),
    ]


def _log_lines(output: str) -> list[str]:
    """vLLM's lines about its pool and connectors, each with the process that printed it
    (``MainProcess``, ``Worker_TP1``, ...), without pids and times; repeats dropped."""
    out: list[str] = []
    for line in output.splitlines():
        m = re.match(r"\((\w+)[^)]*\) (?:INFO|WARNING|ERROR|DEBUG) [\d-]+ [\d:]+ \[[^\]]+\] (.*)", line)
        if m and LOGGED.search(m.group(2)):
            text = f"({m.group(1)}) {m.group(2)}"
            if text not in out:
                out.append(text)
    return out[:40]


def _stop_group(pgid: int) -> None:
    """Stop what is left of one scenario's processes (vLLM's engine and workers), by their group id."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_scenario(python: Path, scenario: dict, model_dir: Path, timeout: int = TIMEOUT) -> dict:
    """One scenario through vLLM in a fresh process group; its result and its log lines."""
    env = {**os.environ, **ENV, **scenario.get("env", {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"scenario": scenario, "model_dir": str(model_dir)}))
        t0 = time.perf_counter()
        proc = subprocess.Popen([str(python), "-m", "vllmcheck.vllm_distributed", str(spec), str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own group: the workers can be stopped with it
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc.pid)
            output, _ = proc.communicate()
            return {"error": f"timed out after {timeout} s", "log": _log_lines(output), "output": output[-3000:],
                    "process_seconds": time.perf_counter() - t0}
        finally:
            _stop_group(proc.pid)
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"vllm_distributed exited {proc.returncode}", "output": output[-4000:],
                    "process_seconds": time.perf_counter() - t0}
        result = json.loads(out.read_text())
    result["process_seconds"] = time.perf_counter() - t0
    for path, name in ((scenario.get("storage"), "<storage>"), (str(model_dir), "smollm2-hf")):
        output = output.replace(path, name) if path else output  # this machine's paths are no facts
    result["log"] = _log_lines(output)
    return result


def kvlib_tokens(model, prompt_list: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    """kvlib's greedy tokens for each prompt, one process, one prompt at a time (fp32)."""
    import torch

    from kvlib.generate import generate

    out = []
    for p in prompt_list:
        ids = torch.tensor([p], device=model.device)
        out.append(generate(model, ids, n, temperature=0.0)[0, len(p):].tolist())
    return out


def reason(error: str) -> str:
    """The sentence vLLM refused with, without pydantic's wrapping ("1 validation error for
    VllmConfig / Value error, ... [type=value_error, ...]"): what the chapter quotes."""
    m = re.search(r"Value error, (.*?)(?: \[type=|$)", error, re.M)
    return m.group(1) if m else error.split("\n")[0]


def outcome(result: dict) -> str:
    """What a scenario came to: ``"ran"``; ``"refused"`` (vLLM would not start with it, and said
    why); ``"failed serving"`` (it started, then raised); ``"timed out"``; ``"crashed"`` (its
    process died without a result)."""
    if "error" not in result:
        return "ran"
    if result["error"].startswith("timed out"):
        return "timed out"
    if "vllm" not in result:
        return "crashed"
    return "failed serving" if result.get("passes") is not None else "refused"


def loaded(result: dict) -> int:
    """Prompt tokens the second pass did not compute (vLLM's cached tokens, from the connector once
    its own prefix cache was emptied); 0 if there was no second pass."""
    passes = result.get("passes") or []
    return passes[1]["cached_tokens"][0] if len(passes) > 1 else 0


def checks(record: dict) -> list[dict]:
    """The record judged: tp3's tokens against kvlib's, the refusals, each connector's outcome."""
    v, k = record["vllm"], record["kvlib"]
    out = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "status": "pass" if ok else "fail", "detail": detail})

    for s in record["scenarios"]:
        r, name = v.get(s["name"], {}), s["name"]
        if s["kind"] == "tp":
            got = r["passes"][0]["tokens"] if outcome(r) == "ran" else None
            check(f"{name}: tokens", got == k["tokens"],
                  f"{sum(a == b for a, b in zip(got, k['tokens']))}/{len(k['tokens'])} prompts identical to kvlib's "
                  f"single process" if got else r.get("error", "no run"))
        elif s["kind"] == "refusal":
            err = reason(r.get("error", ""))
            check(f"{name}: refused", "divisible by tensor parallel size" in err, err or "vLLM started")
        elif outcome(r) == "ran":
            p = r["passes"]
            same = all(x["tokens"] == [k["connector_tokens"]] for x in p)
            check(f"{name}: tokens", same, f"{len(p)} passes, {'' if same else 'not '}equal to kvlib's; second pass "
                  f"loaded {loaded(r)} of {len(s['prompts'][0])} prompt tokens")
        else:
            out.append({"name": f"{name}: {outcome(r)}", "status": "report", "detail": reason(r.get("error", ""))})
    return out


def run(model, text_ids: list[int], python: Path | None = None, model_dir: Path | None = None, *,
        only: list[str] | None = None, log=None) -> dict:
    """Every scenario through vLLM, one process at a time, and kvlib's tokens for the same prompts."""
    import torch

    from kvlib.timing import threads

    python, model_dir = vllm_checkpoint(python, model_dir)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        work = [s for s in scenarios(text_ids, storage) if not only or s["name"] in only]
        record: dict = {"scenarios": work, "vllm": {}, "seconds_by_scenario": {}, "machine": {
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}}
        t0 = time.perf_counter()
        with threads(2):
            record["kvlib"] = {"tokens": kvlib_tokens(model, prompts(text_ids)),
                               "connector_tokens": kvlib_tokens(model, [connector_prompt(text_ids)])[0]}
        record["seconds_by_scenario"]["kvlib"] = time.perf_counter() - t0
        for s in work:
            t0 = time.perf_counter()
            record["vllm"][s["name"]] = r = run_scenario(python, s, model_dir)
            record["seconds_by_scenario"][s["name"]] = dt = time.perf_counter() - t0
            if log:
                log(f"{s['name']:18s} {dt:5.1f} s  " + (r["error"].splitlines()[0][:160] if "error" in r else "ran"))
    for s in record["scenarios"]:
        s.pop("storage", None)  # a temporary folder: not a fact
    record["vllm_version"] = next((r["vllm"] for r in record["vllm"].values() if "vllm" in r), None)
    record["checks"] = checks(record)
    record["seconds"] = time.perf_counter() - t_all
    return record


def load_record(path: str | os.PathLike | None = None) -> dict:
    """The stored record (``vllmcheck/data/vllm_distributed_cpu.json``)."""
    return read_record(RECORD if path is None else path, "vllm distcheck")


def facts(record: dict, names: set[str] | None = None) -> dict:
    """What must not move between runs: tokens, cached tokens, refusals' texts, outcomes, checks' statuses
    (of the scenarios in ``names``, default all)."""
    out = {}
    for name, r in record["vllm"].items():
        if names is not None and name not in names:
            continue
        out[name, "error"] = reason(r.get("error", ""))
        for i, p in enumerate(r.get("passes") or []):
            out[name, i] = json.dumps([p["tokens"], p["cached_tokens"]])
    out["checks"] = tuple((c["name"], c["status"]) for c in record["checks"]
                          if names is None or c["name"].split(":")[0] in names)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = runner_args(argv, "python -m vllmcheck.distributed", __doc__, "vllm", "vLLM", vllm_python,
                       only="scenarios to run (default: all)", against="a stored record whose facts must not move")
    if args is None:
        return 2

    from kvlib import data
    from kvlib.pretrained import load_smollm2

    model, tok = load_smollm2()
    record = run(model, tok.encode(data.tiny_shakespeare("val")), args.python, only=args.only,
                 log=lambda line: print(line, flush=True))
    for c in record["checks"]:
        print(f"[{c['status']:6s}] {c['name']}: {c['detail'][:200]}")
    failed = [c["name"] for c in record["checks"] if c["status"] == "fail"]
    ran = set(record["vllm"])  # with --only, the others are not compared
    settle(record, args.json, args.against, lambda r: facts(r, ran), failed)
    print(f"{len(record['checks'])} checks, {len(failed)} failed, in {record['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
