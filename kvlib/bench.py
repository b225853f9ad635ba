"""Measure the book's performance claims on this machine, all in one run.

    python -m kvlib.bench [--json PATH] [--quick] [--threads N] [--compile]

(a) cached vs naive generation on SmolLM2, (b) per-token decode latency as the
context grows, (c) kvlib vs Hugging Face ``generate`` on the same weights, and
(d) a roofline: how close a decode step gets to the memory bandwidth that a
plain matrix-vector product achieves. Sections (e)-(i), the decode-speed ones of
chapter 11, live in `kvlib.bench_fast`; the timing helpers in `kvlib.timing`.
This module is the plan, the report and the command line. CPUs are noisy, so
read ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass

import torch

from . import cost, timing
from .bench_fast import (compiled_step, fast_rows, fast_targets, hf_bf16, precision_ladder, race_hf, same_bytes,
                         split_vs_sdpa)
from .data import tiny_shakespeare
from .generate import generate, generate_naive
from .model import Transformer
from .pretrained import Tokenizer, load_smollm2, smollm2_gguf_path
from .validate import positive_int

PROMPT_TEXT = (
    "The printing press changed Europe in ways its inventor could not have foreseen. Before Gutenberg, "
    "a book was copied by hand, one page at a time, and a large library held a few hundred volumes. "
    "Within fifty years of his first Bible, printers in more than two hundred towns had produced millions "
    "of books, and ideas that once travelled at the pace of a scribe now crossed the continent in months."
)
MATVEC_BIG = 8192  # a square fp32 matrix of 256 MiB: far larger than any CPU cache
MATVEC_SMALL = (576, 1728)  # a SmolLM2-sized (in, out) matrix...
MATVEC_COUNT = 60  # ...times 60 distinct copies, so that they do not sit in cache


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the prompt, what each section measures, and how often."""

    prompt_len: int
    new_tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    hf_tokens: int
    cached_repeats: int
    naive_repeats: int
    decode_steps: int
    matvec_repeats: int
    text_tokens: int = 512  # Tiny Shakespeare tokens each precision is scored on
    split_context: int = 8192  # the cache length split-KV is timed at
    splits: tuple[int, ...] = (2, 4, 8, 16)


FULL = Plan(64, (32, 64, 128, 256), (64, 256, 1024), 64, 3, 1, 20, 20)
QUICK = Plan(16, (8, 16), (16, 64), 8, 1, 1, 5, 5, 64, 512, (2, 4))


