"""Section (i): ``torch.compile`` on the decode step, what it saves and what it costs.

Eager PyTorch runs a decode step as hundreds of small operations, each dispatched from
Python; at SmolLM2's size, one token per step, that per-operation overhead is a real
share of the step (section (e) measures the step against its bare matvecs).
``torch.compile`` traces the model into a graph and fuses the small operations into
loops of its own, so part of the overhead goes; the matrix products and attention still
call the same library kernels. The price is a compilation of tens of seconds before the
first step, which is why only ``python -m kvlib.bench --compile`` runs this section.
"""

from __future__ import annotations

import logging
import time

import torch

from .. import timing
from ..cache import StaticCache
from ..generate import decode_step, prefill
from ..model import Transformer


def compiled_step(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(i) ``torch.compile`` on the decode step: compile seconds, eager and compiled ms.

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
    best = timing.round_robin({"eager": eager, "compiled": fast}, repeats=repeats)
    return {"compile_s": compile_s, "eager_ms": 1e3 * best["eager"], "compiled_ms": 1e3 * best["compiled"],
            "speedup": best["eager"] / best["compiled"]}
