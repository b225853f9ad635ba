"""Sections (a) and (b): what the KV cache buys, measured on SmolLM2.

(a) Cached against naive greedy generation. The naive loop re-runs the whole sequence
for every new token, so its FLOPs grow with the square of the length, while the cached
loop does one token's work per step. Both must produce the same tokens. The speedup is
far smaller than the FLOP ratio (`kvlib.cost`), and the row says why: the naive loop is
compute-bound (big matrix-matrix products run at many GFLOP/s) while the cached one is
bandwidth-bound (a one-row product reads every weight for a single multiply-add).

(b) The cost of one decode step as the cache grows. At SmolLM2's size a step reads
about 540 MB of fp32 weights whatever the context, and a thousand cached tokens add
under 50 MB of keys and values (`kvlib.cost.decode_bytes_per_token`), so the step should
slow down only a little: its ratio to the shortest context stays near 1.
"""

from __future__ import annotations

import statistics

import torch

from .. import cost, timing
from ..generate import generate, generate_naive
from ..model import Transformer
from .plan import Plan


def bench_generation(model: Transformer, ids: torch.Tensor, plan: Plan) -> dict:
    """(a) Cached vs naive greedy generation after ``ids`` ``(1, T)``, for each ``plan.new_tokens``.

    Per length: median seconds of each, the speedup, whether the tokens are identical, the
    FLOP ratio `kvlib.cost` predicts, and the GFLOP/s each loop achieved.
    """
    generate(model, ids, 4)  # warm up the allocator and kernels once for the whole section
    generate_naive(model, ids, 2)
    out = {}
    for n in plan.new_tokens:
        a, tc = timing.time_generation(model, ids, n, repeats=plan.cached_repeats)  # a: (1, T + n)
        b, tn = timing.time_generation(model, ids, n, naive=True, repeats=plan.naive_repeats)  # b: (1, T + n)
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
