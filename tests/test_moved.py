"""kvlib and the book's tooling beside it (issue 45): `import kvlib` stays light, and the old names still work.

kvlib 0.5 moved `kvlib.book` to `kvbook`, `kvlib.bench` to `kvbench`, `kvlib.crosscheck` to `vllmcheck` and
`kvlib.presscheck` to `kvpresscheck`. The tooling imports kvlib, never the reverse: a fresh ``import kvlib``, or
every kvlib module imported one by one, loads none of it and no matplotlib. The old names work for one version
(`kvlib._moved`): each warns with a DeprecationWarning naming the new path and gives the new module itself.
"""

import importlib
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvlib
from kvlib import _moved

ROOT = Path(__file__).resolve().parents[1]
TOOLING = ("kvbook", "kvbench", "vllmcheck", "kvpresscheck")
HEAVY = TOOLING + ("matplotlib", "ipywidgets")
pytestmark = [pytest.mark.cpu_only("about the repository (layout, versions, CI, docstrings), not kvlib on a device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # each test asks for the one it expects


def fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that imports this checkout's kvlib."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


LOADED = f"import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"


def test_import_kvlib_loads_no_tooling_and_no_matplotlib():
    out = fresh("import kvlib\n" + LOADED)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"`import kvlib` loaded {out.stdout.strip()}"


def test_every_kvlib_module_imported_loads_no_tooling_and_no_matplotlib():
    """Touch every kvlib submodule (``__main__`` aside: it runs the chat): still none of the tooling."""
    out = fresh("import importlib, pkgutil, kvlib\n"
                "for m in pkgutil.walk_packages(kvlib.__path__, 'kvlib.'):\n"
                "    if not m.name.endswith('__main__'):\n"
                "        importlib.import_module(m.name)\n"
                "for name in dir(kvlib):\n"
                "    getattr(kvlib, name)\n" + LOADED)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"kvlib's modules loaded {out.stdout.strip()}"


def test_dir_kvlib_lists_no_tooling():
    out = fresh("import kvlib; print(sorted(set(dir(kvlib)) & {'book', 'bench', 'crosscheck', 'presscheck'}))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_kvlib_module_imports_the_tooling_or_matplotlib():
    """The tooling imports kvlib, never the reverse (kvlib._moved names it in strings, for the old names)."""
    import ast

    bad = []
    for path in sorted((ROOT / "kvlib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not bad, bad


# -- the old names, for one version --------------------------------------------------------------------
def forget_old_names():
    """Drop what a previous test's old name left (sys.modules entries, kvlib attributes): each test sees a
    first use. The new modules stay loaded: an old name must give those very objects."""
    for name in [m for m in sys.modules if _moved.new_name(m)]:
        del sys.modules[name]
    for short in ("book", "bench", "crosscheck", "presscheck"):
        kvlib.__dict__.pop(short, None)


@pytest.fixture(autouse=True)
def _clean():
    forget_old_names()
    yield
    forget_old_names()


def submodules() -> list[str]:
    out = []
    for top in TOOLING:
        pkg = importlib.import_module(top)
        out += [top] + [m.name for m in pkgutil.iter_modules(pkg.__path__, f"{top}.") if m.name != f"{top}.__main__"]
    return out


OLD = {new: old for old, new in _moved.MOVED.items()}


def old_name(new: str) -> str:
    top, _, rest = new.partition(".")
    return OLD[top] + ("." + rest if rest else "")


@pytest.mark.parametrize("new", submodules())
def test_an_old_module_name_warns_and_is_the_new_module(new):
    module = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=rf"{old_name(new)} moved .* use {new} instead.*kvlib 0\.6"):
        old = importlib.import_module(old_name(new))
    assert old is module and sys.modules[old_name(new)] is module  # no second copy
    assert module.__name__ == new and module.__spec__.name == new  # the module keeps its own name and spec


def test_the_import_statements_of_old_chapters_still_work():
    import kvbook
    import kvbook.plot

    with pytest.warns(DeprecationWarning, match="use kvbook.plot instead"):
        import kvlib.book.plot  # noqa: F401
    assert kvlib.book is kvbook and kvlib.book.plot is kvbook.plot
    forget_old_names()
    ns = {}
    with pytest.warns(DeprecationWarning, match="use kvbook instead"):
        exec("from kvlib.book import glue, setup, table", ns)
    assert (ns["glue"], ns["setup"], ns["table"]) == (kvbook.glue, kvbook.setup, kvbook.table)
    forget_old_names()
    with pytest.warns(DeprecationWarning, match="use vllmcheck instead"):
        exec("from kvlib import crosscheck", ns)
    import vllmcheck

    assert ns["crosscheck"] is vllmcheck


def test_kvlib_dot_book_after_import_kvlib_warns_at_the_callers_line():
    """``import kvlib`` then ``kvlib.book.setup()``, as every chapter did: the warning points at that line (so
    Jupyter shows it), not into the import system."""
    import kvbook

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        book = kvlib.book  # the line the warning must name
    assert book is kvbook
    (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert w.filename == __file__ and "use kvbook instead" in str(w.message)


def test_an_old_name_that_never_existed_is_still_an_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvlib.book.nothing_here")
    with pytest.raises(AttributeError):
        kvlib.nothing_here  # noqa: B018


def test_bench_record_moved_to_kvbench_load_record():
    import kvbench

    with pytest.warns(DeprecationWarning, match="use kvbench.load_record instead"):
        old = kvlib.data.bench_record()
    assert old == kvbench.load_record()


@pytest.mark.parametrize("old, new", [("kvlib.bench", "kvbench"), ("kvlib.crosscheck", "vllmcheck"),
                                      ("kvlib.crosscheck.distributed", "vllmcheck.distributed"),
                                      ("kvlib.presscheck", "kvpresscheck"), ("kvlib.book.apiref", "kvbook.apiref")])
def test_python_dash_m_with_an_old_name_runs_the_new_one(old, new):
    """``python -m kvlib.bench`` runs ``python -m kvbench`` (its own usage line) and says so on stderr."""
    out = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert f"python -m {new}" in out.stdout, out.stdout  # argparse's prog: the new module ran
    assert "DeprecationWarning" in out.stderr and f"use {new} instead" in out.stderr, out.stderr
