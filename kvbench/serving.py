"""Section (l): kvlib's `Engine` against vLLM's CPU build, on the cross-check's requests.

`python -m vllmcheck` ran vLLM's CPU build (in an environment of its own) and
kvlib on the same weights and requests, and stored what each did
(`vllmcheck.load_record`). vLLM needs that environment, so this section does not
run it: it serves the record's timed scenario, 16 requests of mixed lengths with 64 new
tokens each, through kvlib's `Engine` *now*, and sets the time beside vLLM's stored
eager and compiled runs of the same requests. The tokens must be vLLM's, request by
request; the times come from different runs on the same machine, so read the ratio
with the load averages both runs report.

Where kvlib's time goes is measured too: the same requests once more under
``torch.profiler``, each operator's own time sorted into the weight matmuls, attention,
and the paged cache's copies (each layer reads the decoding sequences' cached keys into a
fresh tensor with ``index_select``, and the new keys are written into it and into the pool;
a few small selects of rows, the scored positions among them, count here too). vLLM's
paged-attention kernel reads the blocks where they lie and writes each new key once, so
that copying is work its step does not do.

Two levers are measured beside the plain Engine, each on a copy of the model. vLLM's CPU
backend runs every dense projection through oneDNN's matmul on a weight reordered once at
load (``create_onednn_mm`` in ``dispatch_cpu_unquantized_gemm``), where kvlib's ``x @ W`` calls
the BLAS library: `kvlib.prepack` packs the fp32 weights the same way. And vLLM compiles its
model around attention: with ``compiled=True`` (``--compile``) the Engine runs once more with its
blocks compiled piecewise (`kvlib.piecewise`), and the first run's extra time is the compilation
(shorter where inductor's on-disk cache already holds these pieces from an earlier run). With
both, a third copy pulls both levers at once, as vLLM's compiled mode does: packed weights, each
product one opaque call in the compiled graph (``packed_compiled``).
"""

from __future__ import annotations

import copy
import time

import torch

from torch.profiler import ProfilerActivity, profile

from vllmcheck import kvlib_side, load_record
from kvlib.model import Transformer
from kvlib.piecewise import compile_blocks
from kvlib.prepack import available, prepack_weights

# operator -> the part of a paged step it belongs to (self time; the rest is everything else)
PARTS = {"aten::mm": "matmuls", "mkldnn::_linear_pointwise": "matmuls",
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
         "aten::index": "cache copies", "aten::_index_put_impl_": "cache copies",
         "aten::index_select": "cache copies", "aten::index_copy_": "cache copies"}


