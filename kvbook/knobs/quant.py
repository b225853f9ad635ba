"""Bits and group size against error and bytes (chapter 8).

``quant_report`` stores a fixed pair of tensors (chapter 8's keys and values of one layer) with
`kvlib.quant.quantize` at every width and group size of one axis, and reads back the relative
error of each and the bytes it stored (`QTensor.nbytes`, which `kvlib.quant.quantized_nbytes`
predicts); a whole model's bytes per token are those bytes per number times the numbers a token
caches, `kvlib.memory.kv_bytes_per_token` at one byte each. ``trade_svg`` draws error against
bytes for every setting, the chosen one ringed; ``explorer()`` wires both to ipywidgets::

    from kvbook.knobs.quant import explorer
    explorer(k, v, model.config, bits=4, group_size=64)   # k, v: (B, H_kv, S, D)

The website's explorer (``data-explorer="quant"``) computes the bytes by the same formula; the
error needs the tensors, so only a notebook shows it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvlib.config import ModelConfig
from kvlib.memory import kv_bytes_per_token
from kvlib.quant import BITS, quantize

from . import BLUE, RED, panel, svg_open, svg_text

if TYPE_CHECKING:
    import ipywidgets

GROUPS = (8, 16, 32, 64)  # numbers per scale: channels of a token's head, or tokens of a channel
AXES = {"per token": -1, "per channel": -2}  # which numbers share a scale (kvlib.quant's dim)


def rel_error(x: torch.Tensor, bits: int, dim: int, group_size: int) -> tuple[float, int]:
    """``x`` quantized and back: its relative error ``|x̂ - x| / |x|`` and the bytes stored."""
    q = quantize(x, bits, dim=dim, group_size=group_size)
    return float((q.dequantize().float() - x.float()).norm() / x.float().norm()), q.nbytes


def quant_report(keys: torch.Tensor, values: torch.Tensor, config: ModelConfig, bits: int = 4,
                 group_size: int = 64, axis: str = "per token") -> dict:
    """Every width and group size of ``axis`` on ``keys`` and ``values`` (``rows``: bits, group,
    bytes per number, error of each), the chosen one (``chosen``), and what it makes of a token
    of ``config``'s cache: ``token_bytes`` against ``fp16_token_bytes``."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {list(AXES)}, got {axis!r}")
    if bits not in BITS or group_size not in GROUPS:
        raise ValueError(f"bits must be one of {BITS} and group_size one of {GROUPS}, got {bits!r}, {group_size!r}")
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a (B, H_kv, S, D) tensor, got {getattr(t, 'shape', type(t).__name__)}")
    rows = []
    for b in BITS:
        for g in GROUPS:
            (ek, nk), (ev, nv) = (rel_error(t, b, AXES[axis], g) for t in (keys, values))
            rows.append({"bits": b, "group": g, "bytes_per_number": (nk + nv) / (keys.numel() + values.numel()),
                         "keys": ek, "values": ev})
    chosen = next(r for r in rows if (r["bits"], r["group"]) == (bits, group_size))
    per_token = kv_bytes_per_token(config, 1)  # numbers a token caches, over every layer
    return {"axis": axis, "bits": bits, "group": group_size, "rows": rows, "chosen": chosen,
            "numbers_per_token": per_token, "token_bytes": chosen["bytes_per_number"] * per_token,
            "fp16_token_bytes": kv_bytes_per_token(config, "fp16"), "model": config.name,
            "shape": tuple(keys.shape)}


