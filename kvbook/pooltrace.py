"""Reading a trace of the paged pool: load it, check it, and say what the pool held at a step.

A trace (format ``kv-pool-trace/1``, described in `kvlib.paged`'s recorder and in the
book's back matter) is one JSON object per run of a paged serving engine: the pool's size,
the requests, and for each scheduler step the block events in order (``admit``, ``hit``,
``allocate``, ``seal``, ``cow``, ``fork``, ``evict``, ``preempt``, ``free``) and the state after it:
every sequence's block table, its length in tokens, and the counts of used, cached and free
blocks. kvlib's engine writes one, and so does the vLLM side of the cross-check.

The explorers (`kvbook.pool` in a notebook, ``js/pool-explorer.js`` on the website) show
a trace a reader may have recorded, edited or truncated, so `check_trace` reads it field by
field and names the first thing wrong (`check_trace`), and `state_at` is the one reading both draw::

    >>> import vllmcheck
    >>> from kvbook.pooltrace import load, state_at
    >>> t = load(vllmcheck.load_traces()["kvlib"])  # chapter 12's requests, in kvlib's engine
    >>> s = state_at(t, 27)  # the step that preempted request-3
    >>> s["tables"], s["counts"], s["cached_blocks"]
    ({'request-0': [0, 6], 'request-1': [1, 4], 'request-2': [2, 5]}, {'used': 6, 'cached': 1, 'free': 1}, [3])

The JavaScript mirrors `check_trace` and `state_at` (same rules, same messages); the browser test
compares the two on the same traces.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "kv-pool-trace/1"
COUNTS = ("used", "cached", "free")
# The fields each event kind carries beyond "kind" (unknown kinds are skipped, as the format says).
EVENT_FIELDS = {"admit": ("seq",), "hit": ("seq", "blocks"), "allocate": ("seq", "blocks"),
                "seal": ("blocks",), "cow": ("seq", "from", "to"), "fork": ("seq", "parent", "blocks"),
                "evict": ("blocks",),
                "preempt": ("seq", "blocks"), "free": ("seq", "blocks")}


def load(trace) -> dict:
    """A checked trace from a dict, a recorder (anything with ``to_dict()``, such as
    `kvlib.paged.PoolTrace`), or the path of a JSON file (`check_trace` says what is wrong)."""
    if hasattr(trace, "to_dict"):
        trace = trace.to_dict()
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        if not path.is_file():
            raise ValueError(f"no trace file at {path}: give the path of a JSON file a recorder wrote")
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    return check_trace(trace)


def _show(x) -> str:
    """A value as the message quotes it: compact JSON, as JavaScript's JSON.stringify writes it."""
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)[:60]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(where: str, x, low: int = 0) -> int:
    if not _is_int(x):
        raise TypeError(f"{where} must be an integer, got {_show(x)}")
    if x < low:
        raise ValueError(f"{where} must be at least {low}, got {x}")
    return x


def _field(obj: dict, key: str, where: str):
    if key not in obj:
        raise ValueError(f"{where} has no {_show(key)} field")
    return obj[key]


def _block(where: str, b, n: int) -> int:
    _int(where, b)
    if b >= n:
        raise IndexError(f"{where} is block {b}, but the pool has blocks 0 to {n - 1} (num_blocks {n})")
    return b


def _blocks(where: str, blocks, n: int) -> list:
    if not isinstance(blocks, list):
        raise TypeError(f"{where} must be a list of block ids, got {_show(blocks)}")
    return [_block(f"{where}[{i}]", b, n) for i, b in enumerate(blocks)]


def _seq(where: str, seq, requests: dict) -> str:
    """A sequence key the trace's requests list (``"3"``, or ``"3.1"`` for a sample of request 3)."""
    if not isinstance(seq, str) or seq not in requests:
        raise ValueError(f"{where} names sequence {_show(seq)}, which is not among the requests "
                         f"({', '.join(sorted(requests, key=seq_key)) or 'none'})")
    return seq


def _object(where: str, x) -> dict:
    if not isinstance(x, dict):
        raise TypeError(f"{where} must be an object, got {_show(x)}")
    return x


def _check_event(where: str, e, n: int, requests: dict) -> None:
    _object(where, e)
    kind = _field(e, "kind", where)
    if not isinstance(kind, str):
        raise TypeError(f"{where}.kind must be a string, got {_show(kind)}")
    for key in EVENT_FIELDS.get(kind, ()):  # an unknown kind is skipped: the format's forward compatibility
        v = _field(e, key, f"{where} ({kind})")
        if key in ("seq", "parent"):
            _seq(f"{where}.{key}", v, requests)
        elif key == "blocks":
            _blocks(f"{where}.blocks", v, n)
        else:
            _block(f"{where}.{key}", v, n)


