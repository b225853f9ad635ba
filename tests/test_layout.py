"""The shape of the house: one idea per module, no import cycles, and a README that lists every module."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (ROOT / "kvlib").glob("*.py") if p.name != "__main__.py")


def imports(path: Path) -> set[str]:
    """The kvlib modules that ``path`` imports at run time (``if TYPE_CHECKING:`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        if node.module:
            out.add(node.module.split(".")[0])
        else:
            out.update(a.name for a in node.names)
    return out - {path.stem}


def test_no_import_cycles():
    graph = {p.stem: imports(p) for p in MODULES if p.stem != "__init__"}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph.get(m, ()):
            assert state.get(n) != "open", f"import cycle: {' -> '.join(stack + [m, n])}"
            if n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_the_cycle_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    assert imports(tmp_path / "a.py") == {"b"} and imports(tmp_path / "b.py") == set()


def test_every_module_stays_small():
    long = {p.name: n for p in MODULES if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"one concern per module, about 400 lines at most: {long}"


def test_the_readme_module_table_lists_exactly_the_modules():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `kvlib\.(\w+)` \|", readme, re.M))
    files = {p.stem for p in MODULES if p.stem != "__init__"}
    assert listed == files, f"in the README, not a file: {sorted(listed - files)}; a file, not in the README: {sorted(files - listed)}"
