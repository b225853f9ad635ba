"""Pictures of the ideas, drawn with matplotlib: what the chapters draw before they measure.

Each function returns a ``matplotlib.figure.Figure`` and draws only boxes, grids, arrows and
labels, so a learner can change the sizes and see the picture follow::

    fig = kvbook.diagrams.attention_rows(prompt_len=8)   # the prefill triangle, one decode row
    fig = kvbook.diagrams.attention_wiring()             # one attention layer during decode
    fig = kvbook.diagrams.cache_layout(layers=2)         # per-layer (B, H_kv, S, D) tensors
    fig = kvbook.diagrams.block_table()                  # paged memory: table -> pool
    fig = kvbook.diagrams.paged_loop()                   # a paged kernel's per-block loop

The cells are drawn as ``Rectangle`` patches with a ``gid`` naming what they stand for
(``"computed"``, ``"cached"``, ``"new"``, ``"free"`` ...), which is what the tests count.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from .plot import COLORS
from kvlib.validate import positive_int

_LIGHT = "#E8E8E8"
_PARTS = {  # what a cell stands for -> its colour
    "computed": COLORS["cached"],
    "masked": "white",
    "recomputed": _LIGHT,
    "cached": COLORS["cached"],
    "new": COLORS["naive"],
    "filled": COLORS["cached"],
    "free": "white",
}


def _cell(ax: plt.Axes, x: float, y: float, part: str, w: float = 1.0, h: float = 1.0, **kw) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=kw.pop("color", _PARTS.get(part, "white")), edgecolor="#555555",
                           linewidth=0.6, gid=part, **kw))


def _box(ax: plt.Axes, x: float, y: float, w: float, h: float, text: str, color: str = "white",
         size: float = 9, **kw) -> None:
    """A rounded box centred on (x, y) with ``text`` inside."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="#333333", linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, **kw)


def _arrow(ax: plt.Axes, start: tuple[float, float], end: tuple[float, float], text: str = "",
           color: str = "#333333", **kw) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.0, **kw))
    if text:
        ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2, text, fontsize=8, color=color,
                va="center")


def _blank(ax: plt.Axes, xlim: tuple[float, float], ylim: tuple[float, float]) -> None:
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")


def attention_rows(prompt_len: int = 6) -> Figure:
    """Prefill against one decode step, as the score matrix Q·Kᵀ.

    Left: a prefill of ``prompt_len`` tokens computes the causal triangle, every query against
    the keys at or before it. Right: the next decode step has one new query. Its row needs every
    key, but only the newest key and value are new: the others were computed in the prefill
    and are read from the cache. Without a cache the grey rows would be recomputed too.
    """
    positive_int("prompt_len", prompt_len)
    if prompt_len > 24:
        raise ValueError(f"prompt_len={prompt_len} is too many cells to read; use 24 or fewer")
    T = prompt_len
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 4.4), layout="constrained")
    for i in range(T):  # query row i, drawn top to bottom
        for j in range(T):
            _cell(left, j, T - 1 - i, "computed" if j <= i else "masked")
    left.set_title(f"prefill: {T} queries × {T} keys", fontsize=10)
    _blank(left, (-0.6, T + 0.4), (-1.4, T + 1.3))
    left.text(T / 2, -0.8, "one matrix product; the white half is masked out", ha="center", fontsize=8)

    n = T + 1  # the decode step's keys: the prompt's T plus the new token's own
    for i in range(n):
        for j in range(i + 1):
            if i < n - 1:
                _cell(right, j, n - 1 - i, "recomputed")
            else:
                _cell(right, j, 0, "cached" if j < n - 1 else "new")
    right.set_title(f"decode step: 1 query × {n} keys", fontsize=10)
    _blank(right, (-0.6, n + 0.4), (-1.4, n + 1.3))
    right.annotate("", xy=(0, n + 0.35), xytext=(n - 1, n + 0.35),
                   arrowprops=dict(arrowstyle="|-|", color=COLORS["cached"], lw=1.0))
    right.text((n - 1) / 2, n + 0.6, "k, v read from the cache", ha="center", fontsize=8,
               color=COLORS["cached"])
    right.text(n - 0.5, n + 0.6, "new", ha="center", fontsize=8, color=COLORS["naive"])
    right.text(n / 2, -0.8, "grey rows: what a no-cache loop would recompute", ha="center", fontsize=8)
    return fig


