"""One version, said the same way everywhere: pyproject.toml, ``kvlib.__version__`` and CHANGELOG.md.

A learner who pins kvlib reads the changelog to find what moved. So the newest entry must be the
version the package says it is, and each rename the changelog lists must be true of the code:
the new name is there now (or a newer entry renames it again), the old one is gone (or the row
says it is still importable).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import kvlib

pytestmark = pytest.mark.cpu_only("about the repository (layout, versions, CI, docstrings), not kvlib on a device")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
RELEASE = re.compile(r"^## (\d+\.\d+\.\d+) — (\d{4}-\d{2}-\d{2})\s*$")  # "## 0.4.0 — 2026-12-03"
NAME = re.compile(r"`(kvlib(?:\.\w+)+)(?:\([^`]*\))?`")  # `kvlib.a.B.c` or `kvlib.a.B.c(arg=)`


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def releases(text: str) -> list[tuple[str, str, list[str]]]:
    """(version, date, lines) for each ``## X.Y.Z — date`` section, in file order."""
    out: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        m = RELEASE.match(line)
        if m:
            out.append((m[1], m[2], []))
        elif line.startswith("## "):
            raise AssertionError(f"a second-level heading that is not a release: {line!r}")
        elif out:
            out[-1][2].append(line)
    return out


def rename_rows(lines: list[str]) -> list[tuple[str, str]]:
    """(old, new) cells of the section's table under ``### Renamed``."""
    rows, inside = [], False
    for line in lines:
        if line.startswith("### "):
            inside = line.strip() == "### Renamed"
        elif inside and line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not cells[0].startswith("Old"):  # the header row
                rows.append((cells[0], cells[1]))
    return rows


def removed_names(lines: list[str]) -> list[str]:
    """The dotted names each bullet under ``### Removed`` names before its first colon."""
    names, inside, bullet = [], False, ""
    for line in lines + ["### end"]:
        if line.startswith("### ") or line.startswith("- "):
            names += NAME.findall(bullet.split(":")[0])
            bullet = line if line.startswith("- ") and inside else ""
            if line.startswith("### "):
                inside = line.strip() == "### Removed"
        elif bullet:
            bullet += " " + line.strip()
    return names


def resolves(dotted: str) -> bool:
    """Whether ``kvlib.a.b.C.attr`` names something now: a module, a name in it, a class's
    attribute, or an attribute a kvlib class (or a kvlib base of it) sets on ``self``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, attr in enumerate(parts[cut:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif inspect.isclass(obj) and i == len(parts[cut:]) - 1:
                return any(re.search(rf"self\.{attr}\b\s*(:[^=]*)?=", inspect.getsource(c))
                           for c in obj.__mro__ if c.__module__.startswith("kvlib"))
            else:
                return False
        return True
    return False


def test_kvlib_version_is_pyprojects():
    assert kvlib.__version__ == pyproject_version()


def test_the_newest_changelog_entry_is_this_version():
    entries = releases(CHANGELOG.read_text(encoding="utf-8"))
    assert entries, "CHANGELOG.md has no '## X.Y.Z — YYYY-MM-DD' entry"
    assert entries[0][0] == kvlib.__version__, f"newest entry {entries[0][0]}, kvlib is {kvlib.__version__}"


def test_changelog_entries_run_newest_first():
    entries = releases(CHANGELOG.read_text(encoding="utf-8"))
    versions = [tuple(int(x) for x in v.split(".")) for v, _, _ in entries]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    dates = [d for _, d, _ in entries]
    assert dates == sorted(dates, reverse=True), dates


def test_each_rename_and_removal_in_the_changelog_is_true_of_the_code():
    """New names resolve now unless a newer entry renames them again; old and removed names are
    gone unless the row says "still importable" or a newer entry brings the name back."""
    entries = releases(CHANGELOG.read_text(encoding="utf-8"))
    # the parser must find the Renamed tables there are (0.4.0's, 0.3.0's): a version that
    # renames nothing, like 0.4.1 and 0.4.2, has none
    assert sum(bool(rename_rows(lines)) for _, _, lines in entries) >= 2, "no Renamed table found"
    renamed_later: set[str] = set()
    named_later: set[str] = set()
    problems = []
    for version, _, lines in entries:  # newest first
        rows = rename_rows(lines)
        for old, new in rows:
            for name in NAME.findall(new):
                if name not in renamed_later and not resolves(name):
                    problems.append(f"{version}: new name {name} does not resolve")
            if "still importable" not in new:
                for name in NAME.findall(old):
                    if name not in named_later and resolves(name):
                        problems.append(f"{version}: old name {name} still resolves")
        for name in removed_names(lines):
            if name not in named_later and resolves(name):
                problems.append(f"{version}: removed name {name} still resolves")
        renamed_later |= {n for old, _ in rows for n in NAME.findall(old)}
        named_later |= {n for _, new in rows for n in NAME.findall(new)}
    assert problems == [], problems
