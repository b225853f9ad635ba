"""Section (i): ``torch.compile`` on the decode step, what it saves and what it costs.

Eager PyTorch runs a decode step as hundreds of small operations, each dispatched from
Python; at SmolLM2's size, one token per step, that per-operation overhead is a real
share of the step (section (e) measures the step against its bare matvecs).
``torch.compile`` traces the model into a graph and fuses the small operations into
loops of its own, so part of the overhead goes; the matrix products and attention still
call the same library kernels. The price is a compilation of tens of seconds before the
first step, which is why only ``python -m kvbench --compile`` runs this section.
Inductor keeps what it generated in an on-disk cache, so a second run that compiles the
same step pays less; `compiled_step` measures both, and the overhead before and after
(the step minus its matrices timed alone, `kvbench.roofline.kernel_sweep`), with the
operator calls a profiler counts in each.

Fusing by hand in eager PyTorch does not get there: on this book's build machine, RMSNorm
through ``F.rms_norm`` and RoPE with its signs folded into the sine table gave the same
results to the bit and the same step time (4,935 operator calls either way), because
each is still several kernels, each dispatched on its own.
"""

from __future__ import annotations

import logging
import time

import torch

from torch.profiler import ProfilerActivity, profile

from kvlib import timing
from kvlib.cache import StaticCache
from kvlib.generate import decode_step, prefill
from kvlib.model import Transformer
from .roofline import kernel_sweep


def operator_calls(step) -> int:
    """The operator calls a profiler records in one call of ``step`` (calls inside calls too)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(ev.count for ev in prof.key_averages())


def compiled_step(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(i) ``torch.compile`` on the decode step: compile seconds, eager and compiled ms.

    Also: ``recompile_s``, the same compilation again after ``torch._dynamo.reset()``, with
    inductor's on-disk cache warm, which is what a second run pays; ``kernel_ms``, the
    model's matrices alone, so that ``overhead_eager_ms`` and ``overhead_compiled_ms`` are
    each step minus them; and ``ops_eager``, ``ops_compiled``, each step's operator calls.

    Only the decode step is compiled: the prefill fills the cache eagerly (a chunk of
    tokens has other shapes, and would be a second compilation). The cache is a
    `StaticCache` cropped back to ``context`` after every step, so every timed step decodes
    with exactly ``context`` tokens cached, as the eager one does.
    """
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # graph-break notes: the figures say enough
    eager = timing.decode_stepper(model, ids, context)
    filler = ids.repeat(1, -(-context // ids.shape[1]))[:, :context]  # (1, context): ids repeated to length
    cache = StaticCache.for_model(model.config, 1, context + 1, dtype=model.dtype, device=model.device)
    prefill(model, filler, cache)
    compiled, tok = torch.compile(model, dynamic=True), filler[:, -1]  # tok: (1,)

    def fast() -> None:
        decode_step(compiled, tok, cache)
        cache.crop(context)

    t0 = time.perf_counter()
    fast()  # the first call compiles
    compile_s = time.perf_counter() - t0
    torch._dynamo.reset()  # forget the compiled step; inductor's on-disk cache stays
    compiled = torch.compile(model, dynamic=True)  # fast() looks the name up: it now calls this one
    t0 = time.perf_counter()
    fast()
    recompile_s = time.perf_counter() - t0
    ops = {"eager": operator_calls(eager), "compiled": operator_calls(fast)}
    best = timing.round_robin({"eager": eager, "compiled": fast, "kernels": lambda: kernel_sweep(model, 1)},
                              repeats=repeats)
    ms = {k: 1e3 * v for k, v in best.items()}
    return {"compile_s": compile_s, "recompile_s": recompile_s, "eager_ms": ms["eager"],
            "compiled_ms": ms["compiled"], "speedup": best["eager"] / best["compiled"], "kernel_ms": ms["kernels"],
            "overhead_eager_ms": ms["eager"] - ms["kernels"], "overhead_compiled_ms": ms["compiled"] - ms["kernels"],
            "ops_eager": ops["eager"], "ops_compiled": ops["compiled"]}
