"""The decode-speed sections of ``python -m kvlib.bench`` (chapter 11), measured side by side.

(e) the roofline for the same bytes: a decode step against bare matrix-vector products
over the model's own matrices; (f) the precision ladder: fp32, bf16 and int8/int4
weight-only models, each one's decode step, perplexity and next-token agreement with
fp32; (g) kvlib against Hugging Face ``generate`` in bf16; (h) split-KV (FlashDecoding)
against PyTorch's fused attention over a long cache; (i) optionally, ``torch.compile`` on
the decode step. Every timing here is round-robin: the models or kernels take turns,
so load on a shared machine hits all of them alike. Read the ratios.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import torch.nn.functional as F

from . import timing
from .evaluate import Score, agreement
from .cache import StaticCache
from .generate import decode_step, generate, prefill
from .kernels import split_kv_attention
from .model import Linear, Transformer
from .pretrained import load_smollm2
from .wquant import Int4Linear, Int8Linear, quantize_weights, weight_bytes


def bare_matvecs(model: Transformer, repeats: int = 20) -> float:
    """Seconds for one row vector times every matrix of ``model`` in turn: the bytes a decode
    step must read, read by nothing but matrix-vector products.

    The fastest of ``1 + repeats`` sweeps (``repeats=0``: a single sweep, for a caller that
    times it itself, as `kvlib.timing.round_robin` does). Float matrices only: a quantized
    model's matrices are read by its own kernels, which only its decode step times.
    """
    if not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an int >= 0, got {repeats!r}")
    if any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules()):
        raise TypeError("bare_matvecs times float matrices; this model holds kvlib.wquant layers, "
                        "whose kernels only its decode step times")
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
    rows = {w.shape[0]: torch.full((1, w.shape[0]), 0.01, dtype=w.dtype) for w in weights}
    best = math.inf
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        for w in weights:
            rows[w.shape[0]] @ w
        best = min(best, time.perf_counter() - t0)
    return best


def same_bytes(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(e) A decode step at ``context`` and `bare_matvecs` over the same matrices, taking
    turns, each the fastest of ``repeats``: the share of the step the matvecs would fill."""
    step = timing.decode_stepper(model, ids, context)
    best = timing.round_robin({"decode": step, "matvecs": lambda: bare_matvecs(model, 0)}, repeats=repeats)
    return {"decode_ms": 1e3 * best["decode"], "matvec_ms": 1e3 * best["matvecs"]}


def scored(model: Transformer, ids: torch.Tensor) -> Score:
    """Per-token NLL and greedy choices of ``model`` over ``ids`` ``(1, T)``, in one forward."""
    logits = model(ids).float()  # (1, T, vocab)
    nll = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")  # (T - 1,)
    return Score(nll, logits[0, :-1].argmax(-1))


def precision_ladder(ids: torch.Tensor, text: torch.Tensor, context: int, steps: int, int4: bool = True) -> dict:
    """(f) fp32, bf16, int8 (and int4, groups of 32) weights: decode ms at ``context``, perplexity
    and agreement with fp32. The int8 and int4 models take bf16 activations.

    ``ids`` ``(1, T)`` fills the caches; ``text`` ``(1, N)`` is scored by each model in one
    forward and compared with fp32. Each model is loaded fresh from the same weights.
    """
    bf16 = torch.bfloat16  # the quantized models run bf16 activations: the CPU's int8/int4 kernels are fast for those
    models = {"fp32": load_smollm2()[0], "bf16": load_smollm2(dtype=bf16)[0],
              "int8": quantize_weights(load_smollm2(dtype=bf16)[0], "int8")}
    if int4:
        models["int4"] = quantize_weights(load_smollm2(dtype=bf16)[0], "int4", group_size=32)
    steppers = {name: timing.decode_stepper(m, ids, context) for name, m in models.items()}
    times = {name: [] for name in models}
    for step in steppers.values():
        timing.timeit(step, warmup=2, repeats=1)
    for _ in range(steps):  # round-robin
        for name, step in steppers.items():
            times[name].append(timing.timeit(step, warmup=0, repeats=1)["median"])
    ref = scored(models["fp32"], text)
    out = {}
    for name, m in models.items():
        s = ref if name == "fp32" else scored(m, text)
        ms = 1e3 * statistics.median(times[name])
        out[name] = {"ms": ms, "weight_bytes": weight_bytes(m), "perplexity": s.perplexity,
                     "ppl_ratio": s.perplexity / ref.perplexity, "agreement": agreement(ref, s)}
    for name in out:
        out[name]["speedup"] = out["fp32"]["ms"] / out[name]["ms"]
    return out


