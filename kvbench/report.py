"""The report: what the run was measured on, one table row per measurement, the book's targets.

`main` collects every section's results into one dict ``r`` (keys ``generation``,
``decode``, ``hf``, ``hf_bf16``, ``roofline``, ``same_bytes``, ``precision``, ``split_kv``, ``paged_read``
and, with ``--compile``, ``compile``; with ``--chunked``, ``chunked`` and ``chunked_masked``; with ``--invariant``,
``invariant``). This module only reads it:

* `machine_info` and `header`: versions, threads and the load average before and after,
  because a CPU shared with other processes gives noisy numbers;
* `table_rows`: section, case, measured, compared with, ratio, note, one row each;
* `targets`: each claim the book makes, its measured value and PASS / MISS / n/a;
* `json_ready`: ``r`` in plain JSON types, for ``--json`` (the stored record
  `kvbench.load_record` is such a file).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

from .plan import Plan
from .precision import BATCH
from .roofline import MATVEC_BIG, MATVEC_COUNT, MATVEC_SMALL

DATA = Path(__file__).resolve().parent / "data"  # the stored runs: bench_<name>.json


# -- the machine --------------------------------------------------------------------------
def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_info(threads: int) -> dict:
    """What the numbers were measured on."""
    return {"torch": torch.__version__, "threads": threads, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor(), "loadavg_start": load_average(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def header(m: dict) -> str:
    """Two lines on the machine (`machine_info`, plus ``loadavg_end``): versions, threads, load."""
    load = [("n/a" if m.get(k) is None else f"{m[k]:.2f}") for k in ("loadavg_start", "loadavg_end")]
    return (f"kvlib bench | torch {m['torch']} | {m['threads']} threads of {m['cpu_count']} CPUs | "
            f"{m['platform']} | {m['date']}\n"
            f"1-min load average: {load[0]} at start, {load[1]} at end "
            "(well above the thread count means other processes competed: expect noise)")


# -- the table ------------------------------------------------------------------------------
def _same(ok: bool) -> str:
    return "tokens same" if ok else "TOKENS DIFFER"


def table_rows(r: dict, plan: Plan) -> list[tuple[str, ...]]:
    """One row per measurement: section, case, measured, compared with, ratio, note.

    The first row is the column names. ``r["compile"]`` is optional (``--compile``).
    """
    rows = [("section", "case", "measured", "compared", "ratio", "note")]
    for n, g in r["generation"].items():  # (a)
        rows.append(("generate", f"prompt {plan.prompt_len} + {n}", f"cached {g['cached_s']:.2f} s",
                     f"naive {g['naive_s']:.2f} s", f"{g['speedup']:.1f}x",
                     f"{_same(g['identical'])}; FLOPs {g['flops_ratio']:.0f}x; "
                     f"naive {g['naive_gflops']:.0f} GFLOP/s, cached {g['cached_gflops']:.1f}"))
    for c, d in r["decode"].items():  # (b)
        rows.append(("decode", f"context {c}", f"{d['ms']:.1f} ms/token", f"vs context {plan.contexts[0]}",
                     f"{d['ratio']:.2f}x", ""))
    h = r["hf"]  # (c)
    rows.append(("vs HF", f"prompt {plan.prompt_len} + {h['new_tokens']}", f"kvlib {h['kvlib_tok_s']:.1f} tok/s",
                 f"HF {h['hf_tok_s']:.1f} tok/s", f"{h['ratio']:.2f}x", _same(h["identical"])))
    sb = r["same_bytes"]  # (e)
    rows.append(("same bytes", f"decode, context {plan.contexts[0]}", f"{sb['decode_ms']:.1f} ms",
                 f"matvecs {sb['matvec_ms']:.1f} ms", f"{100 * sb['matvec_ms'] / sb['decode_ms']:.0f}%",
                 "x @ W over the model's own matrices vs the step, fastest of each, taking turns"))
    prec = r["precision"]  # (f)
    for name, p in prec.items():
        default = " (default)" if name == prec["fp32"].get("bf16_default") else ""  # load_smollm2(dtype=bf16)'s
        rows.append(("precision", f"{name}{default} weights, context {plan.contexts[0]}", f"{p['ms']:.1f} ms/token",
                     f"fp32 {prec['fp32']['ms']:.1f} ms", f"{p['speedup']:.2f}x",
                     f"{p['weight_bytes'] / 1e6:.0f} MB; matrices alone {p['kernel_ms']:.1f} ms "
                     f"({p['kernel_speedup']:.2f}x), overhead {p['overhead_ms']:.1f} ms"))
        rows.append(("", f"  batch {BATCH}", f"{p['ms_b8']:.1f} ms/step", f"fp32 {prec['fp32']['ms_b8']:.1f} ms",
                     f"{p['speedup_b8']:.2f}x", f"matrices alone {p['kernel_ms_b8']:.1f} ms "
                     f"({p['kernel_speedup_b8']:.2f}x)"))
        rows.append(("", "  quality", f"ppl {p['perplexity']:.2f}", "vs fp32 | bf16",
                     f"{100 * (p['ppl_ratio'] - 1):+.1f}% | {100 * (p['ppl_ratio_bf16'] - 1):+.1f}%",
                     f"agreement {p['agreement']:.3f} | {p['agreement_bf16']:.3f}"))
    h = r["hf_bf16"]  # (g)
    rows.append(("vs HF", f"bf16, prompt {plan.prompt_len} + {h['new_tokens']}", f"kvlib {h['kvlib_tok_s']:.1f} tok/s",
                 f"HF {h['hf_tok_s']:.1f} tok/s", f"{h['ratio']:.2f}x",
                 f"first {h['identical_prefix']} of {h['new_tokens']} new tokens identical"))
    for ctx, a in r.get("attention", {}).items():  # (h)
        rows.append(("attention", f"decode, context {int(ctx):,}, all layers",
                     f"grouped {a['grouped']:.1f} GB/s", f"sdpa {a['sdpa']:.1f} GB/s",
                     f"{a['grouped'] / a['sdpa']:.2f}x", f"matvec over the same bytes {a['matvec']:.1f} GB/s: "
                     f"grouped {100 * a['grouped'] / a['matvec']:.0f}%, sdpa {100 * a['sdpa'] / a['matvec']:.0f}%"))
    sk = r["split_kv"]  # (h)
    for name, ms in sk.items():
        if name != "sdpa":
            rows.append(("split-KV", f"context {plan.split_context}, {name}", f"{ms:.2f} ms",
                         f"sdpa {sk['sdpa']:.2f} ms", f"{sk['sdpa'] / ms:.2f}x", "one layer's decode attention"))
    if "paged_read" in r:  # (n)
        pr = r["paged_read"]
        cand, sh = pr["candidates"], pr["shapes"]
        base = cand["gather (kvlib varlen)"]["ms_per_layer"]
        for name, c in cand.items():
            note = (f"K/V copied {c['bytes_copied'] / 2**20:.2f} MiB/layer/step; setup {c['setup_ms_per_step']:.2f} "
                    f"ms/step; max err {c['max_abs_err']:.1e}{'' if c['ok'] else ' (OVER atol)'}")
            if "compile_s" in c:
                note += (f"; compiling took {c['compile_s']:.1f} s, next step {c['next_step_s'] * 1e3:.1f} ms, "
                         f"recompiles {c['recompiles_on_next_step']}")
            rows.append(("paged read", f"batch {sh['batch']}, {name}", f"{c['ms_per_layer']:.2f} ms/layer",
                         f"gather {base:.2f} ms", f"{base / c['ms_per_layer']:.2f}x", note))
    if "compile" in r:  # (i)
        c = r["compile"]
        rows.append(("compile", f"decode, context {plan.contexts[0]}", f"compiled {c['compiled_ms']:.1f} ms",
                     f"eager {c['eager_ms']:.1f} ms", f"{c['speedup']:.2f}x",
                     f"compiling took {c['compile_s']:.0f} s, {c['recompile_s']:.0f} s again with its cache warm"))
        rows.append(("compile", "overhead: step - its matrices", f"compiled {c['overhead_compiled_ms']:.1f} ms",
                     f"eager {c['overhead_eager_ms']:.1f} ms", f"matrices {c['kernel_ms']:.1f} ms",
                     f"operator calls {c['ops_compiled']:,} compiled, {c['ops_eager']:,} eager"))
    if "chunked" in r:  # (j)
        c = r["chunked"]
        rows.append(("chunked", f"{c['prefill_steps']} steps, {c['forwards_per_step']:.0f} forward each",
                     f"longest pause {c['max_pause_ms']:.0f} ms", f"decode step {c['decode_step_ms']:.0f} ms",
                     f"{c['pause_ratio']:.1f}x", "running sequences while a long prompt is chunked in"))
    if "chunked_masked" in r:  # (j), the same run with the packed row under a mask
        c, m = r["chunked"], r["chunked_masked"]
        if "chunked_packed" in r:
            k = r["chunked_packed"]
            rows.append(("chunked", "longest pause: varlen, fp32 prepacked / masked row",
                         f"packed {k['max_pause_ms']:.0f} ms", f"masked {m['max_pause_ms']:.0f} ms",
                         f"{k['max_pause_ms'] / m['max_pause_ms']:.2f}x",
                         f"tokens same as the masked row: {'yes' if k['tokens'] == m['tokens'] else 'no'}"))
        rows.append(("chunked", "longest pause: varlen / masked row", f"varlen {c['max_pause_ms']:.0f} ms",
                     f"masked {m['max_pause_ms']:.0f} ms", f"{c['max_pause_ms'] / m['max_pause_ms']:.2f}x",
                     f"tokens the same: {'yes' if c['tokens'] == m['tokens'] else 'no'}"))
    if "invariant" in r:  # (k)
        v = r["invariant"]
        for what in ("prefill", "decode"):
            at = f"prompt {v['prompt_len']}" if what == "prefill" else f"context {v['context']}"
            rows.append(("invariant", f"{what}, {at}", f"invariant {v['ms'][f'invariant {what}']:.1f} ms",
                         f"default {v['ms'][f'default {what}']:.1f} ms", f"{v[f'{what}_ratio']:.1f}x slower",
                         "cached = recomputed bit for bit: " + ", ".join(
                             f"{k} {'yes' if b else 'no'}" for k, b in v["cached_equals_recomputed"].items())))
    if "serving" in r:  # (l)
        v = r["serving"]
        rows.append(("vs vLLM", f"Engine, {v['requests']} requests, {v['tokens']:,} tokens",
                     f"kvlib {v['kvlib_tok_s']:.1f} tok/s", f"vLLM compiled {v['vllm_compiled_tok_s']:.1f}",
                     f"{v['vs_compiled']:.2f}x", f"vLLM eager {v['vllm_eager_tok_s']:.1f} ({v['vs_eager']:.2f}x), "
                     f"stored {v['vllm_date']}; {v['identical_requests']}/{v['requests']} requests' tokens same"))
        if "kvlib_masked_tok_s" in v:
            rows.append(("vs vLLM", "Engine: varlen attention / masked row", f"varlen {v['kvlib_tok_s']:.1f} tok/s",
                         f"masked {v['kvlib_masked_tok_s']:.1f}", f"{v['varlen_vs_masked']:.2f}x",
                         f"K/V copied per step {v['kv_bytes_copied_per_step'] / 2**20:.1f} MiB varlen, "
                         f"{v['kv_bytes_copied_per_step_masked'] / 2**20:.1f} MiB masked; masked tokens same "
                         f"{v['identical_requests_masked']}/{v['requests']}"))
        levers = (("packed", "fp32 weights prepacked / plain", "oneDNN's kernel, as vLLM runs its projections; "),
                  ("compiled", "blocks compiled piecewise / eager", f"compile {v.get('compile_s', 0):.1f} s; "),
                  ("packed_compiled", "prepacked and compiled / plain",
                   f"both levers, compile {v.get('compile_s_packed_compiled', 0):.1f} s; "))
        for key, case, what in levers:  # each lever beside the plain Engine, where it was measured
            if f"kvlib_{key}_tok_s" in v:
                rows.append(("vs vLLM", f"Engine: {case}", f"{key.replace('_', '+')} {v[f'kvlib_{key}_tok_s']:.1f} tok/s",
                             f"plain {v['kvlib_tok_s']:.1f}", f"{v[f'{key}_vs_eager']:.2f}x",
                             f"{what}against vLLM compiled {v[f'vs_compiled_{key}']:.2f}x; tokens same "
                             f"{v[f'identical_requests_{key}']}/{v['requests']}"))
        for key, which in (("shares", "kvlib's time, profiled"), ("shares_packed", "packed Engine, profiled")):
            if key in v:
                sh = v[key]
                rows.append(("vs vLLM", which, f"copies {sh['cache copies']:.0%}", f"matmuls {sh['matmuls']:.0%}",
                             f"attention {sh['attention']:.0%}",
                             f"the rest {sh['the rest']:.0%}; copies: gathering blocks, writing new keys"))
    for n, t in r.get("threads", {}).items():  # (m)
        one = r["threads"]["1"]
        rows.append(("threads", f"{n}, decode context {plan.contexts[0]}", f"{t['decode_ms']:.1f} ms",
                     "1 thread", f"{one['decode_ms'] / t['decode_ms']:.2f}x",
                     f"matrices alone {t['kernel_ms']:.1f} ms ({one['kernel_ms'] / t['kernel_ms']:.2f}x)"))
    f = r["roofline"]  # (d), last: it reads the decode steps of (b) against the matvec ceilings
    big, small = f"{MATVEC_BIG}x{MATVEC_BIG}", f"{MATVEC_SMALL[0]}x{MATVEC_SMALL[1]}"
    for name, label in (("big", big), ("small", f"{MATVEC_COUNT} x {small}")):
        a, b = f[f"{name}_in_out_gbs"], f[f"{name}_out_in_gbs"]
        rows.append(("matvec", label, f"(in,out) {a:.1f} GB/s", f"(out,in) {b:.1f} GB/s", f"{a / b:.2f}x",
                     "x @ W vs F.linear"))
    for key, d in f.items():
        if key.startswith("decode_ctx"):
            rows.append(("roofline", f"decode, context {key[10:]}", f"{d['gbs']:.1f} GB/s",
                         f"{d['bytes'] / 1e6:.0f} MB/token", f"{100 * d['fraction']:.0f}%",
                         f"of {big} (in,out) matvec; {100 * d['fraction_small']:.0f}% of {small}"))
    return rows


# -- the targets ----------------------------------------------------------------------------
def _share(v: dict, part: str) -> str:
    return f"{v['shares'][part]:.0%}" if "shares" in v else "(not profiled)"


def _engine_why(v: dict, r: dict) -> str:
    """Where the Engine's time goes, and what the two levers measured here gave."""
    text = (f"bound: of kvlib's profiled time, matmuls {_share(v, 'matmuls')}, attention {_share(v, 'attention')}, "
            f"cache copies {_share(v, 'cache copies')}, everything else {_share(v, 'the rest')}")
    if "packed_vs_eager" in v:
        text += (f"; with its fp32 weights prepacked for oneDNN, as vLLM runs its projections, the Engine ran "
                 f"{v['packed_vs_eager']:.2f}x its plain speed ({v['vs_compiled_packed']:.2f}x vLLM compiled)")
    if "shares_packed" in v:
        sh = v["shares_packed"]
        text += (f", and its time went to matmuls {sh['matmuls']:.0%}, attention {sh['attention']:.0%}, cache "
                 f"copies {sh['cache copies']:.0%}, everything else {sh['the rest']:.0%}")
    if "compiled_vs_eager" in v:
        text += (f"; its blocks compiled piecewise ran {v['compiled_vs_eager']:.2f}x eager (compile "
                 f"{v['compile_s']:.0f} s), compiling fuses what lies between the matmuls and leaves them to the same kernel")
    if "packed_compiled_vs_eager" in v:
        text += (f"; packed and compiled together, {v['packed_compiled_vs_eager']:.2f}x its plain speed "
                 f"({v['vs_compiled_packed_compiled']:.2f}x vLLM compiled)")
    flex = r.get("paged_read", {}).get("candidates", {}).get("flex (compiled)")
    if flex and "ms_per_layer" in flex:
        gather = r["paged_read"]["candidates"]["gather (kvlib varlen)"]
        text += (f"; reading the blocks in place (compiled flex, (n)) took {flex['ms_per_layer']:.2f} ms a layer "
                 f"against the gather's {gather['ms_per_layer']:.2f}")
    return text + f". Against vLLM eager kvlib is {v['vs_eager']:.2f}x (vLLM's runs stored {v['vllm_date']})"


