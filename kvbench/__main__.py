"""``python -m kvbench``: run the benchmark report (`kvbench.cli.main`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