def attention_wiring() -> Figure:
    """One attention layer during decode, and where the cache enters it.

    The projection makes the new tokens' q, k and v. RoPE rotates q and k only, at positions
    ``cache.positions(tokens)`` that start at the cache's length
    (``past = cache.get_seq_length()``), so the new query and
    key are rotated as if the whole sequence had been run again; v is never rotated.
    ``cache.update`` sits inside the layer: it stores the rotated key and the value, and returns
    every key and value so far. The mask is the cache's answer too: one row per new query and
    one column per cached-plus-new key, or None, "causal, offset by past", for a plain cache.
    """
    fig, ax = plt.subplots(figsize=(10.0, 6.6), layout="constrained")
    blue, red, grey = COLORS["cached"], COLORS["naive"], COLORS["reference"]
    pale = "#DCEBF5"
    _box(ax, 4.6, 7.1, 3.4, 0.75, "x  (B, T, d)\nthe new tokens' hidden states", size=8)
    _box(ax, 4.6, 5.8, 3.4, 0.7, "q, k, v = W_q·x, W_k·x, W_v·x", size=8)
    _box(ax, 1.9, 4.2, 3.0, 0.9, "RoPE(q, k): rotate q and k\n(never v) by position", size=8)
    _box(ax, 7.4, 4.2, 3.8, 0.9, "k, v = cache.update(k, v, layer_idx)\nnow (B, H_kv, past+T, D)", size=8,
         color=pale)
    _box(ax, 11.35, 4.2, 2.5, 1.2, "the cache\nper layer: K and V\n(B, H_kv, S, D)", size=8, color=pale)
    _box(ax, 10.2, 2.3, 3.2, 0.9, "mask = cache.mask(tokens)\n(B, 1, T, past+T) or None", size=8)
    _box(ax, 4.6, 2.3, 3.6, 0.8, "softmax(q·kᵀ/√D + mask)·v", size=8)
    _box(ax, 4.6, 0.9, 3.6, 0.7, "y = W_o · (heads concatenated)", size=8)
    _arrow(ax, (4.6, 6.72), (4.6, 6.15))
    _arrow(ax, (3.6, 5.45), (2.6, 4.65))  # q and k go through RoPE
    ax.text(3.0, 5.15, "q, k", fontsize=8, ha="right")
    _arrow(ax, (5.6, 5.45), (6.6, 4.65), color=red)  # v goes around it
    ax.text(6.25, 5.15, "v (not rotated)", fontsize=8, color=red)
    _arrow(ax, (3.4, 4.2), (5.5, 4.2), color=red)
    ax.text(4.45, 4.3, "k (rotated)", fontsize=8, color=red, ha="center", va="bottom")
    _arrow(ax, (9.3, 4.4), (10.1, 4.4), color=blue)
    ax.text(9.7, 4.5, "append", fontsize=8, color=blue, ha="center", va="bottom")
    _arrow(ax, (10.1, 4.0), (9.3, 4.0), color=blue)
    ax.text(9.7, 3.9, "all k, v", fontsize=8, color=blue, ha="center", va="top")
    _arrow(ax, (2.2, 3.75), (3.4, 2.7))
    ax.text(2.6, 3.1, "q (rotated)", fontsize=8, ha="right")
    _arrow(ax, (6.8, 3.75), (5.8, 2.7), color=blue)
    ax.text(6.5, 3.1, "every k, v so far", fontsize=8, color=blue)
    _arrow(ax, (11.35, 3.6), (10.8, 2.75), color=grey)  # the cache answers the mask
    _arrow(ax, (8.6, 2.3), (6.4, 2.3), color=grey)
    _arrow(ax, (4.6, 1.9), (4.6, 1.25))
    # the cache's length sets the positions RoPE rotates by: up, across the top, down
    ax.plot([11.35, 11.35, 1.0, 1.0], [4.8, 8.0, 8.0, 5.2], color=grey, lw=1.0)
    _arrow(ax, (1.0, 5.2), (1.0, 4.65), color=grey, shrinkA=0)
    ax.text(6.2, 8.1, "cache.positions(tokens): past, past+1, …, past+T−1,  "
            "where past = cache.get_seq_length()",
            ha="center", va="bottom", fontsize=8, color=grey)
    _blank(ax, (0.1, 12.8), (0.3, 8.6))
    return fig


