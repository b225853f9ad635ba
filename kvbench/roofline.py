"""Sections (d) and (e): the roofline, how close a decode step gets to memory bandwidth.

A decode step for one sequence is a chain of one-row matrix products: every weight is
read once and used for a single multiply-add, so the step can go no faster than memory
delivers bytes. Its ceiling is measured, not taken from a datasheet:

(d) `kvlib.timing.matvec_bandwidth` times a vector times an fp32 matrix in both storage
layouts, once for one matrix larger than most CPUs' caches (``MATVEC_BIG`` squared) and once
for ``MATVEC_COUNT`` distinct SmolLM2-sized ones. Dividing the bytes a step must read
(`kvlib.cost.decode_bytes_per_token`) by the step's time from (b) gives the bandwidth the
step achieved, and its fraction of each ceiling.

(e) The same comparison with nothing else changed: `bare_matvecs` runs one row times
every matrix of the model itself, the exact bytes the step reads, taking turns with the
step. What the matvecs do not fill is the step's overhead (attention, norms, Python).
"""

from __future__ import annotations

import math
import time

import torch

from kvlib import cost, timing
from kvlib.model import Linear, Transformer
from kvlib.prepack import PackedLinear
from kvlib.validate import int_at_least, positive_int
from kvlib.wquant import Int4Linear, Int8Linear
from .plan import Plan

MATRIX_LAYERS = (Linear, PackedLinear, Int8Linear, Int4Linear)  # what kernel_sweep times

#: The side of the large square matrix the bandwidth probe multiplies.
MATVEC_BIG = 8192  # a square fp32 matrix of 256 MiB: larger than most CPUs' last-level cache (not all)
#: A SmolLM2-sized ``(in, out)`` matrix...
MATVEC_SMALL = (576, 1728)  # a SmolLM2-sized (in, out) matrix...
#: ...in this many distinct copies, so that they do not sit in cache.
MATVEC_COUNT = 60  # ...times 60 distinct copies, so that they do not sit in cache


def bench_roofline(model: Transformer, decode: dict, plan: Plan) -> dict:
    """(d) Matvec bandwidth in both layouts, and the bandwidth (b)'s decode steps achieved.

    ``decode`` is `kvbench.bench_decode`'s result; the first and last of ``plan.contexts``
    are read from it.
    """
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


def bare_matvecs(model: Transformer, repeats: int = 20) -> float:
    """Seconds for one row vector times every matrix of ``model`` in turn: the bytes a decode
    step must read, read by nothing but matrix-vector products.

    The fastest of ``1 + repeats`` sweeps (``repeats=0``: a single sweep, for a caller that
    times it itself, as `kvlib.timing.round_robin` does). Float matrices only: a quantized
    model's matrices are read by its own kernels, which only its decode step times.
    """
    int_at_least("repeats", repeats, 0)
    if any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules()):
        raise TypeError("bare_matvecs times float matrices; this model holds kvlib.wquant layers, "
                        "whose kernels only its decode step times")
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)]  # each (in, out): x @ W
    rows = {w.shape[0]: torch.full((1, w.shape[0]), 0.01, dtype=w.dtype) for w in weights}  # (1, in) per width
    best = math.inf
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        for w in weights:
            rows[w.shape[0]] @ w  # (1, in) @ (in, out) -> (1, out)
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_sweep(model: Transformer, rows: int = 1) -> float:
    """Seconds for ``rows`` rows through every matrix layer of ``model`` in turn, each by its
    own kernel: ``x @ W`` for a float `Linear`, the packed, int8 or int4 kernel for the
    others. One sweep, for a caller that times it (`kvlib.timing.round_robin`).

    `bare_matvecs` for any precision: the floor that the model's matrix kernels set on a
    decode step; the step's time minus this is the overhead above it.
    """
    positive_int("rows", rows)
    layers = [m for m in model.modules() if isinstance(m, MATRIX_LAYERS)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no kvlib matrix layers to time")
    width = lambda m: m.weight.shape[0] if isinstance(m, Linear) else m.in_features  # noqa: E731
    xs = {k: torch.full((rows, k), 0.01, dtype=model.dtype) for k in {width(m) for m in layers}}  # (rows, in)
    t0 = time.perf_counter()
    for m in layers:
        m(xs[width(m)])  # (rows, in) -> (rows, out)
    return time.perf_counter() - t0


def same_bytes(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(e) A decode step at ``context`` and `bare_matvecs` over the same matrices, taking
    turns, each the fastest of ``repeats``: the share of the step the matvecs would fill."""
    step = timing.decode_stepper(model, ids, context)
    best = timing.round_robin({"decode": step, "matvecs": lambda: bare_matvecs(model, 0)}, repeats=repeats)
    return {"decode_ms": 1e3 * best["decode"], "matvec_ms": 1e3 * best["matvecs"]}


def thread_scaling(model: Transformer, ids: torch.Tensor, context: int, counts: tuple[int, ...],
                   repeats: int) -> dict:
    """Decode ms at ``context`` and `kernel_sweep` ms at each thread count in ``counts``,
    the fastest of ``repeats`` taking turns (``torch.set_num_threads`` changes between turns).

    One thread cannot keep enough loads in flight to saturate the memory; more threads
    stream faster until the memory (or the kernel's task count) is the limit.
    """
    step = timing.decode_stepper(model, ids, context)
    fns = {}
    for n in counts:
        positive_int("thread count", n)
        fns[f"decode {n}"] = lambda n=n: _with_threads(n, step)
        fns[f"kernels {n}"] = lambda n=n: _with_threads(n, lambda: kernel_sweep(model, 1))
    best = timing.round_robin(fns, repeats=repeats)
    return {str(n): {"decode_ms": 1e3 * best[f"decode {n}"], "kernel_ms": 1e3 * best[f"kernels {n}"]}
            for n in counts}


def _with_threads(n: int, fn) -> None:
    with timing.threads(n):
        fn()
