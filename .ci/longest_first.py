"""Order the portable run's notebooks longest first, from this run's own book build.

    python .ci/longest_first.py JUPYTER_CACHE FILE ...

prints the FILEs, one a line: the reader editions (reader/NAME.ipynb) by how long the book build, minutes
before, took to execute book/NAME.ipynb (jupyter-cache keeps each notebook's ``execution_seconds``), longest
first; then the rest (test files, and any notebook the cache does not know) in the order given.

Why: pytest-xdist hands each worker whole files, by default the files with the most tests (here, cells)
first, which is not the same as the longest. With ``--no-loadscope-reorder`` it takes them in the order given,
and longest first leaves the shortest chapters for the end, where one worker may wait on the other. Measured on
2026-12-04: the 1-thread pass took 317 s against 324 s before, a small gain. Which chapters run at which thread
count does not change: only their order within a pass.
"""

from __future__ import annotations

import sys
from pathlib import Path


def build_seconds(cache_dir: str) -> dict[str, float]:
    """Each executed notebook's seconds in the book build, by file name (newest record wins)."""
    try:
        from jupyter_cache import get_cache
    except ImportError:  # not the book's environment: no order to go by
        return {}
    if not Path(cache_dir).is_dir():
        return {}
    records = sorted(get_cache(cache_dir).list_cache_records(), key=lambda r: r.created)
    return {Path(r.uri).name: r.data["execution_seconds"] for r in records if "execution_seconds" in r.data}


def longest_first(files: list[str], seconds: dict[str, float]) -> list[str]:
    known = [f for f in files if f.endswith(".ipynb") and Path(f).name in seconds]
    rest = [f for f in files if f not in known]
    return sorted(known, key=lambda f: -seconds[Path(f).name]) + rest


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print("\n".join(longest_first(sys.argv[2:], build_seconds(sys.argv[1]))))