# -- inputs ------------------------------------------------------------------------------
def prompt_ids(tok: Tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` token ids of `PROMPT_TEXT`, as a ``(1, n)`` LongTensor."""
    ids = tok.encode(PROMPT_TEXT)
    if not 1 <= n <= len(ids):
        raise ValueError(f"prompt length must lie in [1, {len(ids)}] (PROMPT_TEXT's tokens), got {n}")
    return torch.tensor([ids[:n]])


def load_hf_smollm2():
    """The same GGUF weights in transformers, fp32, with its logging and progress bars off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = smollm2_gguf_path()
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF dequantizer's own tqdm bar
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return hf.eval()


def hf_vs_kvlib(model: Transformer, hf, ids: torch.Tensor, n: int, repeats: int = 3) -> dict:
    """Tokens/s of HF and kvlib greedy generation, runs alternated so noise hits both."""
    tps, outs = race_hf(model, hf, ids, n, repeats)
    return {"new_tokens": n, "hf_tok_s": tps["hf"], "kvlib_tok_s": tps["kvlib"], "ratio": tps["kvlib"] / tps["hf"],
            "identical": torch.equal(outs["hf"], outs["kvlib"])}


# -- the four sections ----------------------------------------------------------------------
def bench_generation(model: Transformer, ids: torch.Tensor, plan: Plan) -> dict:
    """(a) Cached vs naive greedy generation for each ``plan.new_tokens``."""
    generate(model, ids, 4)  # warm up the allocator and kernels once for the whole section
    generate_naive(model, ids, 2)
    out = {}
    for n in plan.new_tokens:
        a, tc = timing.time_generation(model, ids, n, repeats=plan.cached_repeats)
        b, tn = timing.time_generation(model, ids, n, naive=True, repeats=plan.naive_repeats)
        flops = [f(model.config, ids.shape[1], n) for f in (cost.naive_flops, cost.cached_flops)]
        out[str(n)] = {"cached_s": tc["median"], "naive_s": tn["median"], "speedup": tn["median"] / tc["median"],
                       "identical": torch.equal(a, b), "flops_ratio": flops[0] / flops[1],
                       # naive is compute-bound, cached is bandwidth-bound: these two rates set the speedup
                       "naive_gflops": flops[0] / tn["median"] / 1e9, "cached_gflops": flops[1] / tc["median"] / 1e9}
    return out


def bench_decode(model: Transformer, ids: torch.Tensor, plan: Plan) -> dict:
    """(b) Median ms per decode step at each of ``plan.contexts``, and its ratio to the first."""
    steppers = {c: timing.decode_stepper(model, ids, c) for c in plan.contexts}
    times = {c: [] for c in plan.contexts}
    for step in steppers.values():
        timing.timeit(step, warmup=2, repeats=1)
    for _ in range(plan.decode_steps):  # round-robin: drift in machine load hits every context alike
        for c, step in steppers.items():
            times[c].append(timing.timeit(step, warmup=0, repeats=1)["median"])
    first = statistics.median(times[plan.contexts[0]])
    return {str(c): {"ms": 1e3 * statistics.median(t), "ratio": statistics.median(t) / first} for c, t in times.items()}


def bench_roofline(model: Transformer, decode: dict, plan: Plan) -> dict:
    """(d) Matvec bandwidth in both layouts, and the bandwidth (b)'s decode steps achieved."""
    big = timing.matvec_bandwidth(MATVEC_BIG, MATVEC_BIG, 1, plan.matvec_repeats)
    small = timing.matvec_bandwidth(*MATVEC_SMALL, MATVEC_COUNT, plan.matvec_repeats)
    out = {"big_in_out_gbs": big["in_out"], "big_out_in_gbs": big["out_in"],
           "small_in_out_gbs": small["in_out"], "small_out_in_gbs": small["out_in"]}
    for ctx in (plan.contexts[0], plan.contexts[-1]):
        nbytes = cost.decode_bytes_per_token(model.config, ctx, dtype=model.dtype.itemsize)
        gbs = nbytes / (decode[str(ctx)]["ms"] / 1e3) / 1e9
        out[f"decode_ctx{ctx}"] = {"bytes": nbytes, "gbs": gbs, "fraction": gbs / out["big_in_out_gbs"],
                                   "fraction_small": gbs / out["small_in_out_gbs"]}
    return out


# -- reporting ------------------------------------------------------------------------------
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


def _same(ok: bool) -> str:
    return "tokens same" if ok else "TOKENS DIFFER"


def table_rows(r: dict, plan: Plan) -> list[tuple[str, ...]]:
    """One row per measurement: section, case, measured, compared with, ratio, note."""
    rows = [("section", "case", "measured", "compared", "ratio", "note")]
    for n, g in r["generation"].items():
        rows.append(("generate", f"prompt {plan.prompt_len} + {n}", f"cached {g['cached_s']:.2f} s",
                     f"naive {g['naive_s']:.2f} s", f"{g['speedup']:.1f}x",
                     f"{_same(g['identical'])}; FLOPs {g['flops_ratio']:.0f}x; "
                     f"naive {g['naive_gflops']:.0f} GFLOP/s, cached {g['cached_gflops']:.1f}"))
    for c, d in r["decode"].items():
        rows.append(("decode", f"context {c}", f"{d['ms']:.1f} ms/token", f"vs context {plan.contexts[0]}",
                     f"{d['ratio']:.2f}x", ""))
    h = r["hf"]
    rows.append(("vs HF", f"prompt {plan.prompt_len} + {h['new_tokens']}", f"kvlib {h['kvlib_tok_s']:.1f} tok/s",
                 f"HF {h['hf_tok_s']:.1f} tok/s", f"{h['ratio']:.2f}x", _same(h["identical"])))
    rows += fast_rows(r, plan)
    f = r["roofline"]
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


def targets(r: dict, plan: Plan) -> list[dict]:
    """The book's claims, each with its measured value (None if this plan does not measure it)."""
    g, d, f, h = r["generation"], r["decode"], r["roofline"], r["hf"]
    lo, hi = plan.contexts[0], plan.contexts[-1]
    rows = [
        ("cached/naive speedup at 128 new tokens", g["128"]["speedup"] if "128" in g else None, ">=", 5.0, True),
        ("cached/naive speedup at 256 new tokens", g["256"]["speedup"] if "256" in g else None, ">=", 10.0, True),
        (f"decode latency(ctx {hi}) / latency(ctx {lo})", d[str(hi)]["ratio"], "<=", 1.5, True),
        ("kvlib/HF tokens/s, fp32, identical tokens", h["ratio"], ">=", 1.3, h["identical"]),
        (f"decode (ctx {lo}) / {MATVEC_BIG}^2 matvec bandwidth", f[f"decode_ctx{lo}"]["fraction"], ">=", 0.6, True),
    ] + fast_targets(r)
    out = []
    for claim, value, op, threshold, also in rows:
        ok = None if value is None else also and (value >= threshold if op == ">=" else value <= threshold)
        out.append({"claim": f"{claim} {op} {threshold:g}", "measured": value, "pass": ok})
    return out


def header(m: dict) -> str:
    """Two lines on the machine (`machine_info`, plus ``loadavg_end``): versions, threads, load."""
    load = [("n/a" if m.get(k) is None else f"{m[k]:.2f}") for k in ("loadavg_start", "loadavg_end")]
    return (f"kvlib bench | torch {m['torch']} | {m['threads']} threads of {m['cpu_count']} CPUs | "
            f"{m['platform']} | {m['date']}\n"
            f"1-min load average: {load[0]} at start, {load[1]} at end "
            "(well above the thread count means other processes competed: expect noise)")


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
        print(f"  {verdict}  {t['claim']:<56} measured {shown}")


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


def _threads(s: str) -> int:
    """``--threads``: a positive int, or argparse's usage error naming it."""
    try:
        return positive_int("--threads", int(s))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlib.bench", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--threads", type=_threads, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile on the decode step (slow)")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    print(f"torch.set_num_threads({args.threads}); mode {'quick' if args.quick else 'full'}", flush=True)

    r = {"machine": machine_info(torch.get_num_threads())}
    with torch.inference_mode():
        model, tok = load_smollm2()
        ids = prompt_ids(tok, plan.prompt_len)
        print("(a) cached vs naive generation ...", flush=True)
        r["generation"] = bench_generation(model, ids, plan)
        print("(b) decode latency vs context ...", flush=True)
        r["decode"] = bench_decode(model, ids, plan)
        print("(c) kvlib vs Hugging Face generate, fp32 and bf16 ...", flush=True)
        hf = load_hf_smollm2()
        r["hf"] = hf_vs_kvlib(model, hf, ids, plan.hf_tokens)
        r["hf_bf16"] = hf_bf16(hf, ids, plan.hf_tokens)  # converts hf to bf16: after the fp32 run
        del hf
        print("(d) matvec bandwidth and roofline ...", flush=True)
        r["roofline"] = bench_roofline(model, r["decode"], plan)
        print("(e) decode against matvecs over the same matrices ...", flush=True)
        r["same_bytes"] = same_bytes(model, ids, plan.contexts[0], plan.decode_steps)
        print("(f) precision ladder: fp32, bf16, int8, int4 weights ...", flush=True)
        text = torch.tensor([tok.encode(tiny_shakespeare("val"))[: plan.text_tokens]])
        r["precision"] = precision_ladder(ids, text, plan.contexts[0], plan.decode_steps)
        print("(h) split-KV against fused attention ...", flush=True)
        r["split_kv"] = split_vs_sdpa(model, plan.split_context, plan.splits, plan.matvec_repeats)
        if args.compile:
            print("(i) torch.compile on the decode step ...", flush=True)
            r["compile"] = compiled_step(model, ids, plan.contexts[0], plan.decode_steps)
        print(flush=True)
    r["machine"]["loadavg_end"] = load_average()
    r["targets"] = targets(r, plan)
    print_report(r, plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_ready(r), f, indent=1)
        print(f"\nwrote {args.json}")
    bad = [f"cached vs naive at {n} new tokens" for n, g in r["generation"].items() if not g["identical"]]
    bad += [] if r["hf"]["identical"] else [f"kvlib vs HF at {plan.hf_tokens} new tokens"]
    for what in bad:
        print(f"!!! TOKENS DIFFER: {what} !!!", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
