"""One figure style for the whole book.

``fig, ax = kvlib.book.plot.subplots()`` gives axes already styled (light grid, no
top/right spines, the book's colour cycle). The style is applied to the axes
themselves, not to matplotlib's global rcParams, so importing kvlib changes
nothing else in your session.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

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