def _shares(timed: dict, model: Transformer) -> dict:
    """Each part's share of the profiled self time of one run of ``timed``'s requests."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kvlib_side.run(timed, model)
    ms = {part: 0.0 for part in (*dict.fromkeys(PARTS.values()), "the rest")}
    for ev in prof.key_averages():
        if ev.key != "aten::fill_":  # zeroing each fresh engine's pools (about 1 GB), outside the timed phase
            ms[PARTS.get(ev.key, "the rest")] += ev.self_cpu_time_total
    total = sum(ms.values())
    return {part: t / total for part, t in ms.items()}


def _compiled(timed: dict, model: Transformer, theirs: dict, key: str = "compiled") -> dict:
    """The same requests through a piecewise-compiled copy (`kvlib.piecewise.compile_blocks`): its
    tokens/s on a second run, and the first run's extra wall time, which is the compilation;
    ``key`` names the fields (``kvlib_{key}_tok_s``, ``compile_s`` or ``compile_s_{key}``, ...)."""
    comp = compile_blocks(copy.deepcopy(model))
    walls, runs = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        runs.append(kvlib_side.run(timed, comp)["phases"][0])
        walls.append(time.perf_counter() - t0)
    mine = runs[1]
    n_tok = sum(len(r["tokens"]) for r in mine["requests"].values())
    return {f"kvlib_{key}_tok_s": n_tok / mine["seconds"],
            "compile_s" if key == "compiled" else f"compile_s_{key}": walls[0] - walls[1],
            f"identical_requests_{key}": sum(mine["requests"][i]["tokens"] == r["tokens"] for i, r in theirs.items())}


def _packed(timed: dict, model: Transformer, theirs: dict) -> dict:
    """The same requests with the fp32 weights prepacked for oneDNN (`kvlib.prepack`), as vLLM's CPU
    backend runs its projections: tokens/s, and how many requests' tokens equal vLLM's."""
    mine = kvlib_side.run(timed, prepack_weights(copy.deepcopy(model)))["phases"][0]
    n_tok = sum(len(r["tokens"]) for r in mine["requests"].values())
    return {"kvlib_packed_tok_s": n_tok / mine["seconds"],
            "identical_requests_packed": sum(mine["requests"][i]["tokens"] == r["tokens"] for i, r in theirs.items())}


def engine_vs_vllm(model: Transformer, record: dict | None = None, shares: bool = True,
                   compiled: bool = False) -> dict:
    """(l) Tokens/s of kvlib's Engine on the record's ``mixed`` requests against vLLM's stored
    eager and compiled runs; how many requests' tokens equal vLLM's; and (``shares``) the
    profiled share of kvlib's time in each part of `PARTS` (``"shares"``). An fp32 model runs once
    more with its weights prepacked for oneDNN (``packed_vs_eager``); ``compiled``: once more with its
    blocks compiled piecewise (``compiled_vs_eager``, ``compile_s``), and with both
    (``packed_compiled_vs_eager``)."""
    rec = load_record() if record is None else record
    scenario = next(s for s in rec["scenarios"] if s["name"] == "mixed")
    timed = {**scenario, "phases": scenario["phases"][:1]}  # the 16 mixed requests: the timed phase
    masked = kvlib_side.run(timed, model, varlen=False)["phases"][0]  # the packed row under a mask
    mine = kvlib_side.run(timed, model)["phases"][0]  # varlen attention, the Engine's default
    theirs = {name: rec["vllm"][name]["phases"][0] for name in ("mixed", "compiled")}
    n_tok = sum(len(r["tokens"]) for r in mine["requests"].values())
    same = sum(mine["requests"][i]["tokens"] == r["tokens"] for i, r in theirs["mixed"]["requests"].items())
    same_masked = sum(masked["requests"][i]["tokens"] == r["tokens"] for i, r in theirs["mixed"]["requests"].items())
    out = {"tokens": n_tok, "requests": len(mine["requests"]), "identical_requests": same,
           "identical_requests_masked": same_masked,
           "kvlib_tok_s": n_tok / mine["seconds"], "kvlib_masked_tok_s": n_tok / masked["seconds"],
           "varlen_vs_masked": masked["seconds"] / mine["seconds"], "steps": mine["steps"],
           "kv_bytes_copied_per_step": mine["kv_bytes_copied"] / mine["steps"],
           "kv_bytes_copied_per_step_masked": masked["kv_bytes_copied"] / masked["steps"],
           "vllm_date": rec["machine"]["date"]}
    for name, key in (("mixed", "eager"), ("compiled", "compiled")):
        out[f"vllm_{key}_tok_s"] = n_tok / theirs[name]["seconds"]
        out[f"vs_{key}"] = theirs[name]["seconds"] / mine["seconds"]  # above 1: kvlib took less time
    if model.dtype == torch.float32 and available(torch.float32):
        out |= _packed(timed, model, theirs["mixed"]["requests"])
        out["packed_vs_eager"] = out["kvlib_packed_tok_s"] / out["kvlib_tok_s"]
        out["vs_compiled_packed"] = out["kvlib_packed_tok_s"] / out["vllm_compiled_tok_s"]
    if compiled:
        out |= _compiled(timed, model, theirs["mixed"]["requests"])
        out["compiled_vs_eager"] = out["kvlib_compiled_tok_s"] / out["kvlib_tok_s"]
        out["vs_compiled_compiled"] = out["kvlib_compiled_tok_s"] / out["vllm_compiled_tok_s"]
        if "kvlib_packed_tok_s" in out:  # both levers, as vLLM's compiled mode runs
            out |= _compiled(timed, prepack_weights(copy.deepcopy(model)), theirs["mixed"]["requests"],
                             "packed_compiled")
            out["packed_compiled_vs_eager"] = out["kvlib_packed_compiled_tok_s"] / out["kvlib_tok_s"]
            out["vs_compiled_packed_compiled"] = out["kvlib_packed_compiled_tok_s"] / out["vllm_compiled_tok_s"]
    if shares:
        out["shares"] = _shares(timed, model)
        if "kvlib_packed_tok_s" in out:  # where the packed Engine's time goes: the gap left to vLLM
            out["shares_packed"] = _shares(timed, prepack_weights(copy.deepcopy(model)))
    return out
