"""Start a few worker processes joined in one `torch.distributed` group, and stop them.

A real engine runs one process per GPU and joins them with NCCL; here each process stands
for a GPU, and the gloo backend carries the same ``torch.distributed`` calls (``all_reduce``,
``send``, ``recv``) between processes of this machine. (Engines add custom all-reduce kernels
for small messages, and move caches with RDMA libraries such as NIXL; the calls' meaning, and
the bytes they move, are the same.)

`launch` starts ``size`` processes with the ``spawn`` method (a fresh interpreter each, as
``torchrun`` gives), joins them through a rendezvous file in a temporary folder, runs
``fn(rank, size, *args)`` in each, and returns what each returned, in rank order. Every wait
is bounded: a worker that raises, hangs or dies stops the whole launch, every process is
stopped by its id, and the launch raises with the worker's traceback. ``Launch.pids`` keeps
the ids, so a caller can check that none is left running (``Launch.stopped``, `alive`).

``fn`` must be importable by name (a function defined in a module, not in a notebook cell):
a spawned process imports it afresh.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..validate import positive_int


@dataclass
class Launch:
    """What a launch returned: each rank's result, the workers' process ids, and its wall time."""

    results: list[Any]
    pids: list[int]
    seconds: float
    threads: int = field(default=1)

    def stopped(self, grace: float = 5.0) -> bool:
        """Whether every worker process is gone, given up to ``grace`` seconds to exit (bounded)."""
        deadline = time.monotonic() + grace
        while any(alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not any(alive(pid) for pid in self.pids)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, counts as gone).

    On Windows ``os.kill(pid, 0)`` would terminate the process, so there it answers True
    (callers then trust a file's age or their own handles instead).
    """
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: a zombie's state is "Z"
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _worker(fn, rank: int, size: int, rendezvous: str, results, threads: int, timeout: float, args) -> None:
    """One process: join the group, run ``fn``, report ("ok", result) or ("error", traceback)."""
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, size, *args)
            buf = io.BytesIO()  # tensors travel as bytes: a tensor shared by file descriptor dies with its process
            torch.save(out, buf)
            results.put((rank, "ok", buf.getvalue()))
        except BaseException:  # noqa: BLE001 - reported before this rank's connections close, so that
            results.put((rank, "error", (time.monotonic(), traceback.format_exc())))  # before the peers' "closed by peer"
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - joining the group failed: the parent re-raises it
        results.put((rank, "error", (time.monotonic(), traceback.format_exc())))


def _first_error(errors: list, results, size: int, grace: float = 1.0) -> str:
    """The message of the earliest of the errors reported within ``grace`` seconds of the first."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, status, out = results.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        if status == "error":
            errors.append((rank, out))
    rank, (_, text) = min(errors, key=lambda e: e[1][0])
    return f"worker rank {rank} of {size} failed:\n{text}"


def launch(fn: Callable, size: int, *args, timeout: float = 120.0, threads: int = 1) -> Launch:
    """Run ``fn(rank, size, *args)`` in ``size`` processes joined by gloo; results in rank order.

    ``threads``: torch threads per worker (1: the workers share this machine's cores).
    ``timeout``: seconds for the whole launch; past it every worker is stopped and
    ``TimeoutError`` raised. A worker's exception becomes a ``RuntimeError`` carrying its
    traceback, after every worker has been stopped.
    """
    positive_int("size", size)
    positive_int("threads", threads)
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>") or fn.__module__ == "__main__":
        raise TypeError(f"fn must be a module-level function a spawned process can import, got {fn!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvlib-dist-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(fn, r, size, rendezvous, results, threads, timeout, args),
                             daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        pids = [p.pid for p in procs]
        got: dict[int, Any] = {}
        try:
            while len(got) < size:  # bounded: every wait has the launch's deadline
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise TimeoutError(f"{size} workers did not finish in {timeout:.0f} s (done: ranks {sorted(got)})")
                try:
                    rank, status, out = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                    if dead:
                        raise RuntimeError(f"worker rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                                           "without a result") from None
                    continue
                if status == "error":  # the earliest error is the cause; its peers then fail on the lost link
                    raise RuntimeError(_first_error([(rank, out)], results, size))
                got[rank] = torch.load(io.BytesIO(out), weights_only=False)  # our own workers' results
        finally:
            for p in procs:
                p.join(timeout=5.0)
            for p in procs:
                if p.is_alive():  # stopped by its id
                    p.kill()
                    p.join(timeout=5.0)
            results.close()
    return Launch([got[r] for r in range(size)], pids, time.monotonic() - start, threads)
