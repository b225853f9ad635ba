"""How big the KV cache gets, and what fits in a given memory.

Every layer stores a key and a value vector per KV head per token::

    cache bytes = 2 (K and V) * n_layer * batch * n_kv_head * seq_len * head_dim * dtype_bytes

The weights, by contrast, do not grow with batch or context. This module puts
the two side by side for real models (`kvlib.PRESETS`) and answers "how many
sequences of this length fit on this GPU?".

Its second half, `simulate`, serves a request trace from a fixed pool of
token slots and measures how much of the pool holds tokens and how much is
wasted, for contiguous reservations and for paging (`kvlib.paged`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .config import PRESETS, ModelConfig
from .cost import kv_bytes, param_count

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def _bytes_of(dtype: str | int) -> int:
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} or a positive byte count, got {dtype!r}")


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype: str | int = "fp16") -> int:
    """``2 * n_layer * batch * n_kv_head * seq_len * head_dim * bytes``."""
    return kv_bytes(config, seq_len, _bytes_of(dtype), batch)


def kv_bytes_per_token(config: ModelConfig, dtype: str | int = "fp16") -> int:
    """Cache bytes one more token adds to one sequence."""
    return kv_cache_bytes(config, 1, 1, dtype)


def weight_bytes(config: ModelConfig, dtype: str | int = "fp16") -> int:
    """Bytes of all parameters stored at ``dtype``."""
    return param_count(config) * _bytes_of(dtype)


def max_tokens(config: ModelConfig, memory_bytes: int, dtype: str | int = "fp16", *, weights: bool = True) -> int:
    """How many cached tokens (summed over the batch) fit in ``memory_bytes``,
    after the weights if ``weights=True``. Activations and fragmentation are ignored."""
    free = memory_bytes - (weight_bytes(config, dtype) if weights else 0)
    if free < 0:
        raise ValueError(
            f"{config.name or 'the model'}'s weights ({weight_bytes(config, dtype) / GiB:.1f} GiB at {dtype}) "
            f"do not fit in {memory_bytes / GiB:.1f} GiB"
        )
    return free // kv_bytes_per_token(config, dtype)


def max_batch(config: ModelConfig, memory_bytes: int, seq_len: int, dtype: str | int = "fp16") -> int:
    """The largest batch of ``seq_len``-token sequences whose cache fits beside the weights."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return max_tokens(config, memory_bytes, dtype) // seq_len


def table(names: list[str] | None = None, seq_len: int = 4096, batch: int = 1, dtype: str | int = "fp16") -> list[dict]:
    """One row per preset: parameters, weight GiB, cache KiB per token, cache GiB at ``batch x seq_len``."""
    rows = []
    for name in names or [n for n in PRESETS if n != "tiny"]:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        c = PRESETS[name]
        rows.append({
            "model": c.name or name,
            "params": param_count(c),
            "weights_gib": weight_bytes(c, dtype) / GiB,
            "kv_kib_per_token": kv_bytes_per_token(c, dtype) / 1024,
            "kv_gib": kv_cache_bytes(c, seq_len, batch, dtype) / GiB,
        })
    return rows


