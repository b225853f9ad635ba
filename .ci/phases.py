"""CI's phase table: each phase's wall time against its budget, and a warning for each one over.

    python .ci/phases.py BUDGETS LOG [WALL_SECONDS]

BUDGETS (.ci/budgets.tsv) is the one place the budgets live: a line per phase, ``phase<TAB>part<TAB>seconds``,
in the order .ci/run runs them; their seconds may add up to the whole run's budget (`TOTAL_BUDGET_S`) at most.
LOG is what ``.ci/phase`` appended while CI ran: ``phase<TAB>seconds<TAB>exit``. WALL_SECONDS, the whole run's
wall time, shows what ran outside every phase (make's set-up steps between them). The report only warns: a slow
phase is a number to act on, not a failed check. Only the standard library: it runs before anything is
installed, and after anything fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

TOTAL_BUDGET_S = 45 * 60  # the whole run, on a quiet machine where CI has run before (DEVELOPERS.md)
RULE = "-" * 58


def read_budgets(path: Path) -> list[tuple[str, str, int]]:
    """The budgets as (phase, part, seconds), in run order; a malformed or repeated line is a ValueError."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3 or not fields[2].isdigit():
            raise ValueError(f"{path}:{n}: expected 'phase<TAB>part<TAB>seconds', got {line!r}")
        rows.append((fields[0], fields[1], int(fields[2])))
    names = [r[0] for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a phase is listed twice: {names}")
    return rows


def read_log(path: Path) -> list[tuple[str, int, int]]:
    """The phases that ran, as (phase, seconds, exit status), in the order they ran."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, seconds, status = line.split("\t")
        rows.append((name, int(seconds), int(status)))
    return rows


def report(budgets: list[tuple[str, str, int]], ran: list[tuple[str, int, int]],
           wall: int | None = None) -> tuple[str, list[str]]:
    """The table (a phase a row, then each part, then the whole run) and the warnings, one line each.

    ``wall``: the whole run's wall seconds (default: the phases' sum); what ran outside every phase gets a row
    and counts against the whole run's budget.
    """
    budget = {name: (part, seconds) for name, part, seconds in budgets}
    warnings = []
    lines = [f"{'phase':<16} {'part':<14} {'seconds':>8} {'budget':>8}", RULE]
    spent: dict[str, int] = {}
    for name, seconds, status in ran:
        part, allowed = budget.get(name, ("?", 0))
        flag = "  FAILED" if status else ("  over" if seconds > allowed else "")
        lines.append(f"{name:<16} {part:<14} {seconds:>8} {allowed or '-':>8}{flag}")
        spent[part] = spent.get(part, 0) + seconds
        if name not in budget:
            warnings.append(f"phase {name!r} ran {seconds} s and has no budget: add it to .ci/budgets.tsv")
        elif seconds > allowed:
            warnings.append(f"phase {name!r} took {seconds} s, over its budget of {allowed} s")
    inside = sum(seconds for _, seconds, _ in ran)
    total = inside if wall is None else max(wall, inside)
    if total > inside:
        lines.append(f"{'between phases':<16} {'':<14} {total - inside:>8} {'-':>8}")
    lines.append(RULE)
    for part in dict.fromkeys(p for _, p, _ in budgets):
        if part in spent:
            allowed = sum(s for _, p, s in budgets if p == part)
            lines.append(f"{'':<16} {part:<14} {spent[part]:>8} {allowed:>8}")
    over = total > TOTAL_BUDGET_S
    lines.append(f"{'whole run':<16} {f'{total / 60:.1f} min':<14} {total:>8} {TOTAL_BUDGET_S:>8}"
                 + ("  over" if over else ""))
    if over:
        warnings.append(f"the whole run took {total} s ({total / 60:.1f} min), over its budget of "
                        f"{TOTAL_BUDGET_S} s ({TOTAL_BUDGET_S // 60} min)")
    allotted = sum(s for _, _, s in budgets)
    if allotted > TOTAL_BUDGET_S:
        warnings.append(f".ci/budgets.tsv allots {allotted} s, more than the whole run's {TOTAL_BUDGET_S} s")
    return "\n".join(lines), warnings


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    wall = int(argv[2]) if len(argv) == 3 else None
    table, warnings = report(read_budgets(Path(argv[0])), read_log(Path(argv[1])), wall)
    print("== CI phases (wall seconds) ==")
    print(table)
    for w in warnings:
        print(f"WARNING: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
