"""Serve a request trace from a fixed pool of token slots, and see where the memory goes.

A server admits requests first come, first served, and every step each running request
gains one token. Contiguous policies reserve one run of slots per request up front;
paging (`kvlib.paged`) takes small blocks as tokens arrive. `simulate` counts, step by
step, which slots hold tokens and which are wasted, and why.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .validate import int_at_least, positive_int

# What each token slot of the pool is doing at one moment:
USED, RESERVED, INTERNAL, EXTERNAL, FREE = range(5)
CATEGORIES = ("token states", "reserved", "internal fragmentation", "external fragmentation", "free")
POLICIES = ("max", "pow2", "oracle", "paged")
_SNAPSHOT_EVERY = 25  # keep the memory map of every 25th saturated step as a candidate snapshot


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: ``prompt`` tokens in, ``output`` tokens out."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def request_trace(
    n: int,
    *,
    prompt_median: float = 160,
    output_median: float = 200,
    sigma: float = 0.9,
    max_len: int = 2048,
    seed: int = 0,
) -> list[TraceRequest]:
    """``n`` requests with log-normal prompt and output lengths.

    Each length is ``round(exp(N(log(median), sigma**2)))``, at least 1; the output is cut
    so that ``prompt + output <= max_len`` (a server's context limit).
    """
    positive_int("n", n)
    if not (prompt_median > 0 and output_median > 0 and sigma >= 0):
        raise ValueError(f"medians must be > 0 and sigma >= 0, got {prompt_median}, {output_median}, {sigma}")
    int_at_least("max_len", max_len, 2)
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.round(rng.lognormal(np.log(prompt_median), sigma, n)), 1, max_len - 1).astype(int)  # (n,)
    output = np.clip(np.round(rng.lognormal(np.log(output_median), sigma, n)), 1, None).astype(int)  # (n,)
    output = np.minimum(output, max_len - prompt)
    return [TraceRequest(int(p), int(o)) for p, o in zip(prompt, output)]


def reservation(policy: str, request: TraceRequest, max_len: int) -> int:
    """Slots a contiguous server reserves for ``request`` when it admits it.

    ``max``: the context limit, since the output length is unknown (FasterTransformer,
    Orca "Max"). ``pow2``: the true length rounded up to a power of two. ``oracle``: the
    true length. Both of those need the output length in advance, which no real server
    has; they bound what predicting it could achieve.
    """
    if policy == "max":
        return max_len
    if policy == "pow2":
        return min(1 << (request.total - 1).bit_length(), max_len)
    if policy == "oracle":
        return request.total
    raise ValueError(f"contiguous policy must be 'max', 'pow2' or 'oracle', got {policy!r}")


@dataclass
class SimResult:
    """What `simulate` measured. Fractions are of the whole pool, averaged over the
    *saturated* steps (requests were waiting, so unused memory was not for lack of work),
    or over every step if the pool never filled (``saturated_steps == 0``)."""

    policy: str
    block_size: int
    memory_slots: int
    steps: int
    saturated_steps: int
    fractions: dict[str, float]  # category name -> mean fraction of the pool
    mean_batch: float  # requests running at once, mean over saturated steps
    peak_batch: int
    preemptions: int
    memory_map: np.ndarray  # (memory_slots,) category of every slot at the snapshot step
    snapshot_step: int
    preempted_tokens: tuple[int, ...] = ()  # tokens each preempted request held when it was evicted

    @property
    def waste(self) -> float:
        """Share of the occupied pool that holds no token: (reserved + internal + external) / (pool - free)."""
        f = self.fractions
        occupied = 1.0 - f["free"]
        return 0.0 if occupied == 0 else (occupied - f["token states"]) / occupied


@dataclass
class _Live:
    """A running request and the memory it holds."""

    req: TraceRequest
    held: int  # tokens whose K/V are in memory now
    start: int = 0  # contiguous: first slot of the reservation
    size: int = 0  # contiguous: slots reserved
    blocks: list[int] | None = None  # paged: block ids, in order


def _gaps(live: list[_Live], memory_slots: int) -> list[tuple[int, int]]:
    """The free runs ``(start, end)`` between contiguous reservations, in address order."""
    out, at = [], 0
    for r in sorted(live, key=lambda r: r.start):
        if r.start > at:
            out.append((at, r.start))
        at = r.start + r.size
    if at < memory_slots:
        out.append((at, memory_slots))
    return out


def _first_fit(live: list[_Live], size: int, memory_slots: int) -> int | None:
    """Lowest start of a free gap of ``size`` contiguous slots, or None."""
    return next((a for a, b in _gaps(live, memory_slots) if b - a >= size), None)


class _Server:
    """One serving pool: a queue of waiting requests, the running ones, and the slots they hold.

    `step` is one decode step of the server: admit who fits, record what every slot is
    doing, give every running request one more token (paging may preempt to find room),
    and let the finished ones go. The record it keeps becomes the `SimResult`.
    """

    def __init__(self, trace: list[TraceRequest], policy: str, memory_slots: int, max_len: int,
                 block_size: int, keep_free: int):
        self.policy, self.paged = policy, policy == "paged"
        self.memory_slots, self.max_len, self.block_size = memory_slots, max_len, block_size
        self.keep_free = keep_free  # paged admission leaves this many blocks for growth
        self.queue: deque[tuple[TraceRequest, int]] = deque((r, r.prompt) for r in trace)  # (request, tokens to hold)
        self.live: list[_Live] = []  # oldest first
        self.free_blocks: deque[int] = deque(range(memory_slots // block_size))
        self.steps = self.preemptions = 0
        self.preempted_tokens: list[int] = []  # K/V dropped by each preemption: to swap out, or recompute
        # the record: sums of per-step fractions, batch sizes, and a few memory maps
        self.sums = dict.fromkeys(CATEGORIES, 0.0)  # over saturated steps (somebody waiting)
        self.idle = dict.fromkeys(CATEGORIES, 0.0)  # over the others (used only if never saturated)
        self.batches: list[int] = []
        self.idle_batches: list[int] = []
        self.snaps: list[tuple[int, np.ndarray]] = []

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.live)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def need(self, req: TraceRequest, hold: int) -> int:
        """Slots a request needs to be admitted holding ``hold`` tokens."""
        if self.paged:
            return self.blocks_for(hold) * self.block_size
        return reservation(self.policy, req, self.max_len)

    def slots(self, r: _Live) -> int:
        """Slots a running request holds."""
        return len(r.blocks) * self.block_size if self.paged else r.size

    def step(self) -> None:
        """One decode step of the server."""
        self.admit()
        self.record()
        self.grow()
        self.finish()
        self.steps += 1

    def admit(self) -> None:
        """Admit queued requests first come, first served, until the head does not fit."""
        while self.queue:
            req, hold = self.queue[0]
            if self.paged:
                n = self.blocks_for(hold)
                if n > len(self.free_blocks) - self.keep_free:
                    return
                self.live.append(_Live(req, hold, blocks=[self.free_blocks.popleft() for _ in range(n)]))
            else:
                size = reservation(self.policy, req, self.max_len)
                start = _first_fit(self.live, size, self.memory_slots)
                if start is None:
                    return
                self.live.append(_Live(req, hold, start, size))
            self.queue.popleft()

    def counts(self) -> dict[str, int]:
        """Slots in each of `CATEGORIES` now."""
        counts = dict.fromkeys(CATEGORIES, 0)
        for r in self.live:
            slots = self.slots(r)
            counts["token states"] += r.held
            counts["reserved"] += min(r.req.total, slots) - r.held
            counts["internal fragmentation"] += slots - min(r.req.total, slots)
        if not self.paged and self.queue:  # free runs too short for the head of the queue
            need = self.need(*self.queue[0])
            gaps = _gaps(self.live, self.memory_slots)
            counts["external fragmentation"] = sum(b - a for a, b in gaps if b - a < need)
        counts["free"] = self.memory_slots - sum(counts.values())
        return counts

    def record(self) -> None:
        """Add this step's fractions and batch size to the saturated or the idle record."""
        counts = self.counts()
        sums, batches = (self.sums, self.batches) if self.queue else (self.idle, self.idle_batches)
        for k in CATEGORIES:
            sums[k] += counts[k] / self.memory_slots
        batches.append(len(self.live))
        if self.queue and len(batches) % _SNAPSHOT_EVERY == 1:  # keep a few candidate maps, cheaply
            self.snaps.append((self.steps, self.memory_map()))

    def grow(self) -> None:
        """Every running request gains a token, oldest first; a paged one whose last block is
        full takes a new block, preempting the newest requests while none is free."""
        i = 0
        while i < len(self.live):
            r = self.live[i]
            if self.paged and r.held % self.block_size == 0:
                while not self.free_blocks and len(self.live) > i:
                    self.preempt()  # the newest, maybe r itself
                if len(self.live) <= i:
                    return
                r.blocks.append(self.free_blocks.popleft())
            r.held += 1
            i += 1

    def preempt(self) -> None:
        """Evict the newest running request; it goes back to the head of the queue to recompute its tokens."""
        victim = self.live.pop()
        self.free_blocks.extend(reversed(victim.blocks))
        self.queue.appendleft((victim.req, victim.held))
        self.preemptions += 1
        self.preempted_tokens.append(victim.held)

    def finish(self) -> None:
        """Requests that hold all their tokens leave and free their memory."""
        done = [r for r in self.live if r.held >= r.req.total]
        if done:
            self.live = [r for r in self.live if r.held < r.req.total]
            for r in done:
                if self.paged:
                    self.free_blocks.extend(r.blocks)

    def memory_map(self) -> np.ndarray:
        """The category of every slot of the pool, for drawing it: ``(memory_slots,)`` int8."""
        m = np.full(self.memory_slots, FREE, dtype=np.int8)
        B = self.block_size
        for r in self.live:
            if self.paged:
                t = np.arange(len(r.blocks) * B)  # (slots held,) token positions this request's blocks can hold
                slots = np.asarray(r.blocks)[t // B] * B + t % B  # (slots held,) their addresses in the pool
                m[slots] = np.where(t < r.held, USED, np.where(t < r.req.total, RESERVED, INTERNAL))
            else:
                a = r.start
                m[a : a + r.held] = USED
                m[a + r.held : a + r.req.total] = RESERVED
                m[a + r.req.total : a + r.size] = INTERNAL
        if not self.paged:
            need = self.need(*self.queue[0]) if self.queue else 0
            for a, b in _gaps(self.live, self.memory_slots):
                if b - a < need:
                    m[a:b] = EXTERNAL
        return m

    def result(self, snapshot: float) -> SimResult:
        """The record as averages; the saturated steps if there were any, else every step."""
        saturated = len(self.batches)
        sums, batches = (self.sums, self.batches) if saturated else (self.idle, self.idle_batches)
        fractions = {k: v / len(batches) for k, v in sums.items()}
        if self.snaps:
            snap_step, memory_map = self.snaps[min(int(snapshot * len(self.snaps)), len(self.snaps) - 1)]
        else:
            snap_step, memory_map = 0, np.full(self.memory_slots, FREE, dtype=np.int8)
        return SimResult(
            self.policy, self.block_size, self.memory_slots, self.steps, saturated, fractions,
            float(np.mean(batches)), max(batches), self.preemptions, memory_map, snap_step,
            tuple(self.preempted_tokens),
        )


def simulate(
    trace: list[TraceRequest],
    policy: str,
    *,
    memory_slots: int,
    max_len: int = 2048,
    block_size: int = 16,
    snapshot: float = 0.5,
    watermark: float = 0.01,
) -> SimResult:
    """Serve ``trace`` from a pool of ``memory_slots`` token slots, one decode step at a time.

    Every request is queued at time 0 and admitted first come, first served. Admitted,
    it holds its prompt; each step adds one token until ``prompt + output``, then it
    leaves. Contiguous policies (``max``, ``pow2``, ``oracle``) reserve one run of slots
    at admission (first fit). ``paged`` takes ``block_size``-slot blocks as tokens
    arrive and, when none is free, preempts the newest request (recomputed later); it
    admits a request only if ``watermark`` of the blocks stay free for the others to grow
    (1% here, as vLLM's first engine, V0, did by default; vLLM 0.32 keeps the knob,
    ``--watermark``, at 0).

    ``snapshot`` picks the step whose `SimResult.memory_map` is kept, as a fraction of
    the saturated period.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("memory_slots", memory_slots), ("max_len", max_len), ("block_size", block_size)):
        positive_int(name, val)
    if not trace:
        raise ValueError("the trace is empty")
    too_long = [r for r in trace if r.total > max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_len={max_len}, e.g. {too_long[0]}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must lie in [0, 1), got {watermark!r}")
    n_blocks = memory_slots // block_size
    server = _Server(trace, policy, memory_slots, max_len, block_size, keep_free=int(watermark * n_blocks))
    biggest = max(server.need(r, r.total) for r in trace)
    usable = n_blocks * block_size if server.paged else memory_slots
    if biggest > usable:
        raise ValueError(f"a request needs {biggest} slots but the pool has {memory_slots}")

    while server.busy:
        server.step()
    return server.result(snapshot)