# -- fragmentation: contiguous reservations vs paging -----------------------------------------------
# What each token slot of the pool is doing at one moment:
USED, RESERVED, INTERNAL, EXTERNAL, FREE = range(5)
CATEGORIES = ("token states", "reserved", "internal fragmentation", "external fragmentation", "free")
POLICIES = ("max", "pow2", "oracle", "paged")


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
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not (prompt_median > 0 and output_median > 0 and sigma >= 0):
        raise ValueError(f"medians must be > 0 and sigma >= 0, got {prompt_median}, {output_median}, {sigma}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.round(rng.lognormal(np.log(prompt_median), sigma, n)), 1, max_len - 1).astype(int)
    output = np.clip(np.round(rng.lognormal(np.log(output_median), sigma, n)), 1, None).astype(int)
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
class _Live:
    req: TraceRequest
    held: int  # tokens whose K/V are in memory now
    start: int = 0  # contiguous: first slot of the reservation
    size: int = 0  # contiguous: slots reserved
    blocks: list[int] | None = None  # paged: block ids, in order


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

    @property
    def waste(self) -> float:
        """Share of the occupied pool that holds no token: (reserved + internal + external) / (pool - free)."""
        f = self.fractions
        occupied = 1.0 - f["free"]
        return 0.0 if occupied == 0 else (occupied - f["token states"]) / occupied


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
    (vLLM's default is 1%).

    ``snapshot`` picks the step whose `SimResult.memory_map` is kept, as a fraction of
    the saturated period.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("memory_slots", memory_slots), ("max_len", max_len), ("block_size", block_size)):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if not trace:
        raise ValueError("the trace is empty")
    too_long = [r for r in trace if r.total > max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_len={max_len}, e.g. {too_long[0]}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must lie in [0, 1), got {watermark!r}")
    paged = policy == "paged"
    n_blocks = memory_slots // block_size
    keep_free = int(watermark * n_blocks)  # paged admission leaves this many blocks for growth

    def blocks_for(tokens: int) -> int:
        return -(-tokens // block_size)

    biggest = max(blocks_for(r.total) * block_size if paged else reservation(policy, r, max_len) for r in trace)
    if biggest > (n_blocks * block_size if paged else memory_slots):
        raise ValueError(f"a request needs {biggest} slots but the pool has {memory_slots}")

    queue: deque[tuple[TraceRequest, int]] = deque((r, r.prompt) for r in trace)  # (request, tokens to hold on admission)
    live: list[_Live] = []
    free_blocks: deque[int] = deque(range(n_blocks))
    sums = dict.fromkeys(CATEGORIES, 0.0)
    idle = dict.fromkeys(CATEGORIES, 0.0)  # the same over steps with nobody waiting (used only if never saturated)
    batches: list[int] = []
    idle_batches: list[int] = []
    preemptions = step = 0
    snaps: list[tuple[int, np.ndarray]] = []

    def head_need() -> int:
        req, hold = queue[0]
        return blocks_for(hold) * block_size if paged else reservation(policy, req, max_len)

    while queue or live:
        # admit, first come first served
        while queue:
            req, hold = queue[0]
            if paged:
                if blocks_for(hold) > len(free_blocks) - keep_free:
                    break
                blocks = [free_blocks.popleft() for _ in range(blocks_for(hold))]
                live.append(_Live(req, hold, blocks=blocks))
            else:
                size = reservation(policy, req, max_len)
                start = _first_fit(live, size, memory_slots)
                if start is None:
                    break
                live.append(_Live(req, hold, start, size))
            queue.popleft()

        # measure
        counts = dict.fromkeys(CATEGORIES, 0)
        for r in live:
            slots = len(r.blocks) * block_size if paged else r.size
            counts["token states"] += r.held
            counts["reserved"] += min(r.req.total, slots) - r.held
            counts["internal fragmentation"] += slots - min(r.req.total, slots)
        if not paged and queue:
            need = head_need()
            counts["external fragmentation"] = sum(b - a for a, b in _gaps(live, memory_slots) if b - a < need)
        counts["free"] = memory_slots - sum(counts.values())
        if queue:
            for k in CATEGORIES:
                sums[k] += counts[k] / memory_slots
            batches.append(len(live))
            if len(batches) % 25 == 1:  # keep a few candidate maps, cheaply
                snaps.append((step, _map(live, paged, block_size, memory_slots, head_need())))
        else:
            for k in CATEGORIES:
                idle[k] += counts[k] / memory_slots
            idle_batches.append(len(live))

        # one decode step: every running request gains a token
        i = 0
        while i < len(live):  # oldest first; preemption pops from the end
            r = live[i]
            if paged and r.held % block_size == 0:  # its last block is full: it needs a new one
                while not free_blocks and len(live) > i:
                    victim = live.pop()  # preempt the newest (maybe r); it will recompute its tokens
                    free_blocks.extend(reversed(victim.blocks))
                    queue.appendleft((victim.req, victim.held))
                    preemptions += 1
                if len(live) <= i:
                    break
                r.blocks.append(free_blocks.popleft())
            r.held += 1
            i += 1
        done = [r for r in live if r.held >= r.req.total]
        if done:
            live = [r for r in live if r.held < r.req.total]
            for r in done:
                if paged:
                    free_blocks.extend(r.blocks)
        step += 1

    n = len(batches)
    if n == 0:  # the pool was never full: report the averages over every step instead
        sums, batches = idle, idle_batches
    fractions = {k: v / len(batches) for k, v in sums.items()}
    if snaps:
        snap_step, memory_map = snaps[min(int(snapshot * len(snaps)), len(snaps) - 1)]
    else:
        snap_step, memory_map = 0, np.full(memory_slots, FREE, dtype=np.int8)
    return SimResult(
        policy, block_size, memory_slots, step, n, fractions,
        float(np.mean(batches)), max(batches), preemptions, memory_map, snap_step,
    )


def _map(live: list[_Live], paged: bool, block_size: int, memory_slots: int, head_need: int) -> np.ndarray:
    """The category of every slot of the pool, for drawing it."""
    m = np.full(memory_slots, FREE, dtype=np.int8)
    for r in live:
        if paged:
            t = np.arange(len(r.blocks) * block_size)  # token positions this request's blocks can hold
            slots = np.asarray(r.blocks)[t // block_size] * block_size + t % block_size
            m[slots] = np.where(t < r.held, USED, np.where(t < r.req.total, RESERVED, INTERNAL))
        else:
            a = r.start
            m[a : a + r.held] = USED
            m[a + r.held : a + r.req.total] = RESERVED
            m[a + r.req.total : a + r.size] = INTERNAL
    if not paged:
        for a, b in _gaps(live, memory_slots):
            if b - a < head_need:
                m[a:b] = EXTERNAL
    return m
