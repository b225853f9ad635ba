"""Section (f): the precision ladder, fewer bytes per weight against what they cost in quality.

Since a decode step is bound by the bytes it reads (`kvlib.bench.roofline`), storing the
weights in fewer bits should speed it up in proportion to the matrices' bytes, if the
kernels that read them keep up: bf16 halves fp32's bytes, int8 quarters them, int4 (in
groups of 32, each with its own scale and minimum) reads an eighth plus those. The int8
and int4 models compute in bf16. Each model's decode step is timed taking turns with the
others.

What the smaller weights lose is measured on text the model did not choose: the
perplexity of Tiny Shakespeare's validation split, and how often the greedy next-token
choice agrees with fp32's (`kvlib.evaluate.agreement`).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .. import timing
from ..evaluate import Score, agreement
from ..model import Transformer
from ..pretrained import load_smollm2
from ..wquant import quantize_weights, stored_bytes


def scored(model: Transformer, ids: torch.Tensor) -> Score:
    """Per-token NLL and greedy choices of ``model`` over ``ids`` ``(1, T)``, in one forward."""
    logits = model(ids).float()  # (1, T, vocab)
    nll = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")  # (T - 1,)
    return Score(nll, logits[0, :-1].argmax(-1))  # choices: (T - 1,)


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
    for _ in range(steps):  # round-robin: drift in machine load hits every precision alike
        for name, step in steppers.items():
            times[name].append(timing.timeit(step, warmup=0, repeats=1)["median"])
    ref = scored(models["fp32"], text)
    out = {}
    for name, m in models.items():
        s = ref if name == "fp32" else scored(m, text)
        ms = 1e3 * statistics.median(times[name])
        out[name] = {"ms": ms, "weight_bytes": stored_bytes(m), "perplexity": s.perplexity,
                     "ppl_ratio": s.perplexity / ref.perplexity, "agreement": agreement(ref, s)}
    for name in out:
        out[name]["speedup"] = out["fp32"]["ms"] / out[name]["ms"]
    return out