def cache_layout(layers: int = 3, heads: int = 2, seq: int = 8, filled: int = 5) -> Figure:
    """The cache's memory: per layer, a key tensor and a value tensor of shape (B, H_kv, S, D).

    Drawn for one sequence (B = 1): one row per key-value head, one cell per position, each cell
    a D-long vector. ``filled`` positions hold past tokens; the next decode step's
    ``update(key_states, value_states, layer_idx)`` writes position ``filled`` in every head of
    that layer, once per layer per step. Empty cells are capacity reserved ahead (a static cache);
    a dynamic cache has none and grows instead.
    """
    for name, value in (("layers", layers), ("heads", heads), ("seq", seq)):
        positive_int(name, value)
    if not 0 <= filled < seq:
        raise ValueError(f"filled must be in [0, seq) so the next token has a slot; got filled={filled}, seq={seq}")
    row_h = heads + 1.2
    fig, ax = plt.subplots(figsize=(9.0, 0.9 + 0.55 * layers * row_h), layout="constrained")
    for layer in range(layers):
        top = (layers - layer) * row_h
        for t, x0 in (("K", 2.2), ("V", 3.6 + seq)):
            ax.text(x0 - 0.3, top - heads / 2, f"{t}[{layer}]", ha="right", va="center", fontsize=9)
            for h in range(heads):
                for s in range(seq):
                    part = "cached" if s < filled else "new" if s == filled else "free"
                    _cell(ax, x0 + s, top - 1 - h, part)
        ax.text(0.0, top - heads / 2, f"layer {layer}", ha="left", va="center", fontsize=9, weight="bold")
        ax.text(2.2 + filled + 0.5, top + 0.15, "↓", ha="center", va="bottom", fontsize=9, color=COLORS["naive"])
    ax.text(2.2, layers * row_h + 0.9,
            f"update(key_states, value_states, layer_idx) writes position {filled} in each layer's K and V:"
            f" {layers} calls per step", ha="left", fontsize=8, color=COLORS["naive"])
    ax.text(2.2, -0.75, "blue: past tokens · orange: this step's token · white: reserved, not yet written",
            fontsize=8, va="top")
    ax.text(2.2, -0.1, f"rows: H_kv = {heads} heads · columns: S = {seq} positions · each cell: one "
            "D-vector · shape (B, H_kv, S, D) per tensor", fontsize=8, va="top")
    _blank(ax, (-0.2, 4.2 + 2 * seq), (-1.5, layers * row_h + 1.5))
    return fig


