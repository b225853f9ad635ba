"""``python -m kvpresscheck``: run kvpress, kvlib's presses and the reference on one passage, compare, write the record.

    python -m kvpresscheck [--python KVPRESS_PY] [--json OUT] [--against RECORD] [--only PRESS ...]

Exits 1 if any comparison fails (kept sets or tokens that differ without a tested cause), or if
``--against`` finds that a fact moved from the stored record: a side's tokens, kvpress's kept
positions, or a comparison's status, agreeing-head count or causes (timings are not compared).

One thing may move between machines: a head where two scores tie to fp32 rounding at the top-k
boundary keeps one position on one CPU and the other on the next (oneDNN sums in another
order). A head that either record's comparisons explain by `compare.rounding_flip` is left out
of the kept facts, and a comparison explained by rounding alone counts as a pass with that head
agreeing. Any other move fails.
"""

from __future__ import annotations

import json
import sys

from vllmcheck import runner_args, settle
from . import kvpress_python, table


ROUNDING = "fp32 rounding at the top-k boundary"


def rounding_heads(record: dict) -> set[tuple[str, str]]:
    """``(run, "layer.head")`` for every head a comparison of ``record`` explains by rounding alone."""
    return {(c["run"], h) for c in record["comparisons"] for x in c.get("causes", [])
            if x["cause"] == ROUNDING and x.get("holds") for h in x["heads"]}


def facts(record: dict, excused: set[tuple[str, str]] = frozenset()) -> dict:
    """What must not change between runs: tokens, kvpress's kept sets (per head, less ``excused``),
    and every comparison's verdict, with a difference that rounding alone explains counted as agreement."""
    out = {}
    for side in ("kvpress", "reference", "kvlib"):
        for name, res in record[side].items():
            out[side, name, "tokens"] = json.dumps(res.get("tokens", res.get("error")))
    for name, res in record["kvpress"].items():
        for layer, heads in enumerate(res["kept"]):
            for head, kept in enumerate(heads):
                if (name, f"{layer}.{head}") not in excused:
                    out["kvpress", name, "kept", f"{layer}.{head}"] = json.dumps(kept)
    for c in record["comparisons"]:
        causes = [x for x in c.get("causes", []) if not (x["cause"] == ROUNDING and x.get("holds"))]
        flipped = len(rounding_heads({"comparisons": [c]}))
        status = "pass" if c["status"] == "explained" and not causes else c["status"]
        agree = None if c.get("identical") is None else c["identical"] + flipped
        out[c["side"], c["run"], "verdict"] = json.dumps([status, agree, sorted(x["cause"] for x in causes)])
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
    excused = rounding_heads(record)
    if args.against:
        excused |= rounding_heads(json.loads(args.against.read_text()))
    settle(record, args.json, args.against, lambda r: facts(r, excused), failed, compact=True)
    print(f"{len(record['comparisons'])} comparisons, {len(failed)} failed: {failed}, in {record['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
