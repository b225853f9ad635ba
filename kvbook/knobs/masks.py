"""What a layer may see, and what its cache keeps: the mask of a full, window (with sinks) or
chunked layer, and the tokens it holds after a text of ``n`` tokens (chapters 7.2 and 10).

``mask_report`` computes both with kvlib: the grid is `kvlib.layers.visible`, the count
`kvlib.layers.tokens_held`, and the kept positions are what a `kvlib.hybrid.HybridCache` of
that one layer holds after the text (its ``kept_positions``), so the picture shows the cache's
own bookkeeping, not a redrawing of it. ``grid_svg`` draws the grid with the kept tokens in a
row under it; ``explorer()`` wires both to ipywidgets::

    from kvbook.knobs.masks import explorer
    explorer(kind="window", window=4, sinks=2, n=12)

The website's explorer (``data-explorer="masks"``, js/explorers.js) draws the same grid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlib import layers as L
from kvlib.hybrid import HybridCache
from kvlib.validate import int_in_range

from . import BLUE, GREY, RED, numbers, panel, report_html, svg_open, svg_text

if TYPE_CHECKING:
    import ipywidgets

KINDS = ("full", "window", "chunked")  # sinks are a window's setting
MAX_N = 32  # the longest text the grid draws (a cell per query and key)


def layer_kind(kind: str, window: int = 4, sinks: int = 0, chunk: int = 4) -> L.LayerKind:
    """The `kvlib.layers.LayerKind` a setting names: ``full()``, ``window(window, sinks)`` or
    ``chunked(chunk)``; the settings a kind does not use are ignored."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "window":
        return L.window(window, sinks)
    return L.chunked(chunk) if kind == "chunked" else L.full()


def kept_positions(layer: L.LayerKind, n: int) -> list[int]:
    """The positions a `HybridCache` of one ``layer`` holds after ``n`` tokens, in order."""
    cache = HybridCache([layer])
    x = torch.zeros(1, 1, n, 2)  # (B, H, S, D): only the positions matter
    cache.update(x, x, 0)
    return sorted(cache.kept_positions(0).tolist())


def mask_report(kind: str = "window", n: int = 12, window: int = 4, sinks: int = 0, chunk: int = 4) -> dict:
    """One layer over a text of ``n`` tokens: ``grid`` (``n`` rows of ``n`` bools, query by key:
    `kvlib.layers.visible`), ``seen`` (keys each query sees), ``tokens_held``
    (`kvlib.layers.tokens_held`) and ``kept`` (the positions its cache holds, `kept_positions`)."""
    int_in_range("n", n, 1, MAX_N)
    layer = layer_kind(kind, window, sinks, chunk)
    pos = torch.arange(n)
    grid = L.visible(layer, pos, pos)  # (n, n) bool: query by key
    return {"kind": str(layer), "n": n, "grid": grid.tolist(), "seen": grid.sum(-1).tolist(),
            "tokens_held": L.tokens_held(layer, n), "kept": kept_positions(layer, n)}


def grid_svg(report: dict, width: int = 420) -> str:
    """The grid, a square per query and key (blue: may attend), and under it the text's tokens,
    the kept ones in red. Text in ``currentColor``, for a dark notebook as a light one."""
    n, left, top = report["n"], 44, 18
    cell = max(4.0, min(20.0, (width - left - 8) / n))
    size = cell * n
    height = top + size + 12 + cell + 24
    kept = set(report["kept"])
    parts = [svg_open(left + size + 8, height, f"{report['kind']}: which keys each of {n} queries sees; "
                      f"the cache keeps {numbers(report['kept'])}")]
    parts.append(svg_text(left + size / 2, 12, "key →", 'text-anchor="middle"'))
    parts.append(svg_text(left - 6, top + 10, "query", 'text-anchor="end"'))
    for q, row in enumerate(report["grid"]):
        for k, seen in enumerate(row):
            parts.append(f'<rect class="{"kv-seen" if seen else "kv-hidden"}" data-q="{q}" data-k="{k}" '
                         f'x="{left + k * cell:.1f}" y="{top + q * cell:.1f}" width="{cell - 1:.1f}" '
                         f'height="{cell - 1:.1f}" fill="{BLUE if seen else GREY}" '
                         f'fill-opacity="{1 if seen else 0.15}"/>')
    y = top + size + 12
    parts.append(svg_text(left - 6, y + cell - 2, "kept", 'text-anchor="end"'))
    for k in range(n):
        parts.append(f'<rect class="{"kv-kept" if k in kept else "kv-gone"}" data-k="{k}" '
                     f'x="{left + k * cell:.1f}" y="{y:.1f}" width="{cell - 1:.1f}" height="{cell - 1:.1f}" '
                     f'fill="{RED if k in kept else GREY}" fill-opacity="{1 if k in kept else 0.15}"/>')
    parts.append(svg_text(left, y + cell + 16, "0"))
    parts.append(svg_text(left + size, y + cell + 16, str(n - 1), 'text-anchor="end"'))
    return "".join(parts) + "</svg>"


def mask_text(report: dict) -> str:
    """The view as text: the grid in characters (■ may attend, · may not) and the kept tokens."""
    rows = [f"{report['kind']}, {report['n']} tokens (rows: queries; columns: keys)"]
    rows += [f"{q:>3} " + " ".join("■" if s else "·" for s in row) for q, row in enumerate(report["grid"])]
    kept = set(report["kept"])
    rows.append("kept" + " " + " ".join("■" if k in kept else "·" for k in range(report["n"])))
    rows.append(f"the cache holds {report['tokens_held']} tokens: {numbers(report['kept'])}")
    return "\n".join(rows)


def mask_html(report: dict) -> str:
    held = report["tokens_held"]
    return report_html(f'After {report["n"]} tokens a <code>{report["kind"]}</code> layer holds <b>{held}</b> '
                       f'token{"" if held == 1 else "s"}: {numbers(report["kept"])} (the last row of the grid).',
                       grid_svg(report))


def explorer(kind: str = "window", window: int = 4, sinks: int = 0, chunk: int = 4, n: int = 12) -> ipywidgets.VBox:
    """An ipywidgets panel: the kind of layer, its window, sinks and chunk, and the text's length in;
    the mask and the kept tokens out. The controls a kind does not use are disabled."""
    import ipywidgets as w

    int_in_range("window", window, 1, 16), int_in_range("sinks", sinks, 0, 4), int_in_range("chunk", chunk, 1, 16)
    mask_report(kind, n, window, sinks, chunk)  # a bad setting fails here, saying which
    style = {"description_width": "110px"}
    controls = {
        "kind": w.Dropdown(options=KINDS, value=kind, description="kind of layer", style=style),
        "window": w.IntSlider(value=window, min=1, max=16, description="window (tokens)", style=style),
        "sinks": w.IntSlider(value=sinks, min=0, max=4, description="sinks", style=style),
        "chunk": w.IntSlider(value=chunk, min=1, max=16, description="chunk (tokens)", style=style),
        "n": w.IntSlider(value=n, min=1, max=MAX_N, description="text (tokens)", style=style),
    }

    def enable(_name: str) -> None:
        k = controls["kind"].value
        controls["window"].disabled = controls["sinks"].disabled = k != "window"
        controls["chunk"].disabled = k != "chunked"

    c = controls
    return panel(controls, lambda v: mask_report(v["kind"], v["n"], v["window"], v["sinks"], v["chunk"]),
                 mask_html, mask_text, layout=[[c["kind"], c["n"]], [c["window"], c["sinks"], c["chunk"]]],
                 on_change=enable)
