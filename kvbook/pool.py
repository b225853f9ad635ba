"""Step through a paged pool: a trace of an engine's run, drawn step by step, beside another's.

``pool_explorer(trace)`` takes a trace (`kvbook.pooltrace`'s format ``kv-pool-trace/1``: a
dict, or the path of a JSON file a reader recorded) and shows, at each scheduler step, the
pool as a grid of blocks coloured by the sequence that holds them (a partly filled block
coloured up to its fill; cached blocks, free but still holding a prefix, grey; free blocks
empty), the block tables, the counts of used, cached and free blocks, and the step's
events. A play button and a slider move through the steps::

    from kvbook.pool import pool_explorer
    pool_explorer(kvlib_trace, other=vllm_trace)   # the two engines, step for step

Each view is plain HTML and SVG (`step_html`), so it reads on a static page too. With no
widget front end (a terminal, nbval) the panel shows its first step, or ``step``, as text
(`step_text`). The website's explorer (``js/pool-explorer.js``, ``data-explorer="pool"``)
draws the same view from the traces `write` ships as a script::

    python -m kvbook.pool js/pool-traces.js ch12-kvlib=kvlib.json ch12-vllm=record.json#vllm
"""

from __future__ import annotations

import json
import sys
from html import escape
from pathlib import Path

from .pooltrace import check_trace, load, seq_key, state_at, step_range

# Okabe-Ito, without black: legible on light and dark pages, told apart by most colour-blind eyes
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"]
CACHED = "#8C8C8C"
CELL, GAP, LABEL, TANK = 40, 4, 14, 26  # a block's box: its label row over its "tank" (px)


def sequences(*traces: dict) -> list[str]:
    """Every sequence key, in the order it first holds blocks (trace by trace; in a step, by `seq_key`)."""
    seen: dict[str, None] = {}
    for t in traces:
        for s in t["steps"]:
            seen.update(dict.fromkeys(sorted(s["tables"], key=seq_key)))
    return list(seen)


def colours(*traces: dict) -> dict[str, str]:
    """One colour per sequence, the same for a sequence in either trace."""
    return {seq: PALETTE[i % len(PALETTE)] for i, seq in enumerate(sequences(*traces))}


def _ids(blocks: list) -> str:
    return ("block " if len(blocks) == 1 else "blocks ") + ", ".join(str(b) for b in blocks)


def event_text(e: dict) -> str:
    """One event in words: ``allocate 0: blocks 3, 4``."""
    kind = e.get("kind")
    if kind == "admit":
        cached = e.get("cached_tokens")
        return f"admit {e['seq']}" + ("" if cached is None else f" ({cached} tokens cached)")
    if kind == "hit":
        return f"prefix hit {e['seq']}: reuses {_ids(e['blocks'])}"
    if kind in ("allocate", "free"):
        return f"{kind} {e['seq']}: {_ids(e['blocks'])}"
    if kind == "seal":
        return f"seal {_ids(e['blocks'])} (full: its prefix can be reused)"
    if kind == "fork":
        return f"fork {e['seq']} from {e['parent']}: shares {_ids(e['blocks'])}"
    if kind == "cow":
        return f"copy-on-write {e['seq']}: block {e['from']} → {e['to']}"
    if kind == "evict":
        return f"evict {_ids(e['blocks'])} (its cached prefix dropped)"
    if kind == "preempt":
        return f"preempt {e['seq']}: gives back {_ids(e['blocks'])}"
    return f"{kind} (not drawn)"


def _cells(trace: dict, state: dict) -> list[dict]:
    """Each block as the grid draws it: its owners' keys, its fill in tokens, and its kind."""
    cached = set(state["cached_blocks"])
    out = []
    for b in range(trace["num_blocks"]):
        owners = state["owners"].get(b, [])
        kind = "used" if owners else "cached" if b in cached else "free"
        out.append({"block": b, "owners": owners, "fill": state["fill"].get(b, 0), "kind": kind})
    return out


