"""Section (f): the precision ladder, fewer bytes per weight against what they cost in quality.

Since a decode step is bound by the bytes it reads (`kvbench.roofline`), storing the
weights in fewer bits should speed it up in proportion to the matrices' bytes, if the
kernels that read them keep up: bf16 halves fp32's bytes, int8 quarters them, int4 (in
groups of 32, each with its own scale and minimum) reads an eighth plus those. Five
models: fp32; bf16 in the plain layout (``prepack=False``); bf16 with its matrices
prepacked into oneDNN's layout (`kvlib.prepack`), where this CPU's oneDNN has a bf16 path;
int8 and int4, which compute in bf16. Which bf16 ``load_smollm2(dtype=torch.bfloat16)``
gives by default, packed or plain, is that very load, and the record names it
(``bf16_default`` in fp32's row). Each model's decode step is
timed taking turns with the others, at batch 1 and at batch ``BATCH``, the fastest of its
turns kept.

*Judge a kernel, not a step.* A step's time is its matrices' time plus an overhead that
does not depend on their bytes (attention, norms, the dispatcher). So each model's
matrices are also timed alone, one row through every layer's own kernel
(`kvbench.roofline.kernel_sweep`): that is the floor its kernels set, and the step
minus it is the overhead measured in place.

What the smaller weights lose is measured on text the model did not choose: the
perplexity of Tiny Shakespeare's validation split, and how often the greedy next-token
choice agrees (`kvlib.evaluate.agreement`). The quantized models are compared with
**bf16**, the precision of their activations, as well as with fp32: against fp32 alone
a ladder mixes what the weights lose with what bf16 activations lose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlib import timing
from kvlib.evaluate import Score, agreement
from kvlib.model import Transformer
import warnings

from kvlib.prepack import available as prepack_available
from kvlib.prepack import is_packed
from kvlib.pretrained import load_smollm2
from kvlib.wquant import quantize_weights, stored_bytes
from .roofline import kernel_sweep

#: The second batch size every model's step is timed at.
BATCH = 8  # the second batch size every model's step is timed at


def scored(model: Transformer, ids: torch.Tensor) -> Score:
    """Per-token NLL and greedy choices of ``model`` over ``ids`` ``(1, T)``, in one forward."""
    logits = model(ids).float()  # (1, T, vocab)
    nll = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")  # (T - 1,)
    return Score(nll, logits[0, :-1].argmax(-1))  # choices: (T - 1,)


def default_bf16_name(model: Transformer) -> str:
    """The ladder's name for a bf16 model: ``"bf16 packed"`` or ``"bf16"`` (the plain layout)."""
    return "bf16 packed" if is_packed(model) else "bf16"


def ladder_models(int4: bool = True) -> tuple[dict[str, Transformer], str]:
    """fp32, bf16 (plain), bf16 packed (where oneDNN has a bf16 path), int8 and int4 (groups
    of 32) SmolLM2s; and the name of the one ``load_smollm2(dtype=torch.bfloat16)`` gave."""
    bf16 = torch.bfloat16  # the quantized models run bf16 activations: the CPU's int8/int4 kernels are fast for those
    with warnings.catch_warnings():  # on a CPU without a bf16 path, the load says fp32 is faster: the ladder shows it
        warnings.simplefilter("ignore")
        default = load_smollm2(dtype=bf16)[0]  # what a reader who asks for bf16 gets
    name = default_bf16_name(default)
    models = {"fp32": load_smollm2()[0], name: default}
    if name == "bf16 packed":
        models["bf16"] = load_smollm2(dtype=bf16, prepack=False)[0]
    elif prepack_available():  # KVLIB_PREPACK=0 turned the default off: measure the packed one all the same
        models["bf16 packed"] = load_smollm2(dtype=bf16, prepack=True)[0]
    models = {n: models[n] for n in ("fp32", "bf16", "bf16 packed") if n in models}  # the ladder's order
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models["int8"] = quantize_weights(load_smollm2(dtype=bf16, prepack=False)[0], "int8")
        if int4:
            models["int4"] = quantize_weights(load_smollm2(dtype=bf16, prepack=False)[0], "int4", group_size=32)
    return models, name


