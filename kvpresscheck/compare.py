"""Two presses' choices side by side: which positions each kept, per layer and KV head.

Plain Python over lists, so the tests can hand it made-up cases. A *kept* structure is a
list over layers of a list over KV heads of ascending positions (``kept[l][h]``). The
record stores each as a hex bit mask (`to_mask`, `from_mask`): bit ``p`` set when
position ``p`` was kept.

`compare_kept` counts the heads whose sets are identical and finds the worst overlap
(``|A & B| / max(|A|, |B|)``). Where sets differ, a *cause* must say why, with evidence;
`rounding_flip` tests the commonest one, two implementations' fp32 scores straddling the
top-k boundary, and `judge` turns a comparison into ``"pass"`` (identical sets and
tokens), ``"explained"`` (every difference has a cause) or ``"fail"``.
"""

from __future__ import annotations

import math

from vllmcheck.compare import shared_prefix  # how many tokens two continuations share

Kept = list[list[list[int]]]  # [layer][kv head] -> ascending positions


def to_mask(positions: list[int]) -> str:
    """Positions as a hex bit mask: ``[0, 2, 3]`` -> ``"d"`` (bits 0, 2 and 3)."""
    bits = 0
    for p in positions:
        if not isinstance(p, int) or p < 0:
            raise ValueError(f"positions must be non-negative ints, got {p!r}")
        bits |= 1 << p
    return format(bits, "x")


def from_mask(mask: str) -> list[int]:
    """The ascending positions of a hex bit mask (`to_mask`'s inverse)."""
    bits = int(mask, 16)
    return [p for p in range(bits.bit_length()) if bits >> p & 1]


def overlap(a: list[int], b: list[int]) -> float:
    """``|A & B| / max(|A|, |B|)``: 1.0 for identical sets (two empty sets included)."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / max(len(sa), len(sb)) if sa or sb else 1.0


def compare_kept(a: Kept, b: Kept) -> dict:
    """Identical heads, the worst overlap and where, and per differing head (``"layer.head"``) the
    positions only ``a`` and only ``b`` kept."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError(f"layers/heads differ: {[len(x) for x in a]} against {[len(y) for y in b]}")
    differ, worst = {}, {"layer": None, "head": None, "overlap": 1.0}
    n = 0
    for layer, (ha, hb) in enumerate(zip(a, b)):
        for head, (pa, pb) in enumerate(zip(ha, hb)):
            n += 1
            o = overlap(pa, pb)
            if o < worst["overlap"]:
                worst = {"layer": layer, "head": head, "overlap": o}
            if set(pa) != set(pb):
                differ[f"{layer}.{head}"] = {"only_a": sorted(set(pa) - set(pb)), "only_b": sorted(set(pb) - set(pa))}
    return {"heads": n, "identical": n - len(differ), "worst": worst, "differ": differ}


def rounding_flip(scores_a: list[float], scores_b: list[float], only_a: list[int], only_b: list[int],
                  rtol: float = 1e-4) -> dict | None:
    """Whether positions swapped across the top-k boundary because of rounding alone.

    Two conditions. The two sides' scores on the head must agree to rounding: their largest
    difference ``diff`` at most ``rtol`` of the largest score (fp32 sums in another order
    differ by about 1e-7 relative; a different algorithm by far more). And every swapped
    pair must lie within ``2 * diff`` of each other on both sides, as a swap caused by that
    difference must. Returns the evidence (``gap``, ``diff``, ``scale``), or None.
    """
    if len(only_a) != len(only_b) or not only_a:
        return None
    # positions a side always keeps score +inf there: they are never swapped, and not rounding
    finite = [(x, y) for x, y in zip(scores_a, scores_b) if math.isfinite(x) and math.isfinite(y)]
    diff = max((abs(x - y) for x, y in finite), default=0.0)
    scale = max((abs(y) for _, y in finite), default=0.0)
    gap = max(max(abs(s[i] - s[j]) for i in only_a for j in only_b) for s in (scores_a, scores_b))
    return {"gap": gap, "diff": diff, "scale": scale} if diff <= rtol * scale and gap <= 2 * diff else None


def judge(kept: dict, tokens_a: list[int], tokens_b: list[int], causes: list[dict]) -> str:
    """``"pass"``: every head identical and the tokens identical. ``"explained"``: the heads that
    differ are all named by a cause whose check held (``"holds": True``), and so are any token
    differences. ``"fail"``: anything else, including tokens that differ behind identical sets."""
    if kept["identical"] == kept["heads"]:
        return "pass" if tokens_a == tokens_b else "fail"
    covered = set()
    for c in causes:
        if not c.get("reason") or not c.get("holds"):
            return "fail"
        covered |= set(kept["differ"]) if c.get("heads") == "all" else set(c.get("heads", ()))
    return "explained" if set(kept["differ"]) <= covered else "fail"
