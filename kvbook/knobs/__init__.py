"""Knobs: small ipywidgets panels where moving a control changes what a chapter teaches.

One module per idea, each in the shape of `kvbook.explorer` (chapter 4's): pure functions that
compute a report with kvlib (never a copy of its formulas), a plain-text view and an SVG
drawing of it, and ``explorer()`` wiring both to ipywidgets::

    from kvbook.knobs.masks import explorer
    explorer(kind="window", window=4, sinks=2, n=12)     # chapters 7.2 and 10

- `kvbook.knobs.masks`: what a full, window (with sinks) or chunked layer may see, and the
  tokens its cache keeps (`kvlib.layers`, `kvlib.hybrid.HybridCache`);
- `kvbook.knobs.quant`: bits and group size against error and bytes (`kvlib.quant`);
- `kvbook.knobs.speculative`: draft length and acceptance against tokens per forward, the formula
  beside a seeded simulation (`kvlib.speculative`);
- `kvbook.knobs.step`: batch and context against a decode step's time on the roofline
  (`kvlib.hardware.step_time`).

Every panel works where readers are. In Jupyter and Colab its controls are live (the tests
drive them in code, through the widgets' own values). With no widget front end (nbval, a plain
terminal) the panel shows its default view as text: its ``text/plain`` form, and ``print`` of
it, is the view's text rather than the widget's repr. On the website a panel's output is
removed and a plain-JavaScript explorer (``js/explorers.js``) computes the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ipywidgets

# Colours of the data (Okabe-Ito, as the site's explorers); text and lines are currentColor,
# so a picture reads on a dark notebook as on a light one.
BLUE, RED, GREY, GREEN, ORANGE = "#0072B2", "#D55E00", "#8C8C8C", "#009E73", "#E69F00"


@cache
def _panel_class() -> type:
    """`Panel`'s class, made on first use so that importing kvbook.knobs needs no ipywidgets."""
    import ipywidgets as w

    class Panel(w.VBox):
        """A VBox whose text form is its current view: what a notebook with no widget front end
        (nbval, a terminal) shows in place of the live panel. ``controls`` maps each setting's
        name to its widget, ``output`` is the HTML widget the view is drawn in, and ``report``
        is the latest report the view shows."""

        def text(self) -> str:
            return self.text_of(self.report)

        def __repr__(self) -> str:
            return self.text()

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data["text/plain"] = self.text()
            return data

    return Panel


def panel(controls: dict[str, ipywidgets.Widget], compute: Callable[[dict], dict],
          html: Callable[[dict], str], text: Callable[[dict], str],
          layout: list | None = None, on_change: Callable[[str], None] | None = None) -> ipywidgets.VBox:
    """Wire ``controls`` to a view: on every change, ``compute({name: value})`` makes a report,
    ``html(report)`` draws it into the panel's output and ``text(report)`` is its plain form.
    ``on_change(name)`` runs first (to enable or disable controls); ``layout`` lists the rows of
    controls (default: all in one column)."""
    import ipywidgets as w

    out = w.HTML()
    rows = layout or [list(controls.values())]
    box = _panel_class()([*(w.HBox(r) for r in rows), out])
    box.controls, box.output, box.text_of = controls, out, text

    name_of = {id(c): name for name, c in controls.items()}

    def refresh(change=None) -> None:
        if on_change is not None:
            on_change(name_of[id(change["owner"])] if change else "")
        box.report = compute({name: c.value for name, c in controls.items()})
        out.value = html(box.report)

    for c in controls.values():
        c.observe(refresh, names="value")
    refresh()
    return box


def svg_open(width: float, height: float, label: str) -> str:
    """An SVG element of the given size, its picture described for a screen reader."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">')


def svg_text(x: float, y: float, s: str, extra: str = "") -> str:
    """Text in the theme's colour."""
    return f'<text x="{x:.1f}" y="{y:.1f}" fill="currentColor" font-size="12" {extra}>{escape(s)}</text>'


def sig3(x: float) -> str:
    """Three significant figures with separators and no exponent: 13,800, 4.64, 0.0123."""
    v = float(f"{x:.3g}")
    digits = max(0, 2 - math.floor(math.log10(abs(v)))) if v else 0
    return f"{v:,.{digits}f}"


def report_html(sentence: str, svg: str) -> str:
    """A panel's view: its numbers in a sentence, then its picture."""
    return f'<div class="kv-report"><p>{sentence}</p>{svg}</div>'


def numbers(xs) -> str:
    """A list of ints as text, runs shortened: 0, 1, 8–11."""
    xs, parts, i = sorted(xs), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(f"{xs[i]}" if j == i else f"{xs[i]}, {xs[j]}" if j == i + 1 else f"{xs[i]}–{xs[j]}")
        i = j + 1
    return ", ".join(parts) or "none"
