"""Batch and context against a decode step's time on the roofline (chapter 5).

``step_report`` is `kvlib.hardware.step_time` for one decode step on a spec-sheet GPU, with
the bytes it reads (`kvlib.cost.step_bytes`) and whether the weights and every sequence's
cache fit (`kvlib.memory`); ``roofline_svg`` puts the step on that GPU's roofline;
``explorer()`` wires both to ipywidgets::

    from kvbook.knobs.step import explorer
    explorer(model="llama-3-8b", hardware="h100", dtype="bf16", batch=1, context=4096)

The website's explorer (``data-explorer="step"``, js/explorers.js) computes the same numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvlib import cost, memory
from kvlib.config import PRESETS
from kvlib.hardware import HARDWARE, step_time

from ..explorer import CONTEXTS, MODELS
from . import BLUE, RED, panel, sig3, svg_open, svg_text

if TYPE_CHECKING:
    import ipywidgets

STEP_MODELS = [m for m in MODELS if PRESETS[m].family == "llama"]  # weights counted: a step can be timed
BATCHES = [2**i for i in range(9)]  # 1 ... 256 sequences
DTYPES = ["fp32", "fp16", "bf16", "fp8"]  # those a hardware's spec sheet lists (kvbook.web.STEP_DTYPES)


def step_report(model: str = "llama-3-8b", hardware: str = "h100", dtype: str = "bf16", batch: int = 1,
                context: int = 4096) -> dict:
    """One decode step: ``seconds`` (`step_time`'s total), ``tokens_per_s``, ``kv_share`` of the
    bytes read, ``intensity`` and ``ridge`` (FLOPs per byte), ``memory_bound``, and ``fits``
    (weights plus ``batch`` caches of ``context`` tokens, at ``dtype``, within the GPU's memory)."""
    if model not in STEP_MODELS:
        raise ValueError(f"model must be one of {STEP_MODELS}, got {model!r}")
    if hardware not in HARDWARE:
        raise ValueError(f"hardware must be one of {list(HARDWARE)}, got {hardware!r}")
    hw, config = HARDWARE[hardware], PRESETS[model]
    if dtype not in hw.peak_flops:
        raise ValueError(f"{hw.name}'s spec sheet lists no {dtype} peak; choose from {list(hw.peak_flops)}")
    t = step_time(config, hw, batch, context, dtype=dtype)
    weights = cost.step_bytes(config, batch, context, dtype=dtype)["weights"]
    need = memory.weight_bytes(config, dtype) + memory.kv_cache_bytes(config, context, batch, dtype)
    return {"model": config.name, "hardware": hw.name, "dtype": dtype, "batch": batch, "context": context,
            "seconds": t.total, "tokens_per_s": batch / t.total, "kv_share": (t.bytes - weights) / t.bytes,
            "intensity": t.intensity, "ridge": t.ridge, "memory_bound": t.memory_bound,
            "peak": hw.peak(dtype), "bandwidth": hw.mem_bandwidth, "need_bytes": need, "fits": need <= hw.memory,
            "gpu_bytes": hw.memory, "past_limit": context > config.max_seq_len}


def roofline_svg(r: dict, width: int = 440) -> str:
    """The roofline, log-log (attainable FLOP/s = min(peak, intensity x bandwidth)), the ridge
    dashed and the step as a dot on the roof."""
    left, right, top, bottom, height = 52, 10, 10, 40, 210
    x_lo, x_hi = -1, 4  # 0.1 ... 10,000 FLOPs per byte
    y_hi = math.ceil(math.log10(r["peak"] / 1e12) + 0.2)
    y_lo = y_hi - 5
    X = lambda i: left + (width - left - right) * (math.log10(i) - x_lo) / (x_hi - x_lo)  # noqa: E731
    Y = lambda f: top + (height - top - bottom) * (y_hi - math.log10(f / 1e12)) / (y_hi - y_lo)  # noqa: E731
    roof = lambda i: min(r["peak"], i * r["bandwidth"])  # noqa: E731
    parts = [svg_open(width, height, f"roofline of {r['hardware']} in {r['dtype']}: the step at "
                      f"{r['intensity']:.3g} FLOPs per byte, the ridge at {r['ridge']:.3g}")]
    parts.append(f'<path d="M{left} {top} V{height - bottom} H{width - right}" fill="none" stroke="currentColor"/>')
    for e in range(x_lo, x_hi + 1):
        parts.append(svg_text(X(10**e), height - bottom + 15, f"{10.0**e:,g}", 'text-anchor="middle" font-size="11"'))
    for e in range(y_lo, y_hi + 1):
        parts.append(svg_text(left - 6, Y(10**e * 1e12) + 4, f"{10.0**e:,g}", 'text-anchor="end" font-size="11"'))
    pts = " ".join(f"{X(10**(x_lo + j / 20)):.1f},{Y(roof(10**(x_lo + j / 20))):.1f}"
                   for j in range(20 * (x_hi - x_lo) + 1))
    parts.append(f'<polyline points="{pts}" fill="none" stroke="{BLUE}" stroke-width="2.5"/>')
    parts.append(f'<line x1="{X(r["ridge"]):.1f}" x2="{X(r["ridge"]):.1f}" y1="{Y(r["peak"]):.1f}" '
                 f'y2="{height - bottom}" stroke="currentColor" stroke-dasharray="4 3"/>')
    i = min(max(r["intensity"], 10**x_lo), 10**x_hi)
    parts.append(f'<circle cx="{X(i):.1f}" cy="{Y(roof(i)):.1f}" r="5.5" fill="{RED}"/>')
    parts.append(svg_text(left + (width - left - right) / 2, height - 6, "FLOPs per byte (log scale)",
                          'text-anchor="middle" font-size="11"'))
    parts.append(svg_text(12, top + 110, "TFLOP/s (log)", 'font-size="11" transform="rotate(-90 12 120)"'))
    return "".join(parts) + "</svg>"


def step_text(r: dict) -> str:
    """The view as text: the step's time and rate, where it sits on the roofline, and the memory."""
    return "\n".join([
        f"{r['model']} on {r['hardware']}, {r['dtype']}, batch {r['batch']:,}, context {r['context']:,}",
        f"step: {sig3(1e3 * r['seconds'])} ms, {r['tokens_per_s']:,.0f} tokens/s, KV cache {r['kv_share']:.1%} of bytes",
        f"intensity: {sig3(r['intensity'])} FLOPs/byte, ridge {sig3(r['ridge'])}: "
        f"{'memory' if r['memory_bound'] else 'compute'}-bound",
        f"memory: {r['need_bytes'] / 1e9:,.1f} GB needed, {r['gpu_bytes'] / 1e9:,.1f} GB on the GPU"
        f"{'' if r['fits'] else ' (does not fit)'}"])


def step_html(r: dict) -> str:
    lines = step_text(r).splitlines()
    warn = "" if r["fits"] else "<p><b>The weights and caches do not fit this GPU: the time is on paper only.</b></p>"
    if r["past_limit"]:
        warn += f"<p><i>{r['context']:,} tokens is past {r['model']}'s context limit.</i></p>"
    return (f'<div class="kv-report">{warn}' + "".join(f"<p>{line}</p>" for line in lines[1:])
            + roofline_svg(r) + "</div>")


def explorer(model: str = "llama-3-8b", hardware: str = "h100", dtype: str = "bf16", batch: int = 1,
             context: int = 4096) -> ipywidgets.VBox:
    """An ipywidgets panel: GPU, model, dtype, batch and context in; the step on the roofline out.
    The dtype control lists only what the chosen GPU's spec sheet gives a peak for."""
    import ipywidgets as w

    step_report(model, hardware, dtype, batch, context)  # a bad setting fails here, saying which
    if batch not in BATCHES or context not in CONTEXTS:
        raise ValueError(f"batch must be one of {BATCHES} and context one of {CONTEXTS}, got {batch!r}, {context!r}")
    style = {"description_width": "130px"}
    listed = lambda h: [d for d in DTYPES if d in HARDWARE[h].peak_flops]  # noqa: E731
    controls = {
        "hardware": w.Dropdown(options=[(h.name, k) for k, h in HARDWARE.items()], value=hardware,
                               description="hardware", style=style),
        "model": w.Dropdown(options=[(PRESETS[m].name, m) for m in STEP_MODELS], value=model,
                            description="model", style=style),
        "dtype": w.Dropdown(options=listed(hardware), value=dtype, description="dtype", style=style),
        "batch": w.SelectionSlider(options=BATCHES, value=batch, description="batch (sequences)", style=style),
        "context": w.SelectionSlider(options=CONTEXTS, value=context, description="context (tokens)", style=style),
    }
    c = controls

    def refill(name: str) -> None:  # a new GPU: its dtypes, keeping the reader's where it has it
        if name == "hardware":
            want, options = c["dtype"].value, listed(c["hardware"].value)
            c["dtype"].options = options  # may reset the value: that refresh sees a listed dtype
            c["dtype"].value = want if want in options else "fp16" if "fp16" in options else options[0]

    return panel(controls, lambda v: step_report(v["model"], v["hardware"], v["dtype"], v["batch"], v["context"]),
                 step_html, step_text, layout=[[c["hardware"], c["model"], c["dtype"]], [c["batch"], c["context"]]],
                 on_change=refill)
