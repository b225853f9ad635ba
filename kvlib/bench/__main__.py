"""``python -m kvlib.bench``: run the benchmark report (`kvlib.bench.cli.main`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