def race_hf(model: Transformer, hf, ids: torch.Tensor, n: int, repeats: int = 3) -> tuple[dict, dict]:
    """Greedy generation of ``n`` tokens by HF and by kvlib, runs alternated so noise hits both:
    (median tokens/s of each, the last output of each). The first round is warmup."""
    mask = torch.ones_like(ids)
    runs = {"hf": lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False),
            "kvlib": lambda: generate(model, ids, n)}
    times, outs = {k: [] for k in runs}, {}
    for _ in range(1 + repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            outs[name] = run()
            times[name].append(time.perf_counter() - t0)
    return {k: n / statistics.median(t[1:]) for k, t in times.items()}, outs


def hf_bf16(hf, ids: torch.Tensor, n: int, repeats: int = 3) -> dict:
    """(g) kvlib and HF greedy generation in bf16: tokens/s (runs alternated) and the identical prefix."""
    tps, outs = race_hf(load_smollm2(dtype=torch.bfloat16)[0], hf.to(torch.bfloat16), ids, n, repeats)
    a, b = outs["hf"][0, ids.shape[1]:], outs["kvlib"][0, ids.shape[1]:]
    differ = (a != b).nonzero()
    prefix = int(differ[0, 0]) if len(differ) else n
    return {"new_tokens": n, "hf_tok_s": tps["hf"], "kvlib_tok_s": tps["kvlib"], "ratio": tps["kvlib"] / tps["hf"],
            "identical_prefix": prefix}


def split_vs_sdpa(model: Transformer, context: int, splits: tuple[int, ...], repeats: int) -> dict:
    """(h) One decode step's attention over ``context`` cached tokens, one layer's shapes:
    PyTorch's fused SDPA against `split_kv_attention` at each split count (ms, fastest of
    ``repeats``, round-robin)."""
    c = model.config
    q = torch.full((1, c.n_head, 1, c.head_dim), 0.01)
    k = torch.full((1, c.n_kv_head, context, c.head_dim), 0.01)
    v = torch.full((1, c.n_kv_head, context, c.head_dim), 0.01)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    fns |= {f"split {n}": (lambda n=n: split_kv_attention(q, k, v, n_splits=n)) for n in splits}
    best = timing.round_robin(fns, repeats=repeats)
    return {name: 1e3 * t for name, t in best.items()}


def compiled_step(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(i) ``torch.compile`` on the decode step: compile seconds, eager and compiled ms.

    Only the decode step is compiled: the prefill fills the cache eagerly (a chunk of
    tokens has other shapes, and would be a second compilation).
    """
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # graph-break notes: the figures say enough
    eager = timing.decode_stepper(model, ids, context)
    filler = ids.repeat(1, -(-context // ids.shape[1]))[:, :context]  # (1, context)
    cache = StaticCache.for_model(model.config, 1, context + 1, dtype=model.dtype, device=model.device)
    prefill(model, filler, cache)
    compiled, tok = torch.compile(model, dynamic=True), filler[:, -1]

    def fast() -> None:
        decode_step(compiled, tok, cache)
        cache.crop(context)

    t0 = time.perf_counter()
    fast()  # the first call compiles
    compile_s = time.perf_counter() - t0
    best = timing.round_robin({"eager": eager, "compiled": fast}, repeats=repeats)
    return {"compile_s": compile_s, "eager_ms": 1e3 * best["eager"], "compiled_ms": 1e3 * best["compiled"],
            "speedup": best["eager"] / best["compiled"]}


# -- the report's rows and targets for these sections (kvlib.bench prints them) -------------------
def fast_rows(r: dict, plan) -> list[tuple[str, ...]]:
    """Table rows for sections (e)-(i): section, case, measured, compared, ratio, note."""
    sb, prec, h, sk = r["same_bytes"], r["precision"], r["hf_bf16"], r["split_kv"]
    rows = [("same bytes", f"decode, context {plan.contexts[0]}", f"{sb['decode_ms']:.1f} ms",
             f"matvecs {sb['matvec_ms']:.1f} ms", f"{100 * sb['matvec_ms'] / sb['decode_ms']:.0f}%",
             "x @ W over the model's own matrices vs the step, fastest of each, taking turns")]
    for name, p in prec.items():
        rows.append(("precision", f"{name} weights, context {plan.contexts[0]}", f"{p['ms']:.1f} ms/token",
                     f"fp32 {prec['fp32']['ms']:.1f} ms", f"{p['speedup']:.2f}x",
                     f"{p['weight_bytes'] / 1e6:.0f} MB; ppl {p['perplexity']:.2f} ({100 * (p['ppl_ratio'] - 1):+.1f}%); "
                     f"agreement {p['agreement']:.3f}"))
    rows.append(("vs HF", f"bf16, prompt {plan.prompt_len} + {h['new_tokens']}", f"kvlib {h['kvlib_tok_s']:.1f} tok/s",
                 f"HF {h['hf_tok_s']:.1f} tok/s", f"{h['ratio']:.2f}x",
                 f"first {h['identical_prefix']} of {h['new_tokens']} new tokens identical"))
    for name, ms in sk.items():
        if name != "sdpa":
            rows.append(("split-KV", f"context {plan.split_context}, {name}", f"{ms:.2f} ms",
                         f"sdpa {sk['sdpa']:.2f} ms", f"{sk['sdpa'] / ms:.2f}x", "one layer's decode attention"))
    if "compile" in r:
        c = r["compile"]
        rows.append(("compile", f"decode, context {plan.contexts[0]}", f"compiled {c['compiled_ms']:.1f} ms",
                     f"eager {c['eager_ms']:.1f} ms", f"{c['speedup']:.2f}x", f"compiling took {c['compile_s']:.0f} s"))
    return rows


def fast_targets(r: dict) -> list[tuple]:
    """Chapter 11's targets: (claim, measured, op, threshold, also-required)."""
    sb, p, h = r["same_bytes"], r["precision"], r["hf_bf16"]
    return [
        ("decode / bare matvecs over the same matrices", sb["matvec_ms"] / sb["decode_ms"], ">=", 0.8, True),
        ("bf16 decode speedup over fp32", p["bf16"]["speedup"], ">=", 1.6, True),
        ("bf16 perplexity / fp32 (within 1%)", p["bf16"]["ppl_ratio"], "<=", 1.01, True),
        ("bf16 next-token agreement with fp32", p["bf16"]["agreement"], ">=", 0.97, True),
        ("int8 decode speedup over fp32", p["int8"]["speedup"], ">=", 2.5, True),
        ("int8 perplexity / fp32 (within 2%)", p["int8"]["ppl_ratio"], "<=", 1.02, True),
        ("int8 next-token agreement with fp32", p["int8"]["agreement"], ">=", 0.95, True),
        ("kvlib/HF tokens/s, bf16", h["ratio"], ">=", 1.3, True),
    ]
