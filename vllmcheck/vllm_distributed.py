"""The vLLM half of the distributed check (`vllmcheck.distributed`). It runs inside
vLLM's own environment (``make vllm``), one scenario per process:

    .venv-vllm/bin/python -m vllmcheck.vllm_distributed scenario.json out.json

A scenario is one ``vllm.LLM(...)`` configuration and a list of prompts (token ids):

* tensor parallelism (``tensor_parallel_size=3``, one worker process per rank), or a size
  vLLM should refuse (2 or 4 for SmolLM2's 9 query heads and 3 KV heads);
* a KV connector (``kv_transfer_config``) or ``kv_offloading_size``, whose prompt is
  served twice: the first pass stores its KV outside the engine's pool, the second
  should load it back instead of computing it (``"passes": 2``; between them the
  engine's own prefix cache is emptied with ``reset_prefix_cache``, so that a hit can
  only come from the connector).

It writes what vLLM did: the error if it refused to start (the exception's own text),
else its start-up time, its resolved pool (``num_gpu_blocks``, ``kv_cache_size_tokens``),
and per pass every prompt's greedy tokens, its cached prompt tokens, the
``get_metrics()`` counters that moved, and the files under a connector's storage
folder. vLLM's log lines (each worker's among them) are read from this process's
output by `vllmcheck.distributed.run_scenario`. Of kvlib it needs nothing but
this file, so it runs with vLLM's pinned transformers.
"""

from __future__ import annotations

import re
import sys
import time
import traceback
from pathlib import Path

from .vllm_side import counters, serve_spec


def _files(folder: str | None) -> dict:
    """What a connector left on disk: file count, total bytes, and the distinct file names."""
    if not folder or not Path(folder).is_dir():
        return {"files": 0, "bytes": 0, "names": []}
    paths = [p for p in Path(folder).rglob("*") if p.is_file()]
    return {"files": len(paths), "bytes": sum(p.stat().st_size for p in paths),
            "names": sorted({p.name for p in paths})[:8]}


def _error(e: BaseException) -> dict:
    """An exception as vLLM raised it: its text, where it was raised (the innermost frame, under
    ``vllm/``), and the traceback's tail."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = frame.filename.split("site-packages/")[-1]
    tb = re.sub(r'File "[^"]*site-packages/', 'File "', traceback.format_exc())  # paths as in the wheel
    tb = tb.replace(str(Path(__file__).resolve().parents[1]) + "/", "")  # and as in this checkout
    return {"error": f"{type(e).__name__}: {e}", "raised_at": f"{where}:{frame.lineno}", "traceback": tb[-3000:]}


def _rank_pool(worker) -> dict:
    """Run inside each worker (``LLM.collective_rpc``): its rank and the KV tensors it allocated."""
    caches = worker.model_runner.kv_caches  # one tensor per layer, this rank's KV heads only
    return {"rank": int(worker.rank), "layers": len(caches), "shape": list(caches[0].shape),
            "dtype": str(caches[0].dtype), "bytes": sum(t.numel() * t.element_size() for t in caches)}


def _pass(llm, prompts: list[list[int]], max_tokens: int, storage: str | None) -> dict:
    """Serve every prompt once, greedily; tokens, cached tokens and counters moved."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    before, t0 = counters(llm), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = counters(llm)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": [int(o.num_cached_tokens or 0) for o in outs], "seconds": seconds,
            "counters": {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)},
            "storage": _files(storage)}


def run(scenario: dict, model_dir: str) -> dict:
    """Start vLLM with the scenario's settings (or record why it would not), then serve its passes."""
    import vllm
    from vllm import LLM

    result: dict = {"scenario": scenario["name"], "vllm": vllm.__version__}
    llm_args = dict(scenario["llm"])
    storage = scenario.get("storage")
    if storage:  # the connector's folder: made fresh by the driver, named in the connector's settings
        llm_args["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] = storage
    t0 = time.perf_counter()
    try:
        llm = LLM(model=model_dir, skip_tokenizer_init=True, disable_log_stats=False, **llm_args)
    except Exception as e:  # a setting this build refuses: say what it answered, in its own words
        result.update(_error(e), startup_seconds=time.perf_counter() - t0)
        return result
    result["startup_seconds"] = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    pc = llm.llm_engine.vllm_config.parallel_config
    result["cache_config"] = {k: getattr(cc, k, None) for k in (
        "block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_memory_bytes", "enable_prefix_caching",
        "cache_dtype", "kv_offloading_size", "kv_offloading_backend")}
    result["parallel_config"] = {k: getattr(pc, k, None) for k in (
        "tensor_parallel_size", "distributed_executor_backend", "world_size")}
    ktc = llm.llm_engine.vllm_config.kv_transfer_config
    result["kv_transfer_config"] = None if ktc is None else {
        "kv_connector": ktc.kv_connector, "kv_role": ktc.kv_role}
    if scenario.get("rank_pools"):  # each worker's own pool, as it allocated it
        try:
            result["rank_pools"] = llm.collective_rpc(_rank_pool, timeout=60)
        except Exception as e:
            result["rank_pools_error"] = f"{type(e).__name__}: {e}"
    result["passes"] = []
    try:
        for i in range(scenario.get("passes", 1)):
            if i:
                # forget the engine's own cached blocks: a hit on the next pass can only be the connector's
                result["reset_prefix_cache"] = bool(llm.reset_prefix_cache())
            result["passes"].append(_pass(llm, scenario["prompts"], scenario["max_tokens"], storage))
    except Exception as e:  # it started, then failed serving: as much a finding as a refusal
        result.update(_error(e))
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # its worker processes too; the driver then stops any left
    result["shutdown_seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str]) -> int:
    return serve_spec(argv, run, __doc__)  # worker processes stay on: tensor parallelism needs them


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
