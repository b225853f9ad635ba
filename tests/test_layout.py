"""The shape of the house: one idea per module, no import cycles, and a README that lists every module.

kvlib is a package of modules and of subpackages (`kvlib.cache`, `kvlib.paged`, `kvlib.distributed`);
each check walks them all. (The book's tooling beside it, `kvbook`, `kvbench`, `vllmcheck` and
`kvpresscheck`, is not kvlib: tests/test_moved.py keeps the two apart.) A module is named by its dotted path under kvlib
(``paged.cache``); a package by its folder (``paged``), standing for its ``__init__.py``.
"""

import ast
import re
from pathlib import Path
import pytest

pytestmark = pytest.mark.cpu_only("about the repository (layout, versions, CI, docstrings), not kvlib on a device")

ROOT = Path(__file__).resolve().parents[1]
KVLIB = ROOT / "kvlib"


def module_name(path: Path) -> str:
    """``kvlib/paged/cache.py`` -> ``"paged.cache"``; ``kvlib/paged/__init__.py`` -> ``"paged"``."""
    parts = list(path.relative_to(KVLIB).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = sorted(p for p in KVLIB.rglob("*.py") if p.name != "__main__.py" and "data" not in p.parts)
NAMES = {module_name(p): p for p in MODULES if p != KVLIB / "__init__.py"}


def imports(path: Path, known: set[str] | None = None) -> set[str]:
    """The kvlib modules that ``path`` imports at run time (``if TYPE_CHECKING:`` blocks excluded),
    by dotted name: ``from ..cache import Cache`` in ``paged/batch.py`` is ``"cache"``."""
    known = set(NAMES) if known is None else known
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    me = module_name(path).split(".") if path.name != "__init__.py" or path.parent != KVLIB else []
    package = me if path.name == "__init__.py" else me[:-1]  # where a level-1 import starts
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        target = base + (node.module.split(".") if node.module else [])
        names = [".".join(target + [a.name]) for a in node.names] if not node.module else []
        for cand in names + [".".join(target)]:
            while cand and cand not in known:
                cand = cand.rpartition(".")[0]
            if cand:
                out.add(cand)
    return out - {module_name(path)}


def test_no_import_cycles():
    graph = {name: imports(path) for name, path in NAMES.items()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph.get(m, ()):
            if n == m or (m.startswith(n + ".") and NAMES[n].name == "__init__.py"):
                continue  # a submodule importing from its own package's other modules goes through them
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
    global KVLIB
    old, KVLIB = KVLIB, tmp_path
    try:
        assert imports(tmp_path / "a.py", {"a", "b"}) == {"b"} and imports(tmp_path / "b.py", {"a", "b"}) == set()
    finally:
        KVLIB = old


def test_relative_imports_resolve_inside_subpackages():
    assert "cache" in imports(KVLIB / "paged" / "batch.py")  # from ..cache import Cache
    assert "paged.blocks" in imports(KVLIB / "paged" / "cache.py")  # from .blocks import ...
    assert {"paged.batch", "paged.blocks", "paged.cache", "paged.kernel"} <= imports(KVLIB / "paged" / "__init__.py")


def test_every_module_stays_small():
    long = {name: n for name, p in NAMES.items() if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"one concern per module, about 400 lines at most (a larger one becomes a package): {long}"


def test_the_readme_module_table_lists_exactly_the_modules():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `kvlib\.([\w.]+)` \|", readme, re.M))
    modules = {n for n, p in NAMES.items() if p.name != "__init__.py"}
    packages = {n for n, p in NAMES.items() if p.name == "__init__.py"}
    assert modules <= listed, f"a module, not in the README: {sorted(modules - listed)}"
    assert listed <= modules | packages, f"in the README, not a module: {sorted(listed - modules - packages)}"
    assert packages <= listed, f"a package, not in the README: {sorted(packages - listed)}"


TOOLING = ("kvbook", "kvbench", "vllmcheck", "kvpresscheck")  # beside kvlib, in the same wheel


def test_pyproject_installs_every_subpackage():
    """A plain (non-editable) install, as in Colab, must carry kvlib.cache, kvlib.paged, ..., and the tooling
    beside kvlib (the chapters import kvbook) with the records each reads from its data/."""
    import tomllib

    from setuptools import find_packages

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {"kvlib"} | {f"kvlib.{n}" for n, p in NAMES.items() if p.name == "__init__.py"} | set(TOOLING)
    packages |= {".".join(p.parent.relative_to(ROOT).parts) for top in TOOLING  # their subpackages too (kvbook.knobs)
                 for p in (ROOT / top).rglob("__init__.py")}
    assert len(packages) >= 8 and packages <= set(find_packages(ROOT, include=tool["packages"]["find"]["include"]))
    for top in ("kvlib",) + TOOLING:
        shipped = {p for pattern in tool["package-data"].get(top, []) for p in (ROOT / top).glob(pattern)}
        assert set((ROOT / top / "data").glob("*")) <= shipped, f"{top}/data/ is not all in package-data"