def _why(cond: bool, text: str) -> str | None:
    return text if cond else None


def targets(r: dict, plan: Plan) -> list[dict]:
    """The book's claims, each with its measured value (None if this plan does not measure it).

    ``pass`` is True or False, or None when not measured; a claim with an extra condition
    (kvlib vs HF in fp32 must also give identical tokens) passes only if that holds too.
    ``why`` is the measured bound behind a miss, where the run measured one: the kernels'
    own speed over the same matrices, the overhead above them, attention's own bandwidth.
    """
    g, d, f, h = r["generation"], r["decode"], r["roofline"], r["hf"]
    sb, p, hb = r["same_bytes"], r["precision"], r["hf_bf16"]
    lo, hi = plan.contexts[0], plan.contexts[-1]
    p32, b16 = p["fp32"], p["fp32"].get("best_bf16", "bf16")
    d16 = p32.get("bf16_default")  # what load_smollm2(dtype=bf16) gave; None in records from before it was kept
    pause = "chunked_packed" if "chunked_packed" in r else "chunked"  # the Engine as vLLM runs it, where measured
    pause_how = ", fp32 prepacked," if pause == "chunked_packed" else ""
    att = r.get("attention", {}).get(str(max(plan.attention_contexts)))
    v = r.get("serving")

    def kernels(name: str, over: str, b8: bool = False) -> str:
        key, ms = ("kernel_ms_b8", "ms_b8") if b8 else ("kernel_ms", "ms")
        x = p[over][key] / p[name][key]
        return (f"bound: {name}'s matrix kernels alone are {x:.2f}x {over}'s over the same matrices "
                f"({p[name][key]:.1f} against {p[over][key]:.1f} ms), and its overhead above them is "
                f"{p[name][ms] - p[name][key]:.1f} ms against {p[over][ms] - p[over][key]:.1f}")

    rows = [  # (claim, measured, op, threshold, also required, why it misses)
        ("cached/naive speedup at 128 new tokens", g["128"]["speedup"] if "128" in g else None, ">=", 5.0, True, None),
        ("cached/naive speedup at 256 new tokens", g["256"]["speedup"] if "256" in g else None, ">=", 10.0, True, None),
        (f"decode latency(ctx {hi}) / latency(ctx {lo})", d[str(hi)]["ratio"], "<=", 1.5, True, None),
        ("kvlib/HF tokens/s, fp32, identical tokens", h["ratio"], ">=", 1.3, h["identical"], None),
        (f"decode (ctx {lo}) / {MATVEC_BIG}^2 matvec bandwidth", f[f"decode_ctx{lo}"]["fraction"], ">=", 0.6, True, None),
        # chapter 11's: the decode-speed sections
        ("decode / bare matvecs over the same matrices", sb["matvec_ms"] / sb["decode_ms"], ">=", 0.8, True,
         f"bound: the step's overhead above its matrices, {sb['decode_ms'] - sb['matvec_ms']:.1f} ms of "
         f"{sb['decode_ms']:.1f} (norms, RoPE, attention, the cache, the dispatcher), which smaller weights cut "
         "only in part" + (f"; compiling cut {1 - c['overhead_compiled_ms'] / c['overhead_eager_ms']:.0%} of it in (i)"
                           if (c := r.get("compile")) and "overhead_eager_ms" in c else "")),
        (f"bf16 ({b16}) decode speedup over fp32, batch 1", p[b16]["speedup"], ">=", 1.6, True, kernels(b16, "fp32")),
        (f"bf16 ({d16}) decode speedup over fp32, batch 1, through load_smollm2(dtype=bf16)",
         None if d16 is None else p[d16]["speedup"], ">=", 1.1, True, None if d16 is None else kernels(d16, "fp32")),
        (f"bf16 decode speedup over fp32, batch {BATCH}", max(p[n]["speedup_b8"] for n in ("bf16", "bf16 packed") if n in p),
         ">=", 2.0, True, kernels("bf16 packed" if "bf16 packed" in p else "bf16", "fp32", True)),
        ("bf16 perplexity / fp32 (within 1%)", p["bf16"]["ppl_ratio"], "<=", 1.01, True, None),
        ("bf16 next-token agreement with fp32", p["bf16"]["agreement"], ">=", 0.97, True, None),
        ("int8 decode speedup over bf16", p["int8"]["vs_bf16"], ">=", 1.6, True, kernels("int8", b16)),
        ("int8 perplexity / bf16 (within 2%)", p["int8"]["ppl_ratio_bf16"], "<=", 1.02, True, None),
        ("int8 next-token agreement with bf16", p["int8"]["agreement_bf16"], ">=", 0.95, True,
         f"bound: int8's one scale per output channel is off the grid SmolLM2's layer matrices were stored on "
         f"(Q4_1, groups of 32): int4 in groups of 32, on that grid, agrees {p['int4']['agreement_bf16']:.1%}"
         if "int4" in p else None),
        ("int4 decode speedup over bf16", p["int4"]["vs_bf16"] if "int4" in p else None, ">=", 2.0, True,
         kernels("int4", b16) if "int4" in p else None),
        (f"attention at {max(plan.attention_contexts):,} tokens / matvec bandwidth",
         None if att is None else att["grouped"] / att["matvec"], ">=", 0.7, True,
         None if att is None else
         f"bound: the fused kernel's own rate, {att['grouped']:.1f} GB/s with each KV head read once "
         f"({att['sdpa']:.1f} reading it once per query head), against {att['matvec']:.1f} for a matvec: "
         "it computes scores for a few queries per block of keys, which a streaming matvec does not"),
        ("kvlib/HF tokens/s, bf16", hb["ratio"], ">=", 1.3, True, None),
        ("kvlib Engine, fp32 weights prepacked as vLLM's (and compiled, with --compile) / vLLM CPU compiled, "
         "tokens/s", None if v is None or "vs_compiled_packed" not in v else v.get("vs_compiled_packed_compiled",
                                                                                   v["vs_compiled_packed"]), ">=", 1.0,
         v is None or v.get(f"identical_requests_{'packed_compiled' if 'vs_compiled_packed_compiled' in v else 'packed'}")
         == v["requests"], None if v is None else _engine_why(v, r)),
        ("kvlib Engine / vLLM CPU compiled, tokens/s", None if v is None else v["vs_compiled"], ">=", 1.3,
         v is None or v["identical_requests"] == v["requests"], None if v is None else _engine_why(v, r)),
        (f"longest pause while a 1,000-token prompt arrives, varlen{pause_how} / masked row",
         None if "chunked_masked" not in r else r[pause]["max_pause_ms"] / r["chunked_masked"]["max_pause_ms"],
         "<=", 0.7, "chunked_masked" not in r or r[pause]["tokens"] == r["chunked_masked"]["tokens"],
         None if "chunked_masked" not in r else
         f"bound: varlen attention alone gave {r['chunked']['max_pause_ms'] / r['chunked_masked']['max_pause_ms']:.2f}x; "
         "the pause is the step that carries a chunk of the long prompt, and its matmuls dominate it"),
        ("kvlib best decode / llama.cpp on the same weights", None, ">=", 0.5, True,
         "not measured: llama-cpp-python builds from source (about 15 minutes here), so it is kept out of CI"),
    ]
    out = []
    for claim, value, op, threshold, also, why in rows:
        ok = None if value is None else also and (value >= threshold if op == ">=" else value <= threshold)
        out.append({"claim": f"{claim} {op} {threshold:g}", "measured": value, "pass": ok,
                    "why": why if ok is not True else None})
    return out


