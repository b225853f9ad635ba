"""Draft length and acceptance against tokens per forward: the formula beside a simulation
(chapter 12).

If each of a draft's ``k`` guesses is right with probability ``a``, independently, a verify
step makes ``1 + a + ... + a^k`` tokens on average: `kvlib.speculative.expected_tokens_per_forward`.
``spec_report`` puts that beside a seeded simulation of the same steps, counted by kvlib's own
`SpecStats` (its ``tokens_per_forward``, and its ``acceptance_rate``, which is not ``a``: a step
stops at its first wrong guess). ``curve_svg`` draws both for k = 1 ... 8; ``explorer()`` wires
them to ipywidgets::

    from kvbook.knobs.speculative import explorer
    explorer(k=4, a=0.75)

The website's explorer (``data-explorer="speculate"``) draws the formula's curve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlib.speculative import SpecStats, expected_tokens_per_forward
from kvlib.validate import int_in_range, positive_int

from . import BLUE, GREY, RED, panel, report_html, svg_open, svg_text

if TYPE_CHECKING:
    import ipywidgets

MAX_K = 8  # draft lengths the curve shows
STEPS = 2000  # simulated verify steps per draft length


def simulate(k: int, a: float, steps: int = STEPS, seed: int = 0) -> SpecStats:
    """``steps`` verify steps of ``k`` guesses, each right with probability ``a`` (a seeded draw),
    each step keeping its guesses up to the first wrong one: what `speculative_generate` records."""
    int_in_range("k", k, 1, MAX_K)
    positive_int("steps", steps)
    expected_tokens_per_forward(k, a)  # checks a
    right = torch.rand(steps, MAX_K, generator=torch.Generator().manual_seed(seed)) < a  # (steps, MAX_K)
    accepted = right[:, :k].int().cumprod(dim=1).sum(dim=1)  # (steps,): guesses before the first wrong one
    return SpecStats(proposed_per_step=[k] * steps, accepted_per_step=accepted.tolist())


def spec_report(k: int = 4, a: float = 0.75, steps: int = STEPS, seed: int = 0) -> dict:
    """For every draft length 1 ... `MAX_K` (``curve``): the formula's tokens per forward and the
    simulation's, and the acceptance rate the simulation's `SpecStats` reports; ``chosen`` is ``k``'s."""
    int_in_range("k", k, 1, MAX_K)
    curve = []
    for j in range(1, MAX_K + 1):
        stats = simulate(j, a, steps, seed)
        curve.append({"k": j, "formula": expected_tokens_per_forward(j, a),
                      "simulated": stats.tokens_per_forward, "acceptance_rate": stats.acceptance_rate})
    return {"k": k, "a": a, "steps": steps, "curve": curve, "chosen": curve[k - 1]}


def curve_svg(report: dict, width: int = 440) -> str:
    """Tokens per verify forward against the draft length: the formula as a line, the simulation
    as dots, the chosen length ringed, and the ceiling ``k + 1`` dashed."""
    left, right, top, bottom, height = 40, 12, 10, 40, 220
    X = lambda k: left + (width - left - right) * (k - 0.5) / MAX_K  # noqa: E731
    Y = lambda t: top + (height - top - bottom) * (MAX_K + 1 - t) / MAX_K  # noqa: E731  (1 ... k + 1)
    c = report["chosen"]
    parts = [svg_open(width, height, f"tokens per verify forward at a = {report['a']:.2f}: "
                      f"{c['formula']:.2f} by the formula, {c['simulated']:.2f} simulated, at k = {c['k']}")]
    parts.append(f'<path d="M{left} {top} V{height - bottom} H{width - right}" fill="none" stroke="currentColor"/>')
    for t in range(1, MAX_K + 2, 2):
        parts.append(svg_text(left - 6, Y(t) + 4, str(t), 'text-anchor="end" font-size="11"'))
    for p in report["curve"]:
        parts.append(svg_text(X(p["k"]), height - bottom + 15, str(p["k"]), 'text-anchor="middle" font-size="11"'))
    parts.append(svg_text(left + (width - left - right) / 2, height - 6, "draft length k",
                          'text-anchor="middle" font-size="11"'))
    ceiling = " ".join(f"{X(p['k']):.1f},{Y(p['k'] + 1):.1f}" for p in report["curve"])
    parts.append(f'<polyline points="{ceiling}" fill="none" stroke="{GREY}" stroke-dasharray="4 3"/>')
    line = " ".join(f"{X(p['k']):.1f},{Y(p['formula']):.1f}" for p in report["curve"])
    parts.append(f'<polyline class="kv-formula" points="{line}" fill="none" stroke="{BLUE}" stroke-width="2.5"/>')
    for p in report["curve"]:
        parts.append(f'<circle cx="{X(p["k"]):.1f}" cy="{Y(p["simulated"]):.1f}" r="4" fill="{RED}"/>')
    parts.append(f'<circle class="kv-chosen" cx="{X(c["k"]):.1f}" cy="{Y(c["formula"]):.1f}" r="9" fill="none" '
                 f'stroke="currentColor" stroke-width="1.5"/>')
    parts.append(svg_text(left + 8, top + 12, "— formula   ● simulated   - - k + 1", 'font-size="11"'))
    return "".join(parts) + "</svg>"


def spec_text(report: dict) -> str:
    """The view as text: one line per draft length, the chosen one marked."""
    lines = [f"a = {report['a']:.2f}, {report['steps']:,} simulated steps: k, tokens per forward "
             "(formula, simulated), SpecStats.acceptance_rate"]
    for p in report["curve"]:
        mark = "→" if p is report["chosen"] else " "
        lines.append(f"{mark} {p['k']}: {p['formula']:.3f}, {p['simulated']:.3f}, {p['acceptance_rate']:.3f}")
    return "\n".join(lines)


def spec_html(report: dict) -> str:
    c = report["chosen"]
    return report_html(f'{c["k"]} guesses, each right with probability {report["a"]:.2f}: <b>{c["formula"]:.3f}</b> '
                       f'tokens per verify forward by the formula, <b>{c["simulated"]:.3f}</b> in {report["steps"]:,} '
                       f'simulated steps, whose acceptance rate (accepted over proposed) is '
                       f'{c["acceptance_rate"]:.3f}.', curve_svg(report))


def explorer(k: int = 4, a: float = 0.75) -> ipywidgets.VBox:
    """An ipywidgets panel: the draft length and the chance a guess is right in; tokens per forward
    by the formula and by simulation out."""
    import ipywidgets as w

    spec_report(k, a, steps=1)  # a bad setting fails here, saying which
    style = {"description_width": "170px"}
    controls = {
        "k": w.IntSlider(value=k, min=1, max=MAX_K, description="draft length k", style=style),
        "a": w.FloatSlider(value=a, min=0.0, max=1.0, step=0.05, description="chance a guess is right",
                           style=style),
    }
    return panel(controls, lambda v: spec_report(v["k"], v["a"]), spec_html, spec_text)
