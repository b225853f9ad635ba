"""A cell's numbers as a small aligned table: ``kvbook.table(rows)``.

A chapter measures a few things under a few settings and prints them. Aligning the columns by
hand takes a header line of padded labels and a row line of format specifiers for every
table, and a learner reading the cell reads that formatting instead of the measurement. So
a cell collects its rows, one dict per setting, and hands them over::

    rows = []
    for n in (128, 1024):
        rows.append({"context": n, "MB": kv_bytes(n) / 1e6, "share": n / 2048})
    kvbook.table(rows, formats={"share": ".0%"})

prints ::

    context     MB  share
        128   4.72     6%
      1,024  37.75    50%

Each column takes its width from its widest cell. Numbers are right-aligned: an int with
thousands separators, a float with ``digits`` decimals (2 unless told), or in ``e`` notation
where those decimals would print a non-zero value as zero. Text is left-aligned; ``None``
prints as an empty cell. ``formats`` gives a column its own format spec (``".1%"``,
``".3e"``, ``","``), and a one-element tensor or a numpy scalar prints as its number.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence


def table(rows: Sequence[Mapping[str, object]] | Mapping[str, Sequence[object]], *,
          digits: int = 2, formats: Mapping[str, str] | None = None) -> None:
    """Print ``rows`` as an aligned table, columns in the order of the first row's keys.

    ``rows`` is a list of dicts with the same keys (one dict a row), or a dict of equally long
    columns (``{"context": [128, 1024], "MB": [4.7, 37.7]}``). Returns ``None``, so a cell
    ending with it shows only the table. A row with other keys, columns of other lengths, no
    rows at all, a format for a column that is not there, or a value its format cannot
    print raise ``ValueError`` naming them; ``digits`` must be an int from 0 to 12.
    """
    print(render(rows, digits=digits, formats=formats))


def render(rows: Sequence[Mapping[str, object]] | Mapping[str, Sequence[object]], *,
           digits: int = 2, formats: Mapping[str, str] | None = None) -> str:
    """The text `table` prints, without printing it."""
    if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= 12:
        raise ValueError(f"digits must be an int from 0 to 12, got {digits!r}")
    columns, body = _as_rows(rows)
    formats = dict(formats or {})
    unknown = [name for name in formats if name not in columns]
    if unknown:
        raise ValueError(f"formats names {unknown}, which are not columns; the columns are {columns}")
    cells = [[_cell(row[name], name, formats.get(name), digits) for name in columns] for row in body]
    right = [all(isinstance(_number(row[name]), numbers.Number) or row[name] is None for row in body)
             for name in columns]  # a column of numbers is right-aligned, its label too
    widths = [max(len(str(name)), *(len(r[i]) for r in cells)) for i, name in enumerate(columns)]
    lines = []
    for r in [[str(name) for name in columns], *cells]:
        padded = [c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _as_rows(rows: object) -> tuple[list[str], list[Mapping[str, object]]]:
    """The column names and the rows, from a list of dicts or a dict of columns."""
    if isinstance(rows, Mapping):
        lengths = {name: len(col) for name, col in rows.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the columns have different lengths: {lengths}; give each column one "
                             "value a row")
        n = next(iter(lengths.values()), 0)
        rows = [{name: col[i] for name, col in rows.items()} for i in range(n)]
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(f"rows must be a list of dicts or a dict of columns, got {type(rows).__name__}")
    if not rows:
        raise ValueError("a table needs at least one row, got none")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"row {i} is a {type(row).__name__}, not a dict of column -> value")
    columns = list(rows[0])
    for i, row in enumerate(rows):
        if list(row) != columns:
            raise ValueError(f"row {i} has the columns {list(row)}, row 0 has {columns}: give every "
                             "row the same keys in the same order")
    return columns, list(rows)


def _number(value: object) -> object:
    """A one-element tensor or a numpy scalar as its Python number; anything else unchanged."""
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        return value
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", None)
    if callable(item) and shape is not None and tuple(shape) in ((), (1,)):
        return item()
    return value


def _cell(value: object, column: str, spec: str | None, digits: int) -> str:
    """One value's text: its column's format if it has one, else the default for its kind."""
    value = _number(value)
    if value is None:
        return ""
    if spec is not None:
        try:
            return format(value, spec)
        except (TypeError, ValueError) as err:
            raise ValueError(f"column {column!r}: format {spec!r} cannot print {value!r} ({err})") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    value = float(value)
    if value != 0 and abs(value) < 0.5 * 10.0 ** -digits:  # would print as 0.00: show its size
        return f"{value:.{max(digits - 1, 1)}e}"
    return f"{value:,.{digits}f}"
