"""Reading vLLM's record beside kvlib's: one `Check` per thing the two engines must agree on.

Each check has a status:

* ``"pass"``: the two agree exactly (tokens row for row, token counts, steps);
* ``"fail"``: they should agree and do not; the cross-check exits non-zero;
* ``"report"``: a figure the two engines are not expected to share (a speed, a count
  their policies reach differently, a setting this vLLM build refuses), given with its
  reason.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from kvlib.config import ModelConfig
from kvlib.memory import pool_capacity

CAPACITY_LINE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                           r"([\d.]+)x")


@dataclass
class Check:
    name: str
    status: str  # "pass", "fail" or "report"
    vllm: object
    kvlib: object
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def capacity_line(line: str) -> tuple[int, int, float]:
    """``(tokens, max_model_len, concurrency)`` read from vLLM's "KV cache size" log line."""
    m = CAPACITY_LINE.search(line)
    if m is None:
        raise ValueError(f"not vLLM's capacity line: {line!r}")
    return int(m[1].replace(",", "")), int(m[2].replace(",", "")), float(m[3])


def _rows(a: dict, b: dict) -> tuple[int, int, list[str]]:
    """Requests with identical tokens, requests compared, and the ids that differ."""
    ids = sorted(set(a) & set(b))
    bad = [i for i in ids if a[i]["tokens"] != b[i]["tokens"]]
    return len(ids) - len(bad), len(ids), bad


def _same(name: str, v: object, k: object, detail: str) -> Check:
    return Check(name, "pass" if v == k else "fail", v, k, detail)


