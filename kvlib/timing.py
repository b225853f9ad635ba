"""Small timing helpers the chapters and `kvbench` share.

Every timing is wall-clock ``time.perf_counter``, warmed up first, and reported as a
median with the raw samples beside it: CPUs are noisy, so compare ratios measured in
the same run rather than absolute numbers across machines.

A GPU runs its work asynchronously: a CUDA call returns once the work is queued, so a clock
read right after it measures the launch, not the work. Every timer here therefore waits for
the device before reading the clock (`synchronizer`: ``torch.cuda.synchronize``), and
`fastest_of` times a CUDA call with CUDA events, the device's own clock. On the CPU there is
nothing to wait for, and the timers run exactly as they always have.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.nn.functional as F

from .cache import StaticCache
from .generate import decode_step, generate, generate_naive, prefill
from .model import Transformer
from .validate import int_at_least, positive_int


def threads(n: int) -> AbstractContextManager[None]:
    """Run the ``with`` block on ``n`` CPU threads, then put back the count there was.

    PyTorch splits one matrix product across ``torch.get_num_threads()`` threads. For
    a small step that split can cost more than it saves, and on a busy machine one
    slow thread holds up the rest, so a chapter times its small steps on one thread::

        with kvlib.timing.threads(1):
            best = round_robin(steps)  # every turn on one thread
        # back to the chapter's count here, even if round_robin raised

    The count is a setting of the whole process: setting it by hand and forgetting to
    set it back (or an exception in between skipping the line that would) leaves every
    later cell on the wrong count. The previous count is restored in a ``finally``, and
    blocks nest: each restores what the one outside it had set.

    ``n`` is checked now, before anything changes: ``TypeError`` if it is not an int
    (``1.5``, ``"2"``), ``ValueError`` if it is not positive.
    """
    positive_int("n (a thread count)", n)  # TypeError for another kind, ValueError for <= 0
    return _threads(n)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _no_sync() -> None:
    """The CPU's synchronizer: its work is done when the call returns."""


def synchronizer(device: torch.device | str | None = None) -> Callable[[], None]:
    """What a timer calls before reading the clock, so that the timed work has finished.

    ``torch.cuda.synchronize(device)`` for a CUDA ``device``; nothing for any other. With
    ``device=None``: CUDA's whenever this process has started CUDA (work may be queued there),
    else nothing, so a CPU-only run never touches CUDA.

    >>> kvlib.timing.synchronizer("cpu")()  # nothing to wait for
    """
    if device is None:
        return torch.cuda.synchronize if torch.cuda.is_initialized() else _no_sync
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _no_sync


def fastest_of(device: torch.device | str, repeats: int) -> Callable[[Callable[[], object]], float]:
    """A timer: the fastest (seconds) of ``repeats`` calls of a function, after one warm-up call.

    Noise only ever adds time, so the minimum is the least disturbed run. On the CPU each call
    is timed with ``time.perf_counter``. On CUDA, with two CUDA events recorded around it on the
    device's stream, read after one synchronize: the device's own clock, with no host wait
    inside the span it measures. (`kvlib.hardware.measure` times with this.)
    """
    positive_int("repeats", repeats)
    device = torch.device(device)
    sync = synchronizer(device)

    def once(fn: Callable[[], object]) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s

    def best(fn: Callable[[], object]) -> float:
        fn()
        sync()  # the warm-up is finished before the first timed call starts
        return min(once(fn) for _ in range(repeats))

    return best


def graphed(fn: Callable[[], object], device: torch.device | str) -> Callable[[], object]:
    """``fn`` replayed from a CUDA graph on a CUDA ``device``; ``fn`` itself on any other.

    Launching a kernel costs the host a few microseconds, and a GPU streams a small matrix
    faster than that, so a sweep of small matrices timed eagerly measures the launches, not
    the memory. A CUDA graph records the kernels once and replays them in one launch (what
    CUDA graphs remove from a decode step). ``fn`` must be capturable (no host reads, static
    inputs); if capture fails for any reason, ``fn`` is returned and runs eagerly (where an
    error of its own raises again).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return fn
    try:
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm up off the default stream, as capture asks
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
    except Exception:  # noqa: BLE001 (any failure to capture: time it eagerly instead)
        return fn
    return graph.replay


def timeit(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5,
           device: torch.device | str | None = None) -> dict:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns ``{"median": s, "min": s, "all": [s, ...]}`` in seconds. Each timed call starts
    and ends with a `synchronizer` of ``device`` (None: CUDA's if CUDA is in use), so GPU work
    is timed to its end; on the CPU that is a no-op.
    """
    int_at_least("warmup", warmup, 0)
    int_at_least("repeats", repeats, 1)
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "all": times}