# -- output ---------------------------------------------------------------------------------
def print_report(r: dict, plan: Plan) -> None:
    """The machine, one table row per measurement, and each target's verdict, on stdout."""
    print(header(r["machine"]))
    rows = table_rows(r, plan)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\ntargets")
    for t in r["targets"]:
        verdict = {None: "n/a ", True: "PASS", False: "MISS"}[t["pass"]]
        shown = "not measured" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"  {verdict}  {t['claim']:<60} measured {shown}")
        if t.get("why"):
            print(f"        why: {t['why']}")


def json_ready(x: object) -> object:
    """``x`` in plain JSON types: ints stay ints and floats floats, tuples become lists,
    and numpy or torch scalars become the Python number they hold."""
    if isinstance(x, dict):
        return {str(k): json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "item"):  # a numpy or torch scalar
        return x.item()
    raise TypeError(f"cannot write {type(x).__name__} as JSON: {x!r}")


# -- the stored runs ----------------------------------------------------------------------
def load_record(name: str = "cpu") -> dict:
    """The stored ``python -m kvbench --compile --json`` run ``kvbench/data/bench_<name>.json``, as a dict.

    It was written on the machine that builds the book: measurements too slow to repeat inside
    a chapter (Hugging Face's loader, ``torch.compile``), kept as data with their date, machine
    and load, so a chapter can quote them and say where they came from.
    """
    path = DATA / f"bench_{name}.json"
    if not path.is_file():
        have = sorted(p.stem.removeprefix("bench_") for p in DATA.glob("bench_*.json"))
        raise ValueError(f"no stored bench record {name!r}; kvbench has {have}")
    return json.loads(path.read_text(encoding="utf-8"))