def _tokens(name: str, v: dict, k: dict, what: str) -> Check:
    same, n, bad = _rows(v, k)
    ok = n > 0 and not bad
    return Check(name, "pass" if ok else "fail", f"{n} requests", f"{same} of {n} identical",
                 f"greedy fp32 tokens of {what}, row for row" + (f"; differ: {bad}" if bad else ""))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two generations share before they first part."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(config: ModelConfig, scenarios: list[dict], vllm: dict[str, dict], kvlib: dict[str, dict]) -> list[Check]:
    """Every check, from the scenarios and each engine's results keyed by scenario name."""
    checks: list[Check] = []
    by = {s["name"]: s for s in scenarios}

    for name in ("mixed", "small"):
        if name not in by:
            continue
        v, s = vllm.get(name, {}), by[name]["llm"]
        if "error" in v:
            checks.append(Check(f"{name}: vLLM starts", "fail", v["error"], None, "vLLM refused the settings"))
            continue
        lines = [ln for ln in v["log"] if CAPACITY_LINE.search(ln)]
        want = pool_capacity(config, s["kv_cache_memory_bytes"], s["max_model_len"], s["block_size"], "fp32")
        got = capacity_line(lines[0]) if lines else None
        checks.append(Check(
            f"{name}: capacity", "pass" if got and got[0] == want[1] and f"{got[2]:.2f}" == f"{want[2]:.2f}"
            and v["cache_config"]["num_gpu_blocks"] == want[0] else "fail",
            lines[0] if lines else None,
            f"{want[0]} blocks, {want[1]:,} tokens, {want[2]:.2f}x",
            f"vLLM's log line against kvlib.memory.pool_capacity for {s['kv_cache_memory_bytes']:,} bytes, "
            f"block size {s['block_size']}, max_model_len {s['max_model_len']}"))

    steps = {n: ([p["steps"] for p in vllm[n]["phases"]], [p["steps"] for p in kvlib[n]["phases"]])
             for n in ("mixed", "small", "serving") if "phases" in vllm.get(n, {}) and "phases" in kvlib.get(n, {})}
    if steps:
        checks.append(_same("schedule: engine steps per phase", {n: v for n, (v, _) in steps.items()},
                            {n: k for n, (_, k) in steps.items()},
                            "LLMEngine.step() calls against Engine.step() calls until each phase is served: "
                            "the two schedulers make the same steps"))

    v, k = vllm.get("mixed", {}), kvlib.get("mixed", {})
    if "phases" in v and "phases" in k:
        checks.append(_tokens("tokens", v["phases"][0]["requests"], k["phases"][0]["requests"],
                              "16 mixed-length requests (block size 32)"))
        vp = {i: r for p in v["phases"][1:] for i, r in p["requests"].items()}
        kp = {i: r for p in k["phases"][1:] for i, r in p["requests"].items()}
        vc = {i: vp[i]["cached_tokens"] for i in sorted(vp)}
        kc = {i: kp[i]["cached_tokens"] for i in sorted(kp)}
        checks.append(_same("prefix caching: cached tokens per request", vc, kc,
                            "vLLM's RequestOutput.num_cached_tokens against kvlib's block-hash hits "
                            "(Sequence.cached_tokens), same requests, same block size"))
        checks.append(_tokens("prefix caching: tokens", vp, kp, "the prefix-sharing requests"))
        vt, kt = v["phases"][0]["seconds"], k["phases"][0]["seconds"]
        n_tok = sum(len(r["tokens"]) for r in k["phases"][0]["requests"].values())
        c = vllm.get("compiled", {})
        ct = c["phases"][0]["seconds"] if "phases" in c else None
        checks.append(Check(
            "throughput", "report",
            {"eager tokens/s": n_tok / vt, "compiled tokens/s": n_tok / ct if ct else None},
            {"tokens/s": n_tok / kt, "vs eager": vt / kt, "vs compiled": ct / kt if ct else None},
            f"{n_tok} tokens of the mixed requests, greedy, 2 threads, one run; a ratio above 1 means kvlib "
            "took less time"))
        if "phases" in c:
            checks.append(_tokens("compiled: tokens", c["phases"][0]["requests"], k["phases"][0]["requests"],
                                  "the mixed requests, vLLM compiled (torch.compile) against kvlib"))

    v, k = vllm.get("small", {}), kvlib.get("small", {})
    if "phases" in v and "phases" in k:
        vr, kr = v["phases"][0]["requests"], k["phases"][0]["requests"]
        vs = {i: vr[i]["first_step"] for i in sorted(vr)}
        ks = {i: kr[i]["first_step"] for i in sorted(kr)}
        budget = by["small"]["llm"]["max_num_batched_tokens"]
        checks.append(_same("chunked prefill: step of each first token", vs, ks,
                            f"max_num_batched_tokens = token_budget = {budget}; the 300-token prompt arrives at "
                            "step 3 while two requests decode"))
        checks.append(_tokens("chunked prefill: tokens", vr, kr, "the chunked-prefill requests"))
        vr, kr = v["phases"][1]["requests"], k["phases"][1]["requests"]
        vn = int(v["phases"][1]["counters"].get("vllm:num_preemptions", 0))
        kn = k["phases"][1]["counters"]["preemptions"]
        status = "pass" if vn == kn and vn > 0 else ("report" if vn > 0 and kn > 0 else "fail")
        checks.append(Check("preemption: count", status, vn, kn,
                            f"{len(kr)} requests needing more blocks than the pool's {k['num_blocks']}: "
                            "both engines must preempt" + ("" if vn == kn else
                            "; the counts differ because the two schedulers pick and re-admit differently")))
        checks.append(_tokens("preemption: tokens", vr, kr, "the preempted requests, recomputed"))

    v, k = vllm.get("serving", {}), kvlib.get("serving", {})
    if "phases" in v and "phases" in k:
        vr = {i: r for p in v["phases"] for i, r in p["requests"].items()}
        kr = {i: r for p in k["phases"] for i, r in p["requests"].items()}
        checks.append(_tokens("serving: tokens", vr, kr, "chapter 12's requests and their follow-ups"))
        checks.append(_same("serving: cached tokens", {i: vr[i]["cached_tokens"] for i in sorted(vr)},
                            {i: kr[i]["cached_tokens"] for i in sorted(kr)}, "the follow-ups find their first turn"))
        vn = sum(int(p["counters"].get("vllm:num_preemptions", 0)) for p in v["phases"])
        kn = sum(p["counters"]["preemptions"] for p in k["phases"])
        checks.append(Check("serving: preemptions", "pass" if vn == kn else "report", vn, kn,
                            f"a pool of {k['num_blocks']} blocks for all of them"))

    v, k, m = vllm.get("fp8", {}), kvlib.get("fp8", {}), kvlib.get("mixed", {})
    if "error" in v:
        checks.append(Check("fp8 cache", "report", v["error"], None, "this vLLM build refuses kv_cache_dtype='fp8'"))
    elif "phases" in v and "phases" in k and "phases" in m and "phases" in vllm.get("mixed", {}):
        v8, k8 = v["phases"][0]["requests"], k["phases"][0]["requests"]
        v32, k32 = vllm["mixed"]["phases"][0]["requests"], m["phases"][0]["requests"]
        ids = sorted(v8)
        new = sum(len(v8[i]["tokens"]) for i in ids)
        va = sum(shared_prefix(v8[i]["tokens"], v32[i]["tokens"]) for i in ids)
        ka = sum(shared_prefix(k8[i]["tokens"], k32[i]["tokens"]) for i in ids)
        same, n, _ = _rows(v8, k8)
        checks.append(Check("fp8 cache: agreement with fp32", "report",
                            {"tokens before parting": f"{va} of {new}"},
                            {"tokens before parting": f"{ka} of {new}", "rows identical to vLLM fp8": f"{same} of {n}"},
                            "kv_cache_dtype='fp8' (e4m3, scale 1.0: no calibration) against FP8Cache(scale=1.0)"))

    v, k = vllm.get("ngram", {}), kvlib.get("ngram", {})
    if "error" in v:
        checks.append(Check("n-gram speculation", "report", v["error"], None, "this vLLM build refuses it"))
    elif "phases" in v and "phases" in k:
        vr = {i: r for p in v["phases"] for i, r in p["requests"].items()}
        kr = {i: r for p in k["phases"] for i, r in p["requests"].items()}
        checks.append(_tokens("n-gram speculation: tokens", vr, kr, "the speculative prompts"))
        va = {i: [int(p["counters"].get("vllm:spec_decode_num_accepted_tokens", 0)),
                  int(p["counters"].get("vllm:spec_decode_num_draft_tokens", 0))]
              for p in v["phases"] for i in p["requests"]}
        ka = {i: [r["accepted"], r["proposed"]] for i, r in kr.items()}
        checks.append(Check("n-gram speculation: accepted/proposed", "pass" if va == ka else "report", va, ka,
                            "vLLM's ngram proposer against PromptLookupDraft, the same n-gram range and k"
                            + ("" if va == ka else "; vLLM takes the earliest match of the longest n-gram, "
                               "kvlib the most recent")))
    return checks