def precision_ladder(ids: torch.Tensor, text: torch.Tensor, context: int, steps: int, int4: bool = True) -> dict:
    """(f) Each model of `ladder_models`: decode ms at ``context`` (batch 1 and `BATCH`), its
    matrices' own time (``kernel_ms``), perplexity, and agreement with fp32 and with bf16.

    ``ids`` ``(1, T)`` fills the batch-1 caches; ``text`` ``(1, N)`` is scored by each model
    in one forward. Each model is loaded fresh from the same weights. Speed-ups are over
    fp32 (``speedup``, ``speedup_b8``; the matrices alone: ``kernel_speedup``, ``kernel_speedup_b8``)
    and over the faster of the two bf16 models at that batch (``vs_bf16``, ``vs_bf16_b8``; fp32's
    ``best_bf16`` names the faster at batch 1, the one ``kernel_vs_bf16`` compares with; its
    ``bf16_default`` the one ``load_smollm2(dtype=torch.bfloat16)`` gives here).
    """
    models, default = ladder_models(int4)
    steppers = {name: timing.decode_stepper(m, ids, context) for name, m in models.items()}
    steppers |= {f"{name} b{BATCH}": timing.filled_decode_stepper(m, BATCH, context) for name, m in models.items()}
    steppers |= {f"{name} kernels": (lambda m=m: kernel_sweep(m, 1)) for name, m in models.items()}
    steppers |= {f"{name} kernels b{BATCH}": (lambda m=m: kernel_sweep(m, BATCH)) for name, m in models.items()}
    times = {name: [] for name in steppers}
    for step in steppers.values():
        timing.timeit(step, warmup=2, repeats=1)
    for _ in range(steps):  # round-robin: drift in machine load hits every precision alike
        for name, step in steppers.items():
            times[name].append(timing.timeit(step, warmup=0, repeats=1)["median"])
    ref = scored(models["fp32"], text)
    ref16 = scored(models["bf16"], text)
    out = {}
    for name, m in models.items():
        s = ref if name == "fp32" else ref16 if name == "bf16" else scored(m, text)
        # every figure the fastest of its turns: noise only ever adds time, and the overhead
        # (step minus kernels) is then one measurement less another of the same kind
        ms = 1e3 * min(times[name])
        kernel_ms = 1e3 * min(times[f"{name} kernels"])
        out[name] = {"ms": ms, "ms_b8": 1e3 * min(times[f"{name} b{BATCH}"]),
                     "kernel_ms": kernel_ms, "overhead_ms": ms - kernel_ms,
                     "kernel_ms_b8": 1e3 * min(times[f"{name} kernels b{BATCH}"]),
                     "weight_bytes": stored_bytes(m), "perplexity": s.perplexity,
                     "ppl_ratio": s.perplexity / ref.perplexity, "agreement": agreement(ref, s),
                     "ppl_ratio_bf16": s.perplexity / ref16.perplexity, "agreement_bf16": agreement(ref16, s)}
    best16 = min((n for n in ("bf16", "bf16 packed") if n in out), key=lambda n: out[n]["ms"])
    for name, o in out.items():
        o["speedup"] = out["fp32"]["ms"] / o["ms"]
        o["speedup_b8"] = out["fp32"]["ms_b8"] / o["ms_b8"]
        o["kernel_speedup"] = out["fp32"]["kernel_ms"] / o["kernel_ms"]
        o["kernel_speedup_b8"] = out["fp32"]["kernel_ms_b8"] / o["kernel_ms_b8"]
        o["vs_bf16"] = out[best16]["ms"] / o["ms"]
        o["vs_bf16_b8"] = min(out[n]["ms_b8"] for n in ("bf16", "bf16 packed") if n in out) / o["ms_b8"]
        o["kernel_vs_bf16"] = out[best16]["kernel_ms"] / o["kernel_ms"]
    out["fp32"]["best_bf16"] = best16  # which bf16 the vs_bf16 ratios are over
    out["fp32"]["bf16_default"] = default  # which bf16 load_smollm2(dtype=torch.bfloat16) gave
    return out
