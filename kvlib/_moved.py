"""The book's tooling under its old names, for one version: kvlib 0.5 moved it out, 0.6 drops these names.

==================  ==============  =============================================================
old (kvlib <= 0.4)  new (0.5)       what it is
==================  ==============  =============================================================
``kvlib.book``        ``kvbook``        figures, glue, tables, reader editions, the site's extensions
``kvlib.bench``       ``kvbench``       ``python -m kvbench``, the benchmark report, its stored run
``kvlib.crosscheck``  ``vllmcheck``     vLLM beside kvlib (``vllmcheck.distributed``: past one process)
``kvlib.presscheck``  ``kvpresscheck``  NVIDIA's kvpress beside `kvlib.press`
==================  ==============  =============================================================

They import kvlib, never the reverse. An old name still works (``import kvlib.book.plot``,
``from kvlib.book import glue``, ``python -m kvlib.bench``) and warns with a
``DeprecationWarning`` naming the new one. It gives the new module itself, not a second copy
(``kvlib.book.glue is kvbook.glue``): `Alias`, on ``sys.meta_path`` once kvlib is imported,
answers for the old names. Nothing here imports the tooling until an old name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import warnings
from pathlib import Path

MOVED = {"kvlib.book": "kvbook", "kvlib.bench": "kvbench", "kvlib.crosscheck": "vllmcheck",
         "kvlib.presscheck": "kvpresscheck"}
_HERE = Path(__file__).resolve().parent  # kvlib/: its own frames are not the caller's


def new_name(old: str) -> str | None:
    """Where an old module name lives now (``"kvlib.book.plot"`` -> ``"kvbook.plot"``), or None."""
    for prefix, new in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix):]
    return None


def warn(old: str, new: str) -> None:
    """The DeprecationWarning, reported at the line that used the old name (not inside the import system)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and ("importlib" in frame.f_code.co_filename
                                        or Path(frame.f_code.co_filename).resolve().parent == _HERE):
        frame = frame.f_back
    glob = frame.f_globals
    warnings.warn_explicit(
        f"{old} moved out of kvlib in 0.5: use {new} instead; the old name goes in kvlib 0.6",
        DeprecationWarning, frame.f_code.co_filename, frame.f_lineno, module=glob.get("__name__", "__main__"),
        registry=glob.setdefault("__warningregistry__", {}))


def run_as_main(old: str) -> None:
    """``python -m OLD``: warn, then run the new module as ``__main__`` (its arguments unchanged)."""
    new = new_name(old)
    warn(old.removesuffix(".__main__"), new.removesuffix(".__main__"))
    runpy.run_module(new, run_name="__main__", alter_sys=True)


class Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the new module object (`create_module` returns it as it is)."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        try:
            spec = importlib.util.find_spec(new)
        except ModuleNotFoundError:
            return None
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=spec.submodule_search_locations is not None)

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}  # a new module's own spec, by its name

    def create_module(self, spec):
        new = new_name(spec.name)
        warn(spec.name, new)
        module = importlib.import_module(new)
        self.specs[new] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """Nothing to run (the new module ran when `create_module` imported it), but the import system has just
        set the module's ``__spec__`` to the old name's: give it back its own."""
        module.__spec__ = self.specs[module.__name__]

    def get_code(self, fullname):
        """What ``python -m kvlib.bench`` runs: `run_as_main` on the old name."""
        return compile(f"import kvlib._moved\nkvlib._moved.run_as_main({fullname!r})\n", f"<{fullname}>", "exec")


def install() -> None:
    """Put one `Alias` first on ``sys.meta_path`` (before the path finder, which would load a second copy)."""
    if not any(isinstance(f, Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, Alias())
