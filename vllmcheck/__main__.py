"""``python -m vllmcheck``: run vLLM and kvlib on the same work, compare, write the record.

    python -m vllmcheck [--python VLLM_PY] [--json OUT] [--against RECORD] [--only NAME ...]
                        [--traces OUT] [--traces-against RECORD]
    python -m vllmcheck export DIR   # SmolLM2 in Hugging Face format, for vLLM (run with vLLM's python)

Exits 1 if any check fails, or if ``--against`` finds a token, count or step that
differs from the stored record (timings may differ: they are not compared). Chapter 12's
scenario also records both engines' paged pool, step by step: those traces and their
comparison (`vllmcheck.traces`) are a record of their own, ``--traces`` writes it and
``--traces-against`` checks every step's counts and table lengths against a stored one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import runner_args, settle, vllm_python
from .driver import export, run
from .traces import trace_facts, trace_record
from .workload import scenarios, serving_prompts, spec_prompts


DETERMINISTIC = ("tokens", "cached_tokens", "first_step")
# kvlib's FP8 rows hold on the machine that ran them, not across CPUs: a key or value within an ulp of an e4m3
# rounding boundary lands a whole FP8 step away when the fp32 kernels before it differ in their last bit (AMX,
# AVX-512 and AVX2 block their sums differently), and a greedy row parts a few tokens later. On an AVX-512 AMD
# EPYC, 2 of the record's 8 rows parted (mixed-2, mixed-6) while every fp32 row and vLLM's FP8 rows held. So of
# those rows only how many tokens each has is compared with a stored record, which may come from another CPU.
_CPU_DEPENDENT = {("kvlib", "fp8")}


def _facts(record: dict, skip: frozenset[str] = frozenset()) -> dict:
    """What must not change between runs: every request's tokens, hits and first step, and each check's status
    (a "report" only measures, so it is not compared). Scenarios in ``skip`` are left out; of the rows in
    ``_CPU_DEPENDENT``, only their token counts are kept."""
    out = {}
    for side in ("vllm", "kvlib"):
        for name, res in record[side].items():
            if name in skip:
                continue
            for i, phase in enumerate(res.get("phases", [])):
                for rid, r in phase["requests"].items():
                    if (side, name) in _CPU_DEPENDENT:
                        out[side, name, i, rid] = ("count", len(r["tokens"]))
                        continue
                    out[side, name, i, rid] = tuple(json.dumps(r.get(k)) for k in DETERMINISTIC)
    out["checks"] = tuple((c["name"], c["status"]) for c in record["checks"] if c["status"] != "report")
    return out


def refused(record: dict) -> frozenset[str]:
    """The scenarios this machine's vLLM refused to start (its FP8 cache needs AVX-512 or AMX, say)."""
    return frozenset(name for name, v in record["vllm"].items() if "error" in v)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        if len(argv) != 2:
            print(__doc__, file=sys.stderr)
            return 2
        export(argv[1])
        return 0
    def trace_args(ap):
        ap.add_argument("--traces", type=Path, default=None, help="write the pool traces' record here")
        ap.add_argument("--traces-against", type=Path, default=None,
                        help="a stored pool-trace record every step must match")

    args = runner_args(argv, "python -m vllmcheck", __doc__, "vllm", "vLLM", vllm_python,
                       only="scenarios to run (default: all)",
                       against="a stored record the tokens and counts must match", extra=trace_args)
    if args is None:
        return 2

    from kvlib import data
    from kvlib.pretrained import load_smollm2
    from .compare import Check

    model, tok = load_smollm2()
    text_ids = tok.encode(data.tiny_shakespeare("all"))
    work = [s for s in scenarios(model.config, text_ids, spec_prompts(tok), serving_prompts(tok))
            if not args.only or s["name"] in args.only]
    record = run(model, work, args.python, log=lambda line: print(line, flush=True), trace={"serving"})
    traces = {side: record[side].get("serving", {}).pop("trace", None) for side in ("kvlib", "vllm")}
    checks = [Check(**c) for c in record["checks"]]
    for c in checks:
        print(f"[{c.status:6s}] {c.name}: vLLM {c.vllm} | kvlib {c.kvlib}\n          {c.detail}")
    failed = [c.name for c in checks if c.status == "fail"]
    skip = refused(record)  # vLLM ran none of it here: the record's results for it cannot be compared
    if args.against and skip:
        print(f"vLLM refused {sorted(skip)} on this machine: not compared with {args.against}")
    settle(record, args.json, args.against, lambda r: _facts(r, skip), failed)
    if None not in traces.values():  # chapter 12's scenario ran in both engines: their pools, step by step
        traced = trace_record(traces["kvlib"], traces["vllm"], record["machine"])
        for c in (Check(**c) for c in traced["checks"]):
            print(f"[{c.status:6s}] {c.name}: vLLM {c.vllm} | kvlib {c.kvlib}\n          {c.detail}")
            failed += [c.name] if c.status == "fail" else []
        checks += [Check(**c) for c in traced["checks"]]
        settle(traced, args.traces, args.traces_against, trace_facts, failed, compact=True)
    elif args.traces or args.traces_against:
        print("no pool traces: chapter 12's scenario (serving) did not run in both engines", file=sys.stderr)
        failed.append("pool traces")
    print(f"{len(checks)} checks, {len(failed)} failed, in {record['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
