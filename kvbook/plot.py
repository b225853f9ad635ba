"""One figure style for the whole book.

``fig, ax = kvbook.plot.subplots()`` gives axes already styled (light grid, no
top/right spines, the book's colour cycle). The style is applied to the axes
themselves, not to matplotlib's global rcParams, so importing kvlib changes
nothing else in your session. ``plain_ticks(ax)`` labels log axes 128, 1,024, ...
rather than 2^7, 10^3, ...
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axis import Axis
from matplotlib.ticker import FuncFormatter, NullFormatter

# Colour-blind-safe (Okabe-Ito). Named for what they stand for across chapters.
COLORS = {
    "naive": "#D55E00",  # vermillion: recompute everything
    "cached": "#0072B2",  # blue: the KV cache
    "reference": "#7F7F7F",  # grey: fits, bounds, references
    "accent": "#009E73",  # green
    "other": "#CC79A7",  # purple
    "extra": "#E69F00",  # orange
}
CYCLE = list(COLORS.values())


def style_axes(ax: plt.Axes) -> plt.Axes:
    """Apply the book's look to one Axes."""
    ax.set_prop_cycle(color=CYCLE)
    ax.grid(True, alpha=0.3, linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=9)
    ax.xaxis.label.set_size(10)
    ax.yaxis.label.set_size(10)
    ax.title.set_size(11)
    return ax


def subplots(nrows: int = 1, ncols: int = 1, *, width: float = 6.4, height: float = 3.6, **kwargs):
    """``plt.subplots`` with the book's size and style; returns ``(fig, ax)`` or ``(fig, axes)``."""
    if nrows < 1 or ncols < 1:
        raise ValueError(f"nrows and ncols must be >= 1, got {nrows} and {ncols}")
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), layout="constrained", **kwargs)
    for ax in (axes.flat if hasattr(axes, "flat") else [axes]):
        style_axes(ax)
    return fig, axes


def plain_ticks(target: plt.Axes | Axis, fmt: str = "{:,.12g}") -> plt.Axes | Axis:
    """Label ticks as plain numbers: 1, 10, 128, 1,024 rather than 10^0, 10^1, 2^7, 2^10.

    On a log scale matplotlib writes each tick as a power (``10^3``); a reader of a
    cache-size plot wants the number itself. ``target`` is an Axes (both its axes are
    relabelled) or one Axis (``ax.xaxis``, ``ax.yaxis``). Major ticks get
    ``fmt.format(value)``; the default, ``"{:,.12g}"``, groups thousands (``1,024``)
    and drops a trailing ``.0``; pass ``"{:g}"`` for ``1024``. Minor ticks lose their
    labels, which on a log axis would crowd the majors. Call it after ``ax.set(xscale=
    "log")``: setting a scale resets the formatters. Choose which ticks appear with
    ``ax.set_xticks`` as usual. Returns ``target``.
    """
    if isinstance(target, Axis):
        axes = [target]
    elif isinstance(target, plt.Axes):
        axes = [target.xaxis, target.yaxis]
    else:
        raise TypeError(f"plain_ticks needs a matplotlib Axes or Axis, got {type(target).__name__}")
    fmt.format(1.0)  # a bad format fails here, not later when the figure is drawn
    for axis in axes:
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt.format(v)))
        axis.set_minor_formatter(NullFormatter())
    return target