def _label(owners: list[str]) -> str:
    """What a block's label says: its owner (cut to 4 characters), or how many share it (``×2``)."""
    if len(owners) > 1:
        return f"×{len(owners)}"
    return "" if not owners else owners[0] if len(owners[0]) <= 4 else owners[0][:3] + "…"


def grid_svg(trace: dict, state: dict, palette: dict[str, str], width: int = 640) -> str:
    """The pool as SVG: block ``b`` at row ``b // columns``; above each block its id and its
    owner (``2.1``, or ``×2`` when two sequences share it, drawn with a thicker edge), and the
    block coloured up to its fill."""
    size, cols = trace["block_size"], max(1, min(16, (width + GAP) // (CELL + GAP)))
    rows = -(-trace["num_blocks"] // cols)
    w, h = cols * (CELL + GAP) - GAP, rows * (LABEL + TANK + GAP)
    used, cached = state["counts"]["used"], state["counts"]["cached"]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" class="kv-svg kv-pool-grid" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" role="img" aria-label="pool of {trace["num_blocks"]} blocks at step '
           f'{state["step"]}: {used} used, {cached} cached">']
    for c in _cells(trace, state):
        x, y = (c["block"] % cols) * (CELL + GAP), (c["block"] // cols) * (LABEL + TANK + GAP)
        owner = _label(c["owners"])
        tip = (f"block {c['block']}: " + (f"{', '.join(c['owners'])}, {c['fill']} of {size} tokens"
                                         if c["owners"] else c["kind"]))
        svg.append(f'<g class="kv-block" data-block="{c["block"]}" data-kind="{c["kind"]}" '
                   f'data-owners="{escape(" ".join(c["owners"]))}" data-fill="{c["fill"]}"><title>{escape(tip)}</title>')
        svg.append(f'<text x="{x}" y="{y + 10}" font-size="9" fill="currentColor" opacity="0.75">{c["block"]}</text>')
        if owner:
            svg.append(f'<text x="{x + CELL}" y="{y + 10}" font-size="10" font-weight="600" text-anchor="end" '
                       f'fill="currentColor">{escape(owner)}</text>')
        ty = y + LABEL
        if c["kind"] == "used":
            colour = palette.get(c["owners"][0], CACHED)
            part = TANK * c["fill"] / size
            svg.append(f'<rect x="{x + 0.5}" y="{ty + 0.5}" width="{CELL - 1}" height="{TANK - 1}" fill="{colour}" '
                       f'fill-opacity="0.18" stroke="{colour}" stroke-width="{2.5 if len(c["owners"]) > 1 else 1}"/>')
            svg.append(f'<rect x="{x + 0.5}" y="{ty + TANK - part:.1f}" width="{CELL - 1}" height="{part:.1f}" '
                       f'fill="{colour}"/>')
        elif c["kind"] == "cached":
            svg.append(f'<rect x="{x + 0.5}" y="{ty + 0.5}" width="{CELL - 1}" height="{TANK - 1}" fill="{CACHED}" '
                       f'fill-opacity="0.45" stroke="{CACHED}"/>')
        else:
            svg.append(f'<rect x="{x + 0.5}" y="{ty + 0.5}" width="{CELL - 1}" height="{TANK - 1}" fill="none" '
                       f'stroke="{CACHED}" stroke-dasharray="3 2"/>')
        svg.append("</g>")
    return "".join(svg) + "</svg>"


def _title(trace: dict, state: dict) -> str:
    at, last = state["at"], trace["steps"][-1]["step"]
    where = (" (before its first step)" if at is None else "" if at == state["step"] else
             f" (its trace ends at step {at})" if at == last else f" (none recorded: as at step {at})")
    return (f"{trace.get('engine', 'an engine')}: step {state['step']}{where}, {trace['num_blocks']} blocks "
            f"of {trace['block_size']} tokens")


def panel_html(trace: dict, step: int, palette: dict[str, str]) -> str:
    """One trace at one step: its counts, grid, block tables and events, as HTML."""
    s = state_at(trace, step)
    counts = " · ".join(f'{k} <b data-name="{k}">{s["counts"][k]}</b>' for k in ("used", "cached", "free"))
    rows = "".join(
        f'<tr data-seq="{escape(seq)}"><td><span style="color:{palette.get(seq, CACHED)}">■</span> {escape(seq)}</td>'
        f'<td>{", ".join(str(b) for b in table)}</td><td style="text-align:right">{s["lengths"][seq]}</td></tr>'
        for seq, table in s["tables"].items())
    tables = (f'<table class="kv-pool-tables"><tr><th>sequence</th><th>block table</th><th>tokens</th></tr>{rows}'
              "</table>" if rows else "<p><i>no sequence holds a block</i></p>")
    events = "".join(f"<li>{escape(event_text(e))}</li>" for e in s["events"])
    events = f"<ol>{events}</ol>" if events else "<p><i>no block events at this step</i></p>"
    note = ""
    if len(s["cached_blocks"]) != s["counts"]["cached"]:
        note = (f"<p><i>The events mark {len(s['cached_blocks'])} blocks cached; the engine counts "
                f"{s['counts']['cached']}.</i></p>")
    return (f'<div class="kv-pool-panel" style="flex:1 1 300px;min-width:0"><p><b>{escape(_title(trace, s))}</b></p>'
            f"<p>{counts}</p>{grid_svg(trace, s, palette)}{note}{tables}"
            f"<p><b>Events</b></p>{events}</div>")


def step_html(trace: dict, step: int, other: dict | None = None) -> str:
    """The view at ``step``: one panel, or two side by side (wrapping on a narrow screen)."""
    traces = [trace] + ([other] if other is not None else [])
    palette = colours(*traces)
    panels = "".join(panel_html(t, step, palette) for t in traces)
    return f'<div class="kv-pool" style="display:flex;flex-wrap:wrap;gap:1em">{panels}</div>'


def grid_text(trace: dict, state: dict, cols: int = 16) -> list[str]:
    """The grid as text: each block its owner (``*`` when shared), ``c`` cached, ``.`` free."""
    marks = []
    for c in _cells(trace, state):
        mark = (c["owners"][0] + ("*" if len(c["owners"]) > 1 else "") if c["owners"]
                else "c" if c["kind"] == "cached" else ".")
        marks.append(f" {mark:>4}")
    return ["".join(marks[i:i + cols]) for i in range(0, len(marks), cols)]


def step_text(trace: dict, step: int, other: dict | None = None) -> str:
    """The view at ``step`` as text, for a terminal: per trace, its counts, events, tables and grid."""
    out = []
    for t in [trace] + ([other] if other is not None else []):
        s = state_at(t, step)
        c = s["counts"]
        out += [_title(t, s), f"  used {c['used']}, cached {c['cached']}, free {c['free']}"]
        out += [f"  event: {event_text(e)}" for e in s["events"]]
        out += [f"  {seq:>6}: blocks {table}, {s['lengths'][seq]} tokens" for seq, table in s["tables"].items()]
        out += ["  " + line for line in grid_text(t, s)]
    return "\n".join(out)


class StepViews:
    """What a panel shows without a widget front end: its current step, as text and as HTML."""

    def _bundle(self) -> dict:
        return {"text/plain": step_text(*self._args()), "text/html": step_html(*self._args())}

    def _args(self):
        return self.trace, self.step, self.other


class PoolView(StepViews):
    """The view of one step, for where ipywidgets is not installed."""

    def __init__(self, trace: dict, step: int, other: dict | None = None):
        self.trace, self.step, self.other = trace, step, other

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return self._bundle()

    def __repr__(self) -> str:
        return step_text(*self._args())


def _step(step, lo: int, hi: int) -> int:
    if step is None:
        return lo
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not lo <= step <= hi:
        raise IndexError(f"step {step} is outside the traces' steps, {lo} to {hi}")
    return step


def pool_explorer(trace, other=None, step: int | None = None):
    """A play button and a step slider over ``trace`` (and ``other``, side by side), showing
    `step_html` at the chosen step. ``trace``/``other``: a dict or the path of a JSON trace,
    checked by `kvbook.pooltrace.check_trace`. ``step``: where it opens (the first step by default).
    Without ipywidgets, a `PoolView` of that step; a panel without a front end shows the same."""
    traces = [load(trace)] + ([load(other)] if other is not None else [])
    lo, hi = step_range(*traces)
    start = _step(step, lo, hi)
    try:
        import ipywidgets as w
    except ImportError:  # a plain terminal: the step, as text
        return PoolView(traces[0], start, traces[1] if other is not None else None)

    class PoolExplorer(StepViews, w.VBox):
        def _repr_mimebundle_(self, **kwargs):  # the widget, and the step for a front end without one
            return {**self._bundle(), **(super()._repr_mimebundle_(**kwargs) or {}),
                    "text/plain": step_text(*self._args())}

        def _args(self):
            return self.trace, self.controls["step"].value, self.other

    play = w.Play(value=start, min=lo, max=hi, interval=800, description="play")
    slider = w.IntSlider(value=start, min=lo, max=hi, description="step")
    w.link((play, "value"), (slider, "value"))  # in the kernel: a play tick moves the slider
    out = w.HTML()
    panel = PoolExplorer([w.HBox([play, slider]), out])
    panel.trace, panel.other = traces[0], traces[1] if other is not None else None
    panel.controls, panel.output = {"play": play, "step": slider}, out

    def refresh(*_) -> None:
        out.value = step_html(*panel._args())

    slider.observe(refresh, names="value")
    refresh()
    return panel


# -- the website's copy: the traces as a script ---------------------------------------------------
GLOBAL = "kvPoolTraces"  # the one global the script sets, which js/pool-explorer.js reads
_HEAD = (f"// The pool explorer's traces (js/pool-explorer.js reads window.{GLOBAL}), written by\n"
         f"// `python -m kvbook.pool` from recorded traces: do not edit.\n"
         f"window.{GLOBAL} = ")


def script(traces: dict[str, dict]) -> str:
    """``traces`` (name -> checked trace) as a script setting ``window.kvPoolTraces``."""
    for name, t in traces.items():
        if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
            raise ValueError(f"a trace's name is one word (a page names it in data-traces), got {name!r}")
        check_trace(t)
    return _HEAD + json.dumps(traces, separators=(",", ":"), allow_nan=False) + ";\n"


def read_script(text: str) -> dict:
    """The traces a `script` sets, back as a dict."""
    if not (text.startswith(_HEAD) and text.endswith(";\n")):
        raise ValueError("not a script written by kvbook.pool")
    return json.loads(text[len(_HEAD):-2])


def source(spec) -> dict:
    """A trace from a dict, a JSON file's path, or ``"record.json#key"``: the trace stored
    under ``key`` in a record holding several (vllmcheck's ``pool_trace_cpu.json#vllm``)."""
    if isinstance(spec, str) and "#" in spec:
        path, _, key = spec.rpartition("#")
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(record, dict) or key not in record:
            keys = ", ".join(record) if isinstance(record, dict) else "none"
            raise ValueError(f"{path} holds no trace under {key!r} (its keys: {keys})")
        return load(record[key])
    return load(spec)


def write(path: str | Path, traces: dict) -> Path:
    """Write `script` of ``traces`` (name -> anything `source` reads) to ``path``, a ``.js`` file."""
    path = Path(path)
    if path.suffix != ".js":
        raise ValueError(f"the pool traces are a script: write them to a .js file, not {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script({name: source(t) for name, t in traces.items()}))
    return path


if __name__ == "__main__":
    pairs = [a.partition("=") for a in sys.argv[2:]]
    if len(sys.argv) < 2 or any(not sep for _, sep, _ in pairs):
        raise SystemExit("usage: python -m kvbook.pool OUT.js [NAME=TRACE.json | NAME=RECORD.json#KEY ...]")
    print(f"wrote {write(sys.argv[1], {name: p for name, _, p in pairs})}")