def trade_svg(report: dict, width: int = 460) -> str:
    """Relative error (log) against bytes per number for every setting of the axis: keys as
    circles, values as squares, the chosen setting ringed."""
    left, right, top, bottom, height = 56, 12, 10, 40, 230
    rows = report["rows"]
    errs = [r[t] for r in rows for t in ("keys", "values") if r[t] > 0]
    lo, hi = math.floor(math.log10(min(errs))), math.ceil(math.log10(max(errs)))
    hi = max(hi, lo + 1)
    xs = [r["bytes_per_number"] for r in rows]
    x0, x1 = 0.0, max(xs) * 1.08
    X = lambda b: left + (width - left - right) * (b - x0) / (x1 - x0)  # noqa: E731
    Y = lambda e: top + (height - top - bottom) * (hi - math.log10(e)) / (hi - lo)  # noqa: E731
    c = report["chosen"]
    parts = [svg_open(width, height, f"error against bytes per number, {report['axis']}: "
                      f"{c['bits']} bits with a scale per {c['group']} numbers stores "
                      f"{c['bytes_per_number']:.3f} bytes a number")]
    parts.append(f'<path d="M{left} {top} V{height - bottom} H{width - right}" fill="none" stroke="currentColor"/>')
    for e in range(lo, hi + 1):
        parts.append(svg_text(left - 6, Y(10**e) + 4, f"{10.0**e:g}", 'text-anchor="end" font-size="11"'))
    for b in (0.25, 0.5, 1.0):
        if b <= x1:
            parts.append(svg_text(X(b), height - bottom + 15, f"{b:g}", 'text-anchor="middle" font-size="11"'))
    parts.append(svg_text(left + (width - left - right) / 2, height - 6, "bytes per number (fp16: 2)",
                          'text-anchor="middle" font-size="11"'))
    parts.append(svg_text(12, top + 60, "relative error (log)", 'font-size="11" transform="rotate(-90 12 70)"'))
    for r in rows:
        x = X(r["bytes_per_number"])
        parts.append(f'<circle cx="{x:.1f}" cy="{Y(r["keys"]):.1f}" r="4" fill="{BLUE}"/>')
        parts.append(f'<rect x="{x - 3.5:.1f}" y="{Y(r["values"]) - 3.5:.1f}" width="7" height="7" fill="{RED}"/>')
    for t in ("keys", "values"):
        parts.append(f'<circle class="kv-chosen" cx="{X(c["bytes_per_number"]):.1f}" cy="{Y(c[t]):.1f}" r="8" '
                     f'fill="none" stroke="currentColor" stroke-width="1.5"/>')
    parts.append(svg_text(width - right, top + 12, "● keys   ■ values   ○ chosen", 'text-anchor="end" font-size="11"'))
    return "".join(parts) + "</svg>"


def quant_text(report: dict) -> str:
    """The view as text: one line per setting, the chosen one marked, then the token's bytes."""
    r = report
    lines = [f"{r['axis']}, tensors {r['shape']}: bits, numbers per scale, bytes per number, error of keys, values"]
    for row in r["rows"]:
        mark = "→" if row is r["chosen"] else " "
        lines.append(f"{mark} {row['bits']} bits, {row['group']:>2}: {row['bytes_per_number']:.4f} B, "
                     f"{row['keys']:.4f}, {row['values']:.4f}")
    lines.append(f"{r['model']}: {r['token_bytes']:,.0f} bytes per token, fp16 {r['fp16_token_bytes']:,}")
    return "\n".join(lines)


def quant_html(report: dict) -> str:
    r, c = report, report["chosen"]
    share = r["token_bytes"] / r["fp16_token_bytes"]
    return (f'<div class="kv-report"><p>{c["bits"]} bits, a scale and minimum per {c["group"]} numbers '
            f'({r["axis"]}): <b>{c["bytes_per_number"]:.4f}</b> bytes a number, relative error '
            f'<b>{c["keys"]:.4f}</b> on the keys and <b>{c["values"]:.4f}</b> on the values. '
            f'A token of {r["model"]}\'s cache: {r["token_bytes"]:,.0f} bytes, {share:.1%} of fp16\'s '
            f'{r["fp16_token_bytes"]:,}.</p>{trade_svg(r)}</div>')


def explorer(keys: torch.Tensor, values: torch.Tensor, config: ModelConfig, bits: int = 4,
             group_size: int = 64, axis: str = "per token") -> ipywidgets.VBox:
    """An ipywidgets panel: bits, numbers per scale and the axis they share it along in; the error
    on ``keys`` and ``values``, and the bytes per number and per token of ``config``, out."""
    import ipywidgets as w

    quant_report(keys, values, config, bits, group_size, axis)  # a bad setting fails here, saying which
    style = {"description_width": "130px"}
    controls = {
        "bits": w.ToggleButtons(options=list(BITS), value=bits, description="bits", style=style),
        "group": w.SelectionSlider(options=list(GROUPS), value=group_size, description="numbers per scale",
                                   style=style),
        "axis": w.Dropdown(options=list(AXES), value=axis, description="scale shared", style=style),
    }
    c = controls
    return panel(controls, lambda v: quant_report(keys, values, config, v["bits"], v["group"], v["axis"]),
                 quant_html, quant_text, layout=[[c["bits"]], [c["group"], c["axis"]]])
