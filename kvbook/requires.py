"""A cell that needs a newer library than the reader has: it says so and skips itself.

kvlib itself runs at the floors in pyproject.toml (transformers 4.56, for one), but a few
cells of the book show a feature of a later release, such as chapter 8's HF
``QuantizedCache("fp8")`` (transformers 5.21). On an older install that cell should not stop the notebook
with a traceback from deep inside transformers; it should say what it needs::

    %%requires transformers>=5.21
    hf_cache = transformers.QuantizedCache(...)   # runs only where the version allows

prints, on transformers 4.56,

    Skipped: this cell needs transformers>=5.21 (this runtime has 4.56.0).
    `pip install -U "transformers>=5.21"`, restart the kernel and run it again.

and the notebook goes on. Where the versions allow, the cell runs as if the first line
were not there, and an exception in it is raised as usual (a test still sees it).

`requires` is the same check as a function, for a script or a loop.
"""

from __future__ import annotations

import re
from importlib import metadata

_SPEC = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9]+(?:\.[0-9]+)*)\s*$")


def release(version: str) -> tuple[tuple[int, ...], bool]:
    """``"4.56.0"`` -> ``((4, 56), True)``: the release numbers without trailing zeros, and
    whether it is a final release. ``"5.0.0rc1"`` -> ``((5,), False)`` sorts below
    ``"5.0"``, and a local label (``"2.13.0+cpu"``) is ignored, as pip orders them."""
    m = re.match(r"\s*v?([0-9]+(?:\.[0-9]+)*)(.*)", version)
    if m is None:
        raise ValueError(f"not a version number: {version!r}")
    numbers = [int(n) for n in m.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    rest = m.group(2).split("+", 1)[0].lstrip(".-_").lower()
    final = rest == "" or rest.startswith("post")
    return tuple(numbers), final


def _parse(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str):
        raise TypeError(f"a requirement is a string like 'transformers>=5.0', got {spec!r}")
    m = _SPEC.match(spec)
    if m is None:
        raise ValueError(f"a requirement reads 'name>=version' (like 'transformers>=5.0'), got {spec!r}")
    return m.group(1), m.group(2)


def missing(*specs: str) -> list[str]:
    """The requirements of ``specs`` (``"name>=version"``) this runtime does not meet, as
    sentences: ``["transformers>=5.0 (this runtime has 4.56.0)"]``; empty when all hold.

    A package that is not installed at all counts as missing. Every spec is parsed before
    any is checked, so a malformed one raises (``ValueError``/``TypeError``) whatever is
    installed.
    """
    parsed = [(*_parse(spec), spec.strip()) for spec in specs]
    if not parsed:
        raise ValueError("requires() needs at least one 'name>=version'")
    out = []
    for name, want, spec in parsed:
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{spec} (this runtime does not have {name})")
            continue
        if release(have) < release(want):
            out.append(f"{spec} (this runtime has {have})")
    return out


def requires(*specs: str) -> bool:
    """True if every ``"name>=version"`` holds here; otherwise print what is needed and how
    to get it, and return False: ``if requires("transformers>=5.0"): ...``."""
    lacking = missing(*specs)
    if lacking:
        print(f"Skipped: this cell needs {', '.join(lacking)}.")
        wanted = " ".join(f'"{s.strip()}"' for s in specs)
        print(f"`pip install -U {wanted}`, restart the kernel and run it again.")
    return not lacking


def register_magic() -> None:
    """Register ``%%requires`` in the running IPython; outside IPython, do nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def _requires(line: str, cell: str) -> None:
        if not requires(*line.split()):
            return
        result = shell.run_cell(cell, store_history=False)
        result.raise_error()  # an error in the cell fails the cell, as without the magic

    shell.register_magic_function(_requires, magic_kind="cell", magic_name="requires")
