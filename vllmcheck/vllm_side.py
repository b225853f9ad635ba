"""The vLLM half of the cross-check. It runs inside vLLM's own environment (``make vllm``):

    .venv-vllm/bin/python -m vllmcheck.vllm_side scenario.json out.json

It reads one scenario (`vllmcheck.workload`), starts ``vllm.LLM`` with its settings,
drives the engine one ``LLMEngine.step()`` at a time, adding each request just before its
arrival step, and writes what vLLM did: every request's tokens, cached prompt tokens,
preemptions and the step of its first token; the counters of ``LLM.get_metrics()`` per
phase; the resolved cache and scheduler settings. (vLLM's own log lines about the pool are
read from this process's output by `vllmcheck.driver.run_vllm`.)

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one
``step()`` is one scheduler step. Of kvlib it needs only `vllmcheck.workload`, so
it runs with vLLM's pinned transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .workload import WARMUP, prompt_of


def counters(llm) -> dict[str, float]:
    """Every counter of ``LLM.get_metrics()``, summed over its labels."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if type(m).__name__ == "Counter":
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def _run_phase(llm, phase: list[dict], params_of, done: dict, trace=None) -> dict:
    """Serve one phase step by step; returns its requests' records and its step count. ``trace``
    (a `vllmcheck.vllm_trace.VllmPoolTrace`, or None) records the pool around each step."""
    from vllm.inputs import TokensPrompt

    engine, records = llm.llm_engine, {}
    pending = sorted(phase, key=lambda r: r["arrive"])
    step, t0 = 0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            prompt = prompt_of(r, done)  # a follow-up turn: the earlier prompt, its reply, then this text
            records[r["id"]] = {"prompt": prompt, "tokens": [], "first_step": None, "arrive": r["arrive"]}
            vllm_id = engine.add_request(r["id"], TokensPrompt(prompt_token_ids=prompt), params_of(r))
            if trace is not None:
                trace.add(vllm_id, r["id"], len(prompt), r["max_tokens"])
        if trace is not None:
            trace.before()
        outs = engine.step()
        if trace is not None:
            trace.after()
        for out in outs:
            rec = records[out.request_id]
            rec["tokens"] = list(out.outputs[0].token_ids)
            if rec["first_step"] is None and rec["tokens"]:
                rec["first_step"] = step
            if out.finished:
                rec["cached_tokens"] = int(out.num_cached_tokens or 0)
                rec["preemptions"] = int(getattr(out.metrics, "num_preemptions", 0) or 0)
        step += 1
    return {"requests": records, "steps": step, "seconds": time.perf_counter() - t0}


def run(scenario: dict, model_dir: str, trace: bool = False) -> dict:
    import vllm
    from vllm import LLM, SamplingParams


    def params_of(r: dict) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)

    result: dict = {"scenario": scenario["name"], "vllm": vllm.__version__}
    t0 = time.perf_counter()
    extra = {}
    if trace:  # vLLM's KV-cache events, kept by the trace in this process (no publisher)
        from vllm.config import KVEventsConfig
        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    try:
        llm = LLM(model=model_dir, skip_tokenizer_init=True, disable_log_stats=False, **scenario["llm"], **extra)
    except Exception as e:  # a setting this build refuses: say what it answered
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=3)[-3000:]
        return result
    result["startup_seconds"] = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    result["cache_config"] = {k: getattr(cc, k, None) for k in (
        "block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency", "kv_cache_memory_bytes",
        "enable_prefix_caching", "prefix_caching_hash_algo", "cache_dtype", "gpu_memory_utilization")}
    result["scheduler_config"] = {k: getattr(sc, k, None) for k in (
        "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
        "policy", "watermark", "async_scheduling")}
    if scenario.get("timed"):  # a warm-up request, then forget it: the timed phase starts cold-cached
        _run_phase(llm, [WARMUP], params_of, {})
        llm.reset_prefix_cache()
    done: dict = {}
    result["phases"] = []
    pool = None
    if trace:
        from .vllm_trace import VllmPoolTrace
        pool = VllmPoolTrace(llm)
    for phase in scenario["phases"]:
        before = counters(llm)
        rec = _run_phase(llm, phase, params_of, done, pool)
        after = counters(llm)
        rec["counters"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        done.update(rec["requests"])
        result["phases"].append(rec)
    if pool is not None:
        result["trace"] = pool.trace
    return result


def serve_spec(argv: list[str], run_scenario, doc: str | None) -> int:
    """A vLLM-side script's entry point: ``SPEC.json OUT.json``; the spec's scenario run by
    ``run_scenario(scenario, model_dir, **options)``, its result written as JSON."""
    if len(argv) != 2:
        print(doc, file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    result = run_scenario(spec["scenario"], spec["model_dir"], **spec.get("options", {}))
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one engine, stepped in this process
    return serve_spec(argv, run, __doc__)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
