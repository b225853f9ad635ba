"""A trace of the paged pool: every block event of an engine's run, step by step, in one small JSON format.

A serving engine's pool is easiest to understand by watching it. `PoolTrace` records, for each
``Engine.step()``, what happened to the blocks (a request admitted, its prefix-cache *hits*, blocks
*allocated*, a block *sealed* once full, a shared block copied on write, a cached block *evicted* for
reuse, a fork's shared table, a *preempted* or *finished* sequence giving its blocks back) and the
state after the step: every sequence's block table, its length in tokens, and the counts of used,
cached and free blocks. The format, ``kv-pool-trace/1``, is the same for kvlib and for vLLM
(vllmcheck writes vLLM's), so two engines can be replayed side by side: block ids are each engine's
own, while counts and table lengths can be compared.

Record a run by handing a trace to the engine, then save it::

    trace = PoolTrace()
    engine = kvlib.Engine(model, cache, trace=trace)   # a fresh pool: the trace starts empty
    ...; engine.run()
    trace.save("pool.json")                            # PoolTrace.load("pool.json") reads it back

The trace observes the pool from outside: the engine calls it at the edges of a step's phases
(before, after scheduling, after the commit, at the end), and it diffs snapshots of the pool
(tables, lengths, reference counts, sealed blocks and each block's *generation*, bumped each time
the allocator hands it out afresh) into events. Each step's events are checked by replaying them
(`kvlib.paged.replay`) before the step is stored, so a trace that loads is one whose events rebuild its tables.

* `PoolTrace`: the recorder, and the trace itself (``steps``, ``requests``, ``to_dict``, ``save``,
  ``load``, ``from_dict``).
* `seq_key`: a sequence's key in a trace ("3", or "3.1" for a sample of an n > 1 request).

Replaying a trace (rebuilding the pool from its events) is `kvlib.paged.replay`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .replay import FORMAT, PoolState, apply_event, validate

if TYPE_CHECKING:
    from ..engine import Engine, StepPlan

__all__ = ["PoolTrace", "seq_key"]


@dataclass
class _Snapshot:
    """The pool as the trace sees it at one moment (sequence ids are the cache's)."""

    tables: dict[int, list[int]]
    lengths: dict[int, int]
    refcount: list[int]
    generation: list[int]
    sealed: set[int]

    @classmethod
    def of(cls, cache) -> "_Snapshot":
        a = cache.allocator
        return cls({sid: cache.block_table(sid) for sid in cache.seqs}, {sid: cache.num_tokens(sid) for sid in cache.seqs},
                   list(a.refcount), list(a.generation), {b for b in range(a.num_blocks) if a.is_sealed(b)})

    def same_as(self, other: "_Snapshot") -> bool:
        return (self.tables, self.lengths, self.refcount, self.sealed) == (other.tables, other.lengths, other.refcount,
                                                                          other.sealed)


def seq_key(seq) -> str:
    """A sequence's key in a trace: its request id, and ``".i"`` for sample ``i`` of an n > 1 request."""
    return str(seq.request.rid) if seq.request.n == 1 else f"{seq.request.rid}.{seq.index}"


# -- the recorder ---------------------------------------------------------------------------------------------
class PoolTrace:
    """Every block event of an engine's run, and the pool after each step (format ``kv-pool-trace/1``).

    Hand one to a fresh engine, ``Engine(model, cache, trace=PoolTrace())``, and each ``step()``
    appends a step: ``{"step", "events", "tables", "lengths", "counts"}`` (see the module docstring and
    the format's description in the book). A trace records one engine, from its first step.
    ``load``/``from_dict`` read a trace back and check it (structure and replay).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> trace = kvlib.paged.PoolTrace()
    >>> engine = kvlib.Engine(model, kvlib.PagedCache.for_model(model, 8, block_size=4), trace=trace)
    >>> rid = engine.add([1, 2, 3, 4, 5], max_new_tokens=2)
    >>> engine.step().num_tokens  # the prompt, in one step
    5
    >>> [e["kind"] for e in trace.steps[0]["events"]], trace.steps[0]["tables"]
    (['admit', 'allocate', 'seal'], {'0': [0, 1]})
    >>> trace.steps[0]["counts"]
    {'used': 2, 'cached': 0, 'free': 6}
    """

    def __init__(self) -> None:
        self.engine = ""  # "kvlib 0.5.0", or the engine a loaded trace names
        self.num_blocks = 0
        self.block_size = 0
        self.requests: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.missing: list[str] = []
        self._owner = None  # the engine recording into this trace
        self._last: _Snapshot | None = None
        self._state: PoolState | None = None

    def __repr__(self) -> str:
        return f"PoolTrace({self.engine!r}, {len(self.steps)} steps, {len(self.requests)} sequences, " \
               f"{self.num_blocks} blocks of {self.block_size})"

    # -- reading and writing -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "engine": self.engine, "num_blocks": self.num_blocks, "block_size": self.block_size,
             "requests": self.requests, "steps": self.steps}
        if self.missing:
            d["missing"] = self.missing
        return d

    def to_json(self) -> str:
        """The trace as compact JSON text (what `save` writes)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> "PoolTrace":
        """A trace from its JSON object, checked: ValueError/TypeError name what is wrong with it."""
        validate(d)
        t = cls()
        t.engine, t.num_blocks, t.block_size = str(d.get("engine", "")), d["num_blocks"], d["block_size"]
        t.requests, t.steps, t.missing = d["requests"], d["steps"], list(d.get("missing", []))
        t._owner = False  # read back: nothing records into it
        return t

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PoolTrace":
        """Read and check a trace file (one a reader recorded themselves, say)."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not JSON: {e}") from None
        return cls.from_dict(d)

    # -- recording (called by kvlib.Engine) --------------------------------------------------------------------
    def _attach(self, engine: "Engine") -> None:
        """Become ``engine``'s recorder: the pool must be empty (nothing held, nothing cached)."""
        import kvlib

        if self._owner is not None:
            raise ValueError("this PoolTrace already records another engine, or was read from a file: "
                             "give each engine a new PoolTrace()")
        cache, a = engine.cache, engine.cache.allocator
        if cache.seqs or any(a.is_sealed(b) for b in range(a.num_blocks)):
            raise ValueError(f"a PoolTrace starts from an empty pool, but this one holds {len(cache.seqs)} sequences "
                             f"and {a.num_cached_free} cached blocks: give the trace to an engine over a fresh PagedCache")
        self._owner = engine
        self.engine, self.num_blocks, self.block_size = f"kvlib {kvlib.__version__}", a.num_blocks, cache.block_size
        self._last = _Snapshot.of(cache)
        self._state = PoolState({}, [0] * a.num_blocks, set())

    def _keys(self, engine: "Engine", plan: "StepPlan | None" = None) -> dict[int, str]:
        """Cache sequence id -> trace key, for every sequence the engine knows to hold blocks. A group's
        prompt, until it forks, is held by one cache sequence: its first sample's."""
        keys = {s.sid: seq_key(s) for req in engine.requests.values() for s in req.seqs if s.sid is not None}
        prefills = list(plan.prefills) if plan is not None else []
        if engine.scheduler.prefilling is not None:
            prefills.append(engine.scheduler.prefilling)
        for p in prefills:
            keys.setdefault(p.sid, seq_key(p.group[0]))
        return keys

    def _observe(self, engine: "Engine", phase: str, plan: "StepPlan | None" = None) -> None:
        """The engine's call at a phase edge: "begin", "scheduled", "committed", "ended" or "failed"."""
        if engine is not self._owner:
            raise ValueError("this PoolTrace records another engine")
        snap = _Snapshot.of(engine.cache)
        if phase == "begin":
            if not snap.same_as(self._last):
                raise ValueError("the pool changed between two Engine.step() calls (a sequence added, freed or "
                                 "truncated by hand): a PoolTrace records only what the engine's steps do")
            for req in engine.requests.values():
                for s in req.seqs:
                    self.requests.setdefault(seq_key(s), {"prompt": len(req.prompt),
                                                          "max_new_tokens": req.params.max_new_tokens,
                                                          "arrive": len(self.steps)})
            self._events, self._keys0, self._at, self._forking = [], self._keys(engine), {"begin": snap}, []
            self._sids = []
            return
        before = self._at["committed"] if "committed" in self._at else self._at.get("scheduled", self._at["begin"])
        if phase == "scheduled" or (phase == "failed" and "committed" not in self._at):
            # a failed step: what its scheduling took back (prompts unscheduled) reads as preemptions
            self._scheduled(engine, plan, before, snap, self._keys_at if "scheduled" in self._at else self._keys0)
        elif phase == "committed":
            self._committed(plan, before, snap)
            self._forking = [p for p in plan.prefills if p.last]  # before the engine advances them
            self._sids = list(plan.sids)  # before finished sequences lose theirs
        if phase == "ended":
            self._ended(plan, before)
        self._at[phase] = snap
        if phase in ("ended", "failed"):
            self._store(engine, snap)

    def _scheduled(self, engine, plan, s0: _Snapshot, sa: _Snapshot, keys0: dict[int, str]) -> None:
        """Preemptions (sequences gone), then admissions and their prefix hits (sequences new)."""
        keys = self._keys(engine, plan)
        for sid in sorted(set(s0.tables) - set(sa.tables), reverse=True):  # the newest is preempted first
            self._events.append({"kind": "preempt", "seq": keys0[sid], "blocks": s0.tables[sid][::-1]})
        cached = {p.sid: p.cached for p in (plan.prefills if plan is not None else [])}
        for sid in sa.tables:
            if sid in s0.tables:
                continue
            self._events.append({"kind": "admit", "seq": keys[sid], "cached_tokens": cached.get(sid, 0)})
            if sa.tables[sid]:
                self._events.append({"kind": "hit", "seq": keys[sid], "blocks": sa.tables[sid]})
        self._keys_at = keys

    def _committed(self, plan, sa: _Snapshot, sb: _Snapshot) -> None:
        """Copy-on-write and new blocks per sequence of the step (evictions first), then the blocks sealed."""
        fresh = {b for b in range(len(sb.generation)) if sb.generation[b] != sa.generation[b]}
        evicted = {b for b in fresh if b in sa.sealed}
        for sid in plan.sids:
            key, old, new = self._keys_at[sid], sa.tables[sid], sb.tables[sid]
            out = [b for b in new if b in evicted]
            if out:
                self._events.append({"kind": "evict", "blocks": out})
            for i, b in enumerate(old):
                if new[i] != b:
                    self._events.append({"kind": "cow", "seq": key, "from": b, "to": new[i]})
            if new[len(old):]:
                self._events.append({"kind": "allocate", "seq": key, "blocks": new[len(old):]})
        sealed = [b for sid in plan.sids for b in sb.tables[sid] if b in sb.sealed and (b in fresh or b not in sa.sealed)]
        if sealed:
            self._events.append({"kind": "seal", "blocks": list(dict.fromkeys(sealed))})

    def _ended(self, plan, sb: _Snapshot) -> None:
        """Finished decodes give their blocks back; a group whose prompt is in forks, then its finished samples free."""
        bs = self.block_size
        for seq, sid in zip(plan.decodes, self._sids):
            if seq.finished:
                self._events.append({"kind": "free", "seq": seq_key(seq), "blocks": sb.tables[sid][::-1]})
        for p in self._forking:
            table = sb.tables[p.sid][: -(-sb.lengths[p.sid] // bs)]  # what fork shares: the blocks holding tokens
            first = seq_key(p.group[0])
            for s in p.group[1:]:
                self._events.append({"kind": "fork", "seq": seq_key(s), "parent": first, "blocks": list(table)})
            for i, s in enumerate(p.group):
                if s.finished:
                    self._events.append({"kind": "free", "seq": seq_key(s),
                                         "blocks": (sb.tables[p.sid] if i == 0 else table)[::-1]})

    def _store(self, engine, snap: _Snapshot) -> None:
        """Append the step, after checking that its events rebuild the pool as it is."""
        keys = self._keys(engine)
        step = {"step": len(self.steps), "events": self._events,
                "tables": {keys[sid]: t for sid, t in snap.tables.items()},
                "lengths": {keys[sid]: n for sid, n in snap.lengths.items()},
                "counts": {"used": engine.cache.allocator.num_used, "cached": engine.cache.allocator.num_cached_free,
                           "free": engine.cache.allocator.num_free}}
        where = f"recording step {step['step']}"
        for j, ev in enumerate(step["events"]):
            apply_event(self._state, ev, f"{where}, event {j}")
        if self._state.tables != step["tables"] or self._state.counts != step["counts"]:
            raise RuntimeError(f"{where}: the events do not rebuild the pool (a bug in kvlib.paged.trace): "
                               f"{self._state.tables} vs {step['tables']}")
        self.steps.append(step)
        self._last = snap