def time_generation(
    model: Transformer, ids: torch.Tensor, n: int, naive: bool = False, *, warmup: int = 0, repeats: int = 1
) -> tuple[torch.Tensor, dict]:
    """Greedy ``generate`` (or ``generate_naive``) of ``n`` tokens: (last output, timings)."""
    run = generate_naive if naive else generate
    outs = []
    timing = timeit(lambda: outs.append(run(model, ids, n)), warmup=warmup, repeats=repeats, device=model.device)
    return outs[-1], timing


def decode_stepper(model: Transformer, ids: torch.Tensor, context: int) -> Callable[[], None]:
    """A function that runs one decode step with exactly ``context`` tokens cached.

    The cache is filled by one prefill (``ids``, shape ``(1, T)``, repeated to length) and
    cropped back to ``context`` after every step, so every call sees the same context.
    """
    positive_int("context", context)
    filler = ids.repeat(1, -(-context // ids.shape[1]))[:, :context]  # (1, context)
    cache = StaticCache.for_model(model.config, 1, context + 1, dtype=model.dtype, device=model.device)
    prefill(model, filler, cache)
    tok = filler[:, -1]  # (1,)

    def step() -> None:
        decode_step(model, tok, cache)
        cache.crop(context)  # a list update: negligible next to the step

    return step


def filled_decode_stepper(model: Transformer, batch: int, context: int) -> Callable[[], None]:
    """Like `decode_stepper`, for ``batch`` sequences, without the prefill.

    A step's time does not depend on the numbers in the cache, only on how many there
    are, so the cache is filled with a constant (written, so its memory is really
    touched) instead of by a prefill that would take seconds at long context.
    """
    positive_int("batch", batch)
    int_at_least("context", context, 0)
    cache = StaticCache.for_model(model.config, batch, context + 1, dtype=model.dtype, device=model.device)
    for keys, values in zip(cache.keys, cache.values):
        keys.fill_(0.5)
        values.fill_(0.5)
    cache.lengths = [context] * model.config.n_layer
    tok = torch.zeros(batch, dtype=torch.long, device=model.device)  # (B,)

    def step() -> None:
        decode_step(model, tok, cache)
        cache.crop(context)

    return step


def round_robin(fns: dict, repeats: int = 5, warmup: int = 1) -> dict:
    """Fastest time (seconds) of each function in ``fns``, called in turn ``repeats`` times.

    Taking turns spreads a burst of noise over all of them, and the minimum keeps the
    run least disturbed by it: noise only ever adds time.
    """
    int_at_least("repeats", repeats, 1)
    int_at_least("warmup", warmup, 0)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync = synchronizer()  # GPU work is async: CUDA's synchronize if CUDA is in use
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def decode_latency(model: Transformer, ids: torch.Tensor, context: int, steps: int = 20) -> dict:
    """Timings (seconds) of ``steps`` single decode steps at a fixed ``context``."""
    return timeit(decode_stepper(model, ids, context), warmup=2, repeats=steps, device=model.device)


def matvec_bandwidth(in_features: int, out_features: int, count: int = 1, repeats: int = 10,
                     *, device: torch.device | str = "cpu") -> dict:
    """GB/s of one vector times ``count`` distinct fp32 matrices on ``device``, in both layouts.

    ``in_out`` stores W ``(in, out)`` and computes ``x @ W`` (kvlib's Linear);
    ``out_in`` stores ``(out, in)`` and calls ``F.linear(x, W)`` (nn.Linear).
    The two sweeps alternate, so that noise from other processes hits both.
    """
    for name, v in (("in_features", in_features), ("out_features", out_features), ("count", count),
                    ("repeats", repeats)):
        positive_int(name, v)
    x = torch.randn(1, in_features, device=device)  # (1, in)
    mats = {"in_out": [torch.randn(in_features, out_features, device=device) for _ in range(count)]}  # (in, out)
    mats["out_in"] = [w.t().contiguous() for w in mats["in_out"]]  # count x (out, in): same numbers, nn.Linear layout

    def sweep(layout: str) -> None:
        op = torch.matmul if layout == "in_out" else F.linear
        for w in mats[layout]:
            op(x, w)  # (1, out)

    times = {k: [] for k in mats}
    for _ in range(repeats):
        for layout in times:
            times[layout].append(timeit(lambda: sweep(layout), warmup=1, repeats=1, device=device)["median"])
    nbytes = sum(w.nbytes for w in mats["in_out"])
    return {layout: nbytes / statistics.median(t) / 1e9 for layout, t in times.items()}
