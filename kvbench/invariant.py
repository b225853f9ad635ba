"""Section (k): what batch invariance costs (``--invariant``).

`Transformer.set_batch_invariant` trades the fast kernels for a fixed order of every
sum (`kvlib.invariant`): a prefill multiplies its rows one at a time instead of in one
matrix product, and attention adds its keys one by one in Python. This section times a
prefill and a decode step in both modes on two copies of the same weights, taking
turns, and checks on the way that the invariant copy's cached decode gives the same
bits as its own recompute (the default mode's need not).
"""

from __future__ import annotations

import copy

import torch

from kvlib import timing
from kvlib.cache import DynamicCache
from kvlib.model import Transformer
from kvlib.numerics import cached, recomputed


def invariant_cost(model: Transformer, ids: torch.Tensor, context: int, repeats: int) -> dict:
    """(k) Prefill of ``ids`` and a decode step at ``context``: default against batch-invariant (ms)."""
    slow = copy.deepcopy(model)
    slow.set_batch_invariant(True)
    fns = {}
    for name, m in (("default", model), ("invariant", slow)):
        fns[f"{name} prefill"] = lambda m=m: m(ids, DynamicCache(m.config.n_layer), last_only=True)
        fns[f"{name} decode"] = timing.decode_stepper(m, ids, context)
    best = timing.round_robin(fns, repeats=repeats)
    probe = ids[:, :16]
    bits = {name: torch.equal(cached(m, probe, 8), recomputed(m, probe, 8)) for name, m in
            (("default", model), ("invariant", slow))}
    ms = {k: 1e3 * t for k, t in best.items()}
    return {"prompt_len": ids.shape[1], "context": context, "ms": ms, "cached_equals_recomputed": bits,
            "prefill_ratio": ms["invariant prefill"] / ms["default prefill"],
            "decode_ratio": ms["invariant decode"] / ms["default decode"]}