def block_table(lengths: Sequence[int] = (10, 6), block_size: int = 4, pool_blocks: int = 8,
                tables: Sequence[Sequence[int]] | None = None) -> Figure:
    """Paged memory: each sequence's block table maps its logical blocks to physical blocks in one pool.

    A sequence of ``n`` tokens needs ``ceil(n / block_size)`` blocks; only its last block can be
    partly empty. The blocks need not be adjacent or in order in the pool. Blocks no table points
    to are free, for whichever sequence grows next.
    """
    positive_int("block_size", block_size)
    positive_int("pool_blocks", pool_blocks)
    if not lengths:
        raise ValueError("lengths is empty: draw at least one sequence")
    for n in lengths:
        positive_int("length", n)
    need = [-(-n // block_size) for n in lengths]
    if tables is None:  # a scattered but fixed placement, as an allocator that has served others leaves it
        order = [(5 * i + 3) % pool_blocks for i in range(pool_blocks)]
        if len(set(order)) < pool_blocks:
            order = list(range(pool_blocks))
        if sum(need) > pool_blocks:
            raise ValueError(f"{sum(need)} blocks needed for lengths {list(lengths)}, pool has {pool_blocks}")
        it = iter(order)
        tables = [[next(it) for _ in range(k)] for k in need]
    if len(tables) != len(lengths):
        raise ValueError(f"{len(tables)} tables for {len(lengths)} sequences")
    for n, k, table in zip(lengths, need, tables):
        if len(table) != k:
            raise ValueError(f"a sequence of {n} tokens needs {k} blocks of {block_size}, its table has {len(table)}")
    used = [b for table in tables for b in table]
    if len(set(used)) != len(used) or any(not 0 <= b < pool_blocks for b in used):
        raise ValueError(f"tables must point to distinct blocks in [0, {pool_blocks}), got {[list(t) for t in tables]}")

    colors = [COLORS["cached"], COLORS["accent"], COLORS["other"], COLORS["extra"], COLORS["naive"]]
    height = max(pool_blocks, 2.2 * len(lengths)) + 1.5
    fig, ax = plt.subplots(figsize=(9.0, 0.5 + 0.42 * height), layout="constrained")
    step = block_size * 0.5 + 0.3  # one logical block's width, gap included
    table_x = max(need) * step + 1.2
    pool_x = table_x + max(need) * 0.9 + 2.8
    ax.text(0, height - 0.5, "sequences (logical blocks)", fontsize=9, weight="bold")
    ax.text(table_x, height - 0.5, "block tables", fontsize=9, weight="bold")
    ax.text(pool_x, height - 0.5, "pool (physical blocks)", fontsize=9, weight="bold")
    owner = {}
    for i, (n, table) in enumerate(zip(lengths, tables)):
        y = height - 2.2 - 2.2 * i
        c = colors[i % len(colors)]
        ax.text(0, y + 1.1, f"sequence {i}: {n} tokens", fontsize=8)
        for k, b in enumerate(table):
            fill = min(block_size, n - k * block_size)
            for s in range(block_size):
                _cell(ax, k * step + s * 0.5, y, "filled" if s < fill else "free", w=0.5, h=0.8,
                      color=c if s < fill else "white")
            ax.text(k * step + block_size * 0.25, y - 0.3, f"logical {k}", ha="center", fontsize=7)
            _cell(ax, table_x + k * 0.9, y, "table", w=0.9, h=0.8, color="white")
            ax.text(table_x + k * 0.9 + 0.45, y + 0.4, str(b), ha="center", va="center", fontsize=9, color=c)
            owner[b] = (c, fill)
            _arrow(ax, (table_x + k * 0.9 + 0.45, y), (pool_x - 0.1, height - 1.6 - b + 0.4), color=c,
                   alpha=0.6)
    for b in range(pool_blocks):
        y = height - 1.6 - b
        c, fill = owner.get(b, ("white", 0))
        for s in range(block_size):
            _cell(ax, pool_x + s * 0.5, y, "filled" if s < fill else "free", w=0.5, h=0.8,
                  color=c if s < fill else "white")
        ax.text(pool_x + block_size * 0.5 + 0.2, y + 0.4, f"block {b}" + ("" if b in owner else " (free)"),
                va="center", fontsize=8)
    _blank(ax, (-0.3, pool_x + block_size * 0.5 + 2.6), (-0.3 + min(0, height - 2.2 * len(lengths) - 1.2), height))
    return fig


def paged_loop(table: Sequence[int] = (5, 1, 7), block_size: int = 4) -> Figure:
    """How a paged attention kernel reads the cache: block by block, in place, with an online softmax.

    For one query, the kernel walks the sequence's block table. For each entry it loads that
    physical block's keys and values straight from the pool (no copy into a contiguous tensor),
    scores them, and folds them into a running maximum ``m``, a running sum ``l`` and a running
    output ``acc``; rescaling by ``exp(m_old - m)`` keeps the earlier blocks' share exact. At the
    end, ``acc / l`` is the same softmax-weighted sum a contiguous kernel computes.
    """
    positive_int("block_size", block_size)
    if not table:
        raise ValueError("table is empty: a sequence in the cache has at least one block")
    if len(set(table)) != len(table) or min(table) < 0:
        raise ValueError(f"a block table lists distinct non-negative block ids, got {list(table)}")
    n = len(table)
    fig, ax = plt.subplots(figsize=(10.0, 4.8), layout="constrained")
    blue, red = COLORS["cached"], COLORS["naive"]
    pool = max(table) + 1
    width = 3.6 * n  # the drawing's width, in data units
    w = width / pool
    for b in range(pool):  # the pool along the bottom; the table's blocks highlighted
        _cell(ax, b * w, 0.0, "cached" if b in table else "free", w=w * 0.9, h=0.7,
              color="#DCEBF5" if b in table else "white")
        ax.text(b * w + w * 0.45, 0.35, str(b), ha="center", va="center", fontsize=8)
    ax.text(0, -0.35, "the pool of physical blocks (K and V), read in place: nothing is copied", fontsize=8,
            va="top")
    ax.text(0, 5.3, f"block table {list(table)};  start with m = −∞, l = 0, acc = 0", fontsize=9)
    for i, b in enumerate(table):
        x = 3.6 * (i + 0.5)
        _box(ax, x, 3.2, 3.2, 2.4,
             f"step {i + 1}: block {b}\nK, V = pool[{b}]   ({block_size} tokens)\ns = q·Kᵀ/√D\n"
             "m' = max(m, max s)\nacc = acc·e^(m−m') + Σ e^(s−m')·V\nl = l·e^(m−m') + Σ e^(s−m')\nm = m'",
             size=7.5)
        _arrow(ax, (b * w + w * 0.45, 0.75), (x, 1.95), color=blue, alpha=0.7)
        if i < n - 1:
            _arrow(ax, (x + 1.6, 3.2), (x + 2.0, 3.2), color=red)
    ax.text(width, 4.75, "out = acc / l", ha="right", fontsize=9, color=red, weight="bold")
    _blank(ax, (-0.2, width + 0.2), (-0.8, 5.6))
    return fig
