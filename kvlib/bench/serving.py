"""Section (l): kvlib's `Engine` against vLLM's CPU build, on the cross-check's requests.

`python -m kvlib.crosscheck` ran vLLM's CPU build (in an environment of its own) and
kvlib on the same weights and requests, and stored what each did
(`kvlib.crosscheck.load_record`). vLLM needs that environment, so this section does not
run it: it serves the record's timed scenario, 16 requests of mixed lengths with 64 new
tokens each, through kvlib's `Engine` *now*, and sets the time beside vLLM's stored
eager and compiled runs of the same requests. The tokens must be vLLM's, request by
request; the times come from different runs on the same machine, so read the ratio
with the load averages both runs report.
"""

from __future__ import annotations

from ..crosscheck import kvlib_side, load_record
from ..model import Transformer


def engine_vs_vllm(model: Transformer, record: dict | None = None) -> dict:
    """(l) Tokens/s of kvlib's Engine on the record's ``mixed`` requests against vLLM's stored
    eager and compiled runs; and how many requests' tokens equal vLLM's."""
    rec = load_record() if record is None else record
    scenario = next(s for s in rec["scenarios"] if s["name"] == "mixed")
    timed = {**scenario, "phases": scenario["phases"][:1]}  # the 16 mixed requests: the timed phase
    mine = kvlib_side.run(timed, model)["phases"][0]
    theirs = {name: rec["vllm"][name]["phases"][0] for name in ("mixed", "compiled")}
    n_tok = sum(len(r["tokens"]) for r in mine["requests"].values())
    same = sum(mine["requests"][i]["tokens"] == r["tokens"] for i, r in theirs["mixed"]["requests"].items())
    out = {"tokens": n_tok, "requests": len(mine["requests"]), "identical_requests": same,
           "kvlib_tok_s": n_tok / mine["seconds"], "vllm_date": rec["machine"]["date"]}
    for name, key in (("mixed", "eager"), ("compiled", "compiled")):
        out[f"vllm_{key}_tok_s"] = n_tok / theirs[name]["seconds"]
        out[f"vs_{key}"] = theirs[name]["seconds"] / mine["seconds"]  # above 1: kvlib took less time
    return out
