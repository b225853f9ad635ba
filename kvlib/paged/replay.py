"""Replaying a pool trace: the pool rebuilt from a trace's events alone, and a trace checked against itself.

A trace (format ``kv-pool-trace/1``, written by `kvlib.paged.PoolTrace` for kvlib's engine and by
vllmcheck for vLLM) lists, step by step, what happened to the blocks and the pool after the step.
Replaying it is what a reader, or an explorer, does to watch the pool: start from an empty pool
(every block free, nothing cached) and apply each event:

* ``admit`` starts an empty table; ``hit`` appends blocks found in the prefix cache (sealed blocks,
  one more owner each); ``allocate`` appends free blocks (a sealed one is evicted first, an ``evict`` event);
* ``cow`` replaces a shared or sealed block by a private copy; ``fork`` gives a new sample a table
  sharing its parent's blocks;
* ``preempt`` and ``free`` drop a sequence's table, one owner less per block; ``seal`` marks a full
  block as a cached prefix (kept when freed, until evicted); ``evict`` unmarks it.

A block is *used* while it has an owner, *cached* while free and sealed, *free* otherwise. Events
of kinds this version does not know are ignored (a later version may add some).

* `replay`: the pool after each step (`PoolState`), checked against the step's recorded tables and
  counts; a `ValueError` names the step and event where the trace contradicts itself.
* `validate`: the structure of a trace read from JSON, then its replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMAT", "KINDS", "PoolState", "apply_event", "replay", "validate"]

#: The format a trace names in its ``"format"`` field; it changes when a field's meaning does.
FORMAT = "kv-pool-trace/1"
#: The event kinds this version replays, in the order a step's phases make them; others are ignored.
KINDS = ("admit", "hit", "allocate", "seal", "cow", "fork", "evict", "preempt", "free")


@dataclass
class PoolState:
    """The pool rebuilt from events: tables by sequence key, owners per block, sealed blocks."""

    tables: dict[str, list[int]]
    refcount: list[int]
    sealed: set[int]

    @property
    def counts(self) -> dict[str, int]:
        used = sum(1 for r in self.refcount if r > 0)
        cached = sum(1 for b, r in enumerate(self.refcount) if r == 0 and b in self.sealed)
        return {"used": used, "cached": cached, "free": len(self.refcount) - used}


def apply_event(state: PoolState, ev: dict, where: str) -> None:
    """One event on the rebuilt pool; ValueError (naming ``where``) if the pool contradicts it."""
    kind, seq, tables, rc = ev.get("kind"), ev.get("seq"), state.tables, state.refcount
    n = len(rc)

    def blocks(field: str = "blocks") -> list[int]:
        got = ev.get(field)
        got = [got] if field in ("from", "to") else got
        if not isinstance(got, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in got):
            raise ValueError(f"{where}: {kind!r} needs {field!r} as block ids, got {ev.get(field)!r}")
        bad = [b for b in got if not 0 <= b < n]
        if bad:
            raise ValueError(f"{where}: block {bad[0]} is outside the pool of {n} blocks (ids 0..{n - 1})")
        return got

    def held(key) -> list[int]:
        if key not in tables:
            raise ValueError(f"{where}: {kind!r} of sequence {key!r}, which holds no blocks (holding: {sorted(tables)})")
        return tables[key]

    def fresh(b: int) -> None:
        if rc[b] or b in state.sealed:
            what = f"has {rc[b]} owner(s)" if rc[b] else "is sealed (an 'evict' event must come first)"
            raise ValueError(f"{where}: block {b} is handed out by {kind!r} but {what}")
        rc[b] = 1

    if kind in ("admit", "fork"):
        if not isinstance(seq, str) or seq in tables:
            raise ValueError(f"{where}: {kind!r} of sequence {seq!r}, which already holds blocks or is not a key")
        tables[seq] = []
        if kind == "fork":
            if ev.get("parent") not in tables:
                raise ValueError(f"{where}: fork of {seq!r} from {ev.get('parent')!r}, which holds no blocks")
            for b in blocks():
                if rc[b] == 0:
                    raise ValueError(f"{where}: fork shares block {b}, which is free")
                rc[b] += 1
                tables[seq].append(b)
    elif kind == "hit":
        table = held(seq)
        for b in blocks():
            if b not in state.sealed:
                raise ValueError(f"{where}: prefix hit on block {b}, which is not sealed (not in the prefix cache)")
            rc[b] += 1
            table.append(b)
    elif kind == "allocate":
        table = held(seq)
        for b in blocks():
            fresh(b)
            table.append(b)
    elif kind == "cow":
        table, (old,), (new,) = held(seq), blocks("from"), blocks("to")
        if old not in table:
            raise ValueError(f"{where}: copy-on-write of block {old}, which is not in {seq!r}'s table {table}")
        fresh(new)
        rc[old] -= 1
        table[table.index(old)] = new
    elif kind in ("preempt", "free"):
        table = held(seq)
        if sorted(blocks()) != sorted(table):
            raise ValueError(f"{where}: {kind!r} of {seq!r} gives back {ev['blocks']} but its table is {table}")
        for b in table:
            rc[b] -= 1
        del tables[seq]
    elif kind == "seal":
        for b in blocks():
            if rc[b] == 0 or b in state.sealed:
                raise ValueError(f"{where}: seal of block {b}, which is {'free' if rc[b] == 0 else 'already sealed'}")
            state.sealed.add(b)
    elif kind == "evict":
        for b in blocks():
            if b not in state.sealed:
                raise ValueError(f"{where}: evict of block {b}, which holds no cached prefix")
            state.sealed.discard(b)
    # any other kind is a later version's: readers ignore it


def replay(trace: Any) -> Iterator[PoolState]:
    """The pool after each step, rebuilt from the events alone, starting from an empty pool.

    Checks every step as it goes: each event must fit the pool (no double allocation, no hit on an
    unsealed block, a freed table given back whole), and the rebuilt tables and counts must equal the
    step's recorded ``tables`` and ``counts``. A `ValueError` names the step, the event and what is wrong.
    """
    d = trace.to_dict() if hasattr(trace, "to_dict") else trace  # a PoolTrace, or its JSON object
    state = PoolState({}, [0] * d["num_blocks"], set())
    for i, step in enumerate(d["steps"]):
        for j, ev in enumerate(step["events"]):
            if not isinstance(ev, dict):
                raise ValueError(f"step {i}, event {j}: an event is an object with a 'kind', got {ev!r}")
            apply_event(state, ev, f"step {i}, event {j} ({ev.get('kind')!r})")
        if state.tables != step["tables"]:
            diff = sorted(k for k in set(state.tables) | set(step["tables"])
                          if state.tables.get(k) != step["tables"].get(k))
            raise ValueError(f"step {i}: the events rebuild tables that differ from the recorded ones for {diff}: "
                             f"rebuilt {[state.tables.get(k) for k in diff]}, recorded "
                             f"{[step['tables'].get(k) for k in diff]}")
        if state.counts != step["counts"]:
            raise ValueError(f"step {i}: the events rebuild counts {state.counts}, recorded {step['counts']}")
        yield PoolState({k: list(v) for k, v in state.tables.items()}, list(state.refcount), set(state.sealed))


# -- checking a trace read from a file -------------------------------------------------------------------------
def validate(d: Any) -> None:
    """Raise ValueError/TypeError naming the first thing wrong with a trace's structure or its replay."""
    if not isinstance(d, dict):
        raise TypeError(f"a pool trace is a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise ValueError(f"not a pool trace of this version: format is {d.get('format')!r}, expected {FORMAT!r}")
    for name in ("num_blocks", "block_size"):
        v = d.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name!r} must be a positive int, got {v!r}")
    if not isinstance(d.get("requests"), dict) or not isinstance(d.get("steps"), list):
        raise ValueError("a pool trace needs 'requests' (an object) and 'steps' (a list)")
    for i, step in enumerate(d["steps"]):
        if not isinstance(step, dict) or any(k not in step for k in ("events", "tables", "lengths", "counts")):
            raise ValueError(f"step {i} needs 'events', 'tables', 'lengths' and 'counts'")
        if step.get("step") != i:
            raise ValueError(f"step {i} is numbered {step.get('step')!r}: steps are numbered from 0, in order")
        tables, lengths, counts = step["tables"], step["lengths"], step["counts"]
        if set(tables) != set(lengths):
            raise ValueError(f"step {i}: 'tables' name {sorted(tables)} but 'lengths' name {sorted(lengths)}")
        unknown = sorted(set(tables) - set(d["requests"]))
        if unknown:
            raise ValueError(f"step {i}: tables of sequences {unknown} that 'requests' does not list")
        for key, n in lengths.items():
            if not isinstance(n, int) or n < 0 or -(-n // d["block_size"]) > len(tables[key]):
                raise ValueError(f"step {i}: sequence {key!r} has length {n!r} but {len(tables[key])} blocks of "
                                 f"{d['block_size']}")
        if not isinstance(counts, dict) or counts.get("used", -1) + counts.get("free", -1) != d["num_blocks"] \
                or not 0 <= counts.get("cached", -1) <= counts.get("free", -1):
            raise ValueError(f"step {i}: counts {counts} must have used + free = num_blocks = {d['num_blocks']} "
                             "and 0 <= cached <= free")
    for _ in replay(d):
        pass
