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

Chunked prefill in the engine (`pauses_while_prefilling`, `bench_chunked_prefill`): while
a long prompt goes in chunk by chunk, how long do the running sequences wait between two
tokens? Each step is one forward of their decode tokens and one chunk, so the longest
pause should be a step of ``token_budget`` tokens, a few plain decode steps, not the
whole prompt's prefill.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlib import cost, timing
from kvlib.engine import Engine
from kvlib.generate import generate, generate_naive
from kvlib.model import Transformer
from kvlib.paged import PagedCache
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


def pauses_while_prefilling(engine, prompts: list[list[int]], long_prompt: list[int], new_tokens: int,
                            warm_steps: int = 3) -> dict:
    """Run ``prompts`` until every one decodes (then ``warm_steps`` more), add ``long_prompt``,
    and step until it emits its first token.

    ``engine`` is a `kvlib.Engine` (or anything with its ``add``, ``step`` and ``requests``).
    Returns, in ms, the longest and the median pause between two tokens of a running sequence
    during that prefill, the median pause before it (a plain decode step) and their ratio; the
    steps the long prompt took, the model forwards they ran (counted by a forward pre-hook), and
    every request's tokens (run to the end).
    """
    rids = [engine.add(p, new_tokens) for p in prompts]
    seqs = [engine.requests[r].seqs[0] for r in rids]
    while not all(s.output for s in seqs):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    forwards = []
    hook = engine.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        rid, arrived = engine.add(long_prompt, 4), time.perf_counter()
        steps = 0
        while not engine.requests[rid].seqs[0].output:
            engine.step()
            steps += 1
    finally:
        hook.remove()
    first = engine.requests[rid].seqs[0].times[0]
    during = [b - a for s in seqs for a, b in zip(s.times, s.times[1:]) if arrived < b <= first]
    before = [b - a for s in seqs for a, b in zip(s.times, s.times[1:]) if b < arrived]
    out = engine.run()
    decode_ms = 1e3 * statistics.median(before)
    return {"max_pause_ms": 1e3 * max(during), "median_pause_ms": 1e3 * statistics.median(during),
            "decode_step_ms": decode_ms, "pause_ratio": 1e3 * max(during) / decode_ms, "prefill_steps": steps,
            "forwards_per_step": len(forwards) / steps, "tokens": [out[r][0] for r in rids + [rid]]}


def bench_chunked_prefill(model: Transformer, text_ids: list[int], *, running: int = 8, prompt_len: int = 24,
                          long_len: int = 1000, token_budget: int = 256, block_size: int = 32,
                          new_tokens: int = 48, varlen: bool = True) -> dict:
    """`pauses_while_prefilling` for ``running`` sequences (prompts of ``prompt_len`` tokens cut from
    ``text_ids``) while a ``long_len``-token prompt arrives, under ``token_budget`` tokens a step;
    ``varlen=False``: the Engine's packed row under a block-diagonal mask (`kvlib.Engine`)."""
    need = running * prompt_len + long_len
    if len(text_ids) < need:
        raise ValueError(f"text_ids holds {len(text_ids)} tokens; {running} prompts of {prompt_len} and one of "
                         f"{long_len} need {need}")
    prompts = [text_ids[i * prompt_len : (i + 1) * prompt_len] for i in range(running)]
    long_prompt = text_ids[running * prompt_len : need]
    blocks = running * -(-(prompt_len + new_tokens) // block_size) + -(-(long_len + 4) // block_size) + 4
    cache = PagedCache.for_model(model.config, num_blocks=blocks, block_size=block_size, dtype=model.dtype,
                                 device=model.device)
    engine = Engine(model, cache, token_budget=token_budget, varlen=varlen)
    return pauses_while_prefilling(engine, prompts, long_prompt, new_tokens)
