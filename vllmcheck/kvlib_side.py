"""The kvlib half of the cross-check: the same scenarios through kvlib's own engines.

`run` mirrors `vllmcheck.vllm_side.run` record for record, so the two can be
compared field by field:

* a scenario with paged settings (``scenario["kvlib"]``) runs on one `kvlib.Engine`
  over a `PagedCache` of the same block size and the same number of blocks as vLLM's
  pool (less its null block), with ``token_budget`` = vLLM's ``max_num_batched_tokens`` and ``max_batch`` =
  ``max_num_seqs``; requests arrive before the same step as in vLLM;
* the FP8 scenario generates with `kvlib.quant.FP8Cache` at vLLM's default scale of 1.0;
* the n-gram scenario runs `kvlib.speculative.speculative_generate` with a
  `PromptLookupDraft` of the same n-gram range and ``k``;
* a traced scenario (chapter 12's, `vllmcheck.run(..., trace={"serving"})`) records the pool with `kvlib.paged.PoolTrace`,
  its sequences keyed by the workload's request ids.
"""

from __future__ import annotations

import time

import torch

from kvlib.engine import Engine
from kvlib.generate import generate
from kvlib.model import Transformer
from kvlib.paged import PagedCache, PoolTrace
from kvlib.quant import FP8Cache
from kvlib.speculative import PromptLookupDraft, speculative_generate
from .traces import rename
from .workload import WARMUP, block_bytes, prompt_of


def _serve_phase(engine: Engine, phase: list[dict], done: dict, names: dict | None = None) -> dict:
    """One phase through ``engine``; ``names`` (if given) gets engine request id -> the workload's."""
    pending = sorted(phase, key=lambda r: r["arrive"])
    records, seqs = {}, {}
    step, t0 = 0, time.perf_counter()
    preempt0, copied0 = engine.stats.preemptions, engine.stats.kv_bytes_copied
    while pending or not engine.finished:
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            prompt = prompt_of(r, done)
            rid = engine.add(prompt, r["max_tokens"])
            seqs[r["id"]] = engine.requests[rid].seqs[0]
            if names is not None:
                names[str(rid)] = r["id"]
            records[r["id"]] = {"prompt": prompt, "tokens": [], "first_step": None, "arrive": r["arrive"]}
        engine.step()
        for name, seq in seqs.items():
            rec = records[name]
            if rec["first_step"] is None and seq.output:
                # vLLM reports the hits of the admission that made the first token (its output
                # processor takes num_cached_tokens from the first output's prefill stats): a
                # preempted request's re-admission, which finds its own blocks, does not count
                rec["first_step"], rec["cached_tokens"] = step, seq.cached_tokens
        step += 1
    for name, seq in seqs.items():
        records[name]["tokens"] = list(seq.output)
    return {"requests": records, "steps": step, "seconds": time.perf_counter() - t0,
            "counters": {"preemptions": engine.stats.preemptions - preempt0},
            "kv_bytes_copied": engine.stats.kv_bytes_copied - copied0}


def run(scenario: dict, model: Transformer, trace: bool = False, varlen: bool = True) -> dict:
    """One scenario through kvlib: the record `compare` reads beside vLLM's; ``trace``: record the
    pool step by step (`kvlib.paged.PoolTrace`), as ``result["trace"]``; ``varlen=False``: the
    Engine's masked packed row instead of its varlen attention (`kvlib.Engine`)."""
    s, cfg = scenario, model.config
    result: dict = {"scenario": s["name"]}
    llm = s["llm"]
    if s["name"] == "fp8":
        phase = []
        for r in s["phases"][0]:
            ids = torch.tensor([r["prompt"]], device=model.device)
            out = generate(model, ids, r["max_tokens"], cache=FP8Cache(cfg.n_layer, scale=1.0))
            phase.append({"id": r["id"], "tokens": out[0, ids.shape[1]:].tolist()})
        result["phases"] = [{"requests": {p["id"]: p for p in phase}}]
        return result
    if s["name"] == "ngram":
        sc = llm["speculative_config"]
        draft = PromptLookupDraft(ngram_max=sc["prompt_lookup_max"], ngram_min=sc["prompt_lookup_min"])
        result["phases"] = []
        for (r,) in s["phases"]:
            out, stats = speculative_generate(model, r["prompt"], r["max_tokens"], draft,
                                              k=sc["num_speculative_tokens"])
            rec = {"tokens": out[0, len(r["prompt"]):].tolist(), "proposed": stats.proposed,
                   "accepted": stats.accepted, "verify_steps": stats.steps}
            result["phases"].append({"requests": {r["id"]: rec}})
        return result
    if s.get("kvlib") is None:
        return result
    # vLLM's pool: the memory over one block's bytes, less block 0, which its BlockPool keeps as the
    # "null block" (vllm/v1/core/block_pool.py) and never hands to a request
    num_blocks = llm["kv_cache_memory_bytes"] // block_bytes(cfg, llm["block_size"]) - 1
    def fresh() -> Engine:
        cache = PagedCache.for_model(model, num_blocks=num_blocks, block_size=llm["block_size"], prefix_caching=True)
        return Engine(model, cache, max_batch=llm["max_num_seqs"], token_budget=s["kvlib"]["token_budget"],
                      trace=PoolTrace() if trace else None, varlen=varlen)

    engine = fresh()
    result["num_blocks"] = num_blocks
    if s.get("timed"):  # the same warm-up as vLLM's; its blocks are then forgotten with a fresh engine
        _serve_phase(engine, [WARMUP], {})
        engine = fresh()
    done: dict = {}
    result["phases"] = []
    names: dict[str, str] = {}
    for phase in s["phases"]:
        rec = _serve_phase(engine, phase, done, names)
        done.update(rec["requests"])
        result["phases"].append(rec)
    if engine.trace is not None:  # keyed by the workload's request ids, as vLLM's trace is
        result["trace"] = rename(engine.trace.to_dict(), names)
    return result