def _check_step(where: str, s: dict, n: int, size: int, requests: dict) -> None:
    events = _field(s, "events", where)
    if not isinstance(events, list):
        raise TypeError(f"{where}.events must be a list, got {_show(events)}")
    for i, e in enumerate(events):
        _check_event(f"{where}.events[{i}]", e, n, requests)
    tables = _object(f"{where}.tables", _field(s, "tables", where))
    lengths = _object(f"{where}.lengths", _field(s, "lengths", where))
    for seq, table in tables.items():
        _seq(f"{where}.tables", seq, requests)
        _blocks(f"{where}.tables[{seq}]", table, n)
    if set(lengths) != set(tables):
        odd = sorted(set(lengths) ^ set(tables))
        raise ValueError(f"{where}: lengths and tables must name the same sequences; "
                         f"only one of them names {', '.join(odd)}")
    for seq, length in lengths.items():
        _int(f"{where}.lengths[{seq}]", length)
        if length > len(tables[seq]) * size:
            raise ValueError(f"{where}.lengths[{seq}] is {length} tokens, more than its "
                             f"{len(tables[seq])} blocks of {size} hold")
    counts = _object(f"{where}.counts", _field(s, "counts", where))
    c = {k: _int(f"{where}.counts.{k}", _field(counts, k, f"{where}.counts")) for k in COUNTS}
    if c["used"] + c["free"] != n:
        raise ValueError(f"{where}.counts: used {c['used']} + free {c['free']} must be num_blocks {n}")
    if c["cached"] > c["free"]:
        raise ValueError(f"{where}.counts: cached {c['cached']} must be at most free {c['free']} "
                         "(cached blocks are free blocks that still hold a prefix)")
    held = len({b for table in tables.values() for b in table})
    if held != c["used"]:
        raise ValueError(f"{where}.counts: used is {c['used']}, but the tables hold {held} distinct blocks")


def check_trace(trace) -> dict:
    """``trace`` itself if it follows the format, else a ValueError, TypeError or IndexError
    naming the first field that does not (a wrong ``format``, a block id out of range, a table
    naming an unknown sequence, counts that do not add up...)."""
    t = _object("the trace", trace)
    fmt = _field(t, "format", "the trace")
    if fmt != FORMAT:
        raise ValueError(f"the trace's format is {_show(fmt)}; this explorer reads {_show(FORMAT)}")
    n = _int("num_blocks", _field(t, "num_blocks", "the trace"), 1)
    size = _int("block_size", _field(t, "block_size", "the trace"), 1)
    requests = _object("requests", _field(t, "requests", "the trace"))
    steps = _field(t, "steps", "the trace")
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"steps must be a non-empty list, got {_show(steps)}")
    last = -1
    for i, s in enumerate(steps):
        where = f"steps[{i}]"
        number = _int(f"{where}.step", _field(_object(where, s), "step", where))
        if number <= last:
            raise ValueError(f"{where}.step is {number}, not after the step before it ({last})")
        last = number
        _check_step(where, s, n, size, requests)
    return trace


def seq_key(seq: str) -> tuple:
    """The order sequences are listed in: by request id, then sample (numbers as numbers)."""
    return tuple((0, int(p), "") if p.isascii() and p.isdigit() else (1, 0, p) for p in seq.split("."))


def step_range(*traces: dict) -> tuple[int, int]:
    """The first and last step of any of the traces: the explorer's slider runs over them."""
    return (min(t["steps"][0]["step"] for t in traces), max(t["steps"][-1]["step"] for t in traces))


def state_at(trace: dict, step: int) -> dict:
    """What the pool held after ``step``: the last recorded step at or before it (``at``; None
    before the first, an empty pool), its ``events`` if it is that very step, its ``tables``,
    ``lengths`` and ``counts`` (the tables in `seq_key` order); and per block, its ``owners`` (the sequences whose tables hold
    it), ``fill`` (the most tokens any owner keeps in it) and whether it is ``cached``: free,
    and sealed by a ``seal`` event with no ``evict`` since (the format evicts a sealed block
    before an ``allocate`` or a ``cow`` hands it out again). ``cached_blocks`` may differ from ``counts["cached"]``
    where a trace's events miss something (its ``missing`` says what): the counts are the
    engine's, the blocks a replay of its events."""
    n, size = trace["num_blocks"], trace["block_size"]
    sealed: set[int] = set()
    current = None
    for s in trace["steps"]:
        if s["step"] > step:
            break
        current = s
        for e in s["events"]:
            kind = e.get("kind")
            if kind == "seal":
                sealed.update(e["blocks"])
            elif kind == "evict":  # a sealed block is evicted before it is handed out again
                sealed.difference_update(e["blocks"])
    if current is None:
        tables, lengths, counts, events = {}, {}, {"used": 0, "cached": 0, "free": n}, []
    else:
        tables = {seq: current["tables"][seq] for seq in sorted(current["tables"], key=seq_key)}
        lengths, counts = current["lengths"], current["counts"]
        events = current["events"] if current["step"] == step else []
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    for seq, table in tables.items():
        for j, b in enumerate(table):
            owners.setdefault(b, []).append(seq)
            fill[b] = max(fill.get(b, 0), min(size, max(0, lengths[seq] - j * size)))
    cached = sorted(b for b in sealed if b not in owners)
    return {"step": step, "at": None if current is None else current["step"], "events": events,
            "tables": tables, "lengths": lengths, "counts": counts, "owners": owners, "fill": fill,
            "cached_blocks": cached}
