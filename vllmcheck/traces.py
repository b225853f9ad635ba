"""The paged pool of both engines on chapter 12's requests, compared step by step.

kvlib's `Engine` records its pool with `kvlib.paged.PoolTrace`, and vLLM's side with
`vllmcheck.vllm_trace.VllmPoolTrace` (its KV-cache manager's state and its own KV-cache events),
in one format (``kv-pool-trace/1``). Block ids are each engine's own, so the comparison reads what
does not depend on them: at every step, the counts of used, cached and free blocks, and for every
sequence its table's length in blocks and its length in tokens. Both traces are first replayed from
an empty pool (`kvlib.paged.replay`), so each is checked against itself before the two are compared.

* `rename`: a trace with its sequences keyed by other names (kvlib's request ids -> the workload's).
* `compare_traces`: the `Check`s, one per thing compared; where the engines differ by design, a
  ``report`` says why.
* `trace_record`, `trace_facts`: the record stored beside the cross-check's
  (``vllmcheck/data/pool_trace_cpu.json``) and what must not move between runs.
"""

from __future__ import annotations

from kvlib.paged.replay import validate
from .compare import Check


def rename(trace: dict, names: dict[str, str]) -> dict:
    """``trace`` with each sequence key ``k`` renamed ``names.get(k, k)`` (a sample "k.i" -> "names[k].i")."""
    def new(key: str) -> str:
        rid, dot, i = key.partition(".")
        return names.get(key, names.get(rid, rid) + dot + i)

    steps = []
    for s in trace["steps"]:
        events = [{**e, **{f: new(e[f]) for f in ("seq", "parent") if f in e}} for e in s["events"]]
        steps.append({**s, "events": events, "tables": {new(k): v for k, v in s["tables"].items()},
                      "lengths": {new(k): v for k, v in s["lengths"].items()}})
    return {**trace, "requests": {new(k): v for k, v in trace["requests"].items()}, "steps": steps}


def _kinds(trace: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in trace["steps"]:
        for e in s["events"]:
            out[e["kind"]] = out.get(e["kind"], 0) + 1
    return dict(sorted(out.items()))


def per_step(trace: dict) -> list[dict]:
    """What the comparison reads of each step: counts, and each sequence's blocks and tokens."""
    return [{"counts": s["counts"], "blocks": {k: len(t) for k, t in sorted(s["tables"].items())},
             "tokens": dict(sorted(s["lengths"].items()))} for s in trace["steps"]]


def compare_traces(kvlib: dict, vllm: dict) -> list[Check]:
    """Both traces replayed, then compared step by step (counts, table lengths, tokens)."""
    checks = []
    for name, t in (("kvlib", kvlib), ("vLLM", vllm)):
        try:
            validate(t)
            checks.append(Check(f"pool trace: {name} replays", "pass", None, None,
                                f"{name}'s {len(t['steps'])} steps rebuilt from their events alone, from an empty "
                                "pool, equal its recorded tables and counts at every step"))
        except ValueError as e:
            checks.append(Check(f"pool trace: {name} replays", "fail", None, None, str(e)))
    k, v = per_step(kvlib), per_step(vllm)
    checks.append(Check("pool trace: steps", "pass" if len(k) == len(v) else "fail", len(v), len(k),
                        "steps recorded, both phases of chapter 12's requests"))
    for what, detail in (("counts", "used, cached and free blocks after each step"),
                         ("blocks", "each sequence's block-table length after each step"),
                         ("tokens", "each sequence's tokens in the pool after each step")):
        differ = [i for i, (a, b) in enumerate(zip(k, v)) if a[what] != b[what]]
        checks.append(Check(f"pool trace: {what} per step", "pass" if not differ and len(k) == len(v) else "fail",
                            {"steps": len(v), "differ at": differ[:10]}, {"steps": len(k), "differ at": differ[:10]},
                            detail + " (block ids are each engine's own and are not compared)"))
    kk, vk = _kinds(kvlib), _kinds(vllm)
    checks.append(Check("pool trace: events", "report", vk, kk,
                        "events of each kind; vLLM's seal and evict come from its own KV-cache events "
                        "(BlockStored, BlockRemoved), the rest from its KV-cache manager's tables; kvlib has "
                        "no cow or fork here (n = 1), and vLLM has neither at all"))
    return checks


def trace_record(kvlib: dict, vllm: dict, machine: dict) -> dict:
    """The stored record: both traces, their comparison, and the machine that ran them."""
    return {"kvlib": kvlib, "vllm": vllm, "checks": [c.as_dict() for c in compare_traces(kvlib, vllm)],
            "machine": machine, "vllm_version": vllm["engine"].removeprefix("vllm ")}


def trace_facts(record: dict) -> dict:
    """What must not move between runs: every step as the comparison reads it, per engine, and each
    check's status (the event counts only report)."""
    out = {(side, i): repr(s) for side in ("kvlib", "vllm") for i, s in enumerate(per_step(record[side]))}
    out["checks"] = tuple((c["name"], c["status"]) for c in record["checks"] if c["status"] != "report")
    return out
