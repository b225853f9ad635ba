"""``python -m kvpresscheck``: run kvpress, kvlib's presses and the reference on one passage, compare, write the record.

    python -m kvpresscheck [--python KVPRESS_PY] [--json OUT] [--against RECORD] [--only PRESS ...]

Exits 1 if any comparison fails (kept sets or tokens that differ without a tested cause), or if
``--against`` finds that a fact moved from the stored record: a side's tokens, kvpress's kept
positions, or a comparison's status, identical-head count or causes (timings are not compared).
"""

from __future__ import annotations

import json
import sys

from vllmcheck import runner_args, settle
from . import kvpress_python, table


def facts(record: dict) -> dict:
    """What must not change between runs: tokens, kvpress's kept sets, and every comparison's verdict."""
    out = {}
    for side in ("kvpress", "reference", "kvlib"):
        for name, res in record[side].items():
            out[side, name, "tokens"] = json.dumps(res.get("tokens", res.get("error")))
    for name, res in record["kvpress"].items():
        out["kvpress", name, "kept"] = json.dumps(res["kept"])
    for c in record["comparisons"]:
        out[c["side"], c["run"], "verdict"] = json.dumps(
            [c["status"], c.get("identical"), sorted(x["cause"] for x in c.get("causes", []))])
    return out


def print_table(record: dict) -> None:
    for side in ("kvlib", "reference"):
        rows = table(record, side)
        print(f"\n{side} against kvpress {record['versions']['kvpress']}:")
        cols = ["press", "ratio", "identical heads", "worst overlap", "score max |diff|", "tokens equal", "status",
                "cause"]
        print("  ".join(f"{c:>16s}" for c in cols[:-1]) + "  cause")
        for r in rows:
            print("  ".join(f"{str(r.get(c, '')):>16s}" if not isinstance(r.get(c), float) or c == "ratio"
                            else f"{r[c]:16.3g}" for c in cols[:-1]) + "  " + str(r.get("cause", "")))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = runner_args(argv, "python -m kvpresscheck", __doc__, "kvpress", "kvpress", kvpress_python,
                       only="presses to run (default: all)", against="a stored record whose facts must not move")
    if args is None:
        return 2

    from kvlib.pretrained import load_smollm2
    from .driver import run
    from .workload import passage_ids

    model, tok = load_smollm2()
    record = run(model, passage_ids(tok), args.python, presses=tuple(args.only) if args.only else None,
                 log=lambda line: print(line, flush=True))
    for name, res in record["kvpress"].items():
        print(f"kvpress {name:24s} prefill {res['prefill_seconds']:5.2f} s, {len(res['tokens'])} tokens "
              f"{res['decode_seconds']:5.2f} s")
    print_table(record)
    failed = [f"{c['side']} {c['run']}" for c in record["comparisons"] if c["status"] == "fail"]
    settle(record, args.json, args.against, facts, failed, compact=True)
    print(f"{len(record['comparisons'])} comparisons, {len(failed)} failed: {failed}, in {record['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
