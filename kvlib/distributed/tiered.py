"""Serving a prompt through the disk tier: load the longest stored prefix, prefill only the rest.

This is what LMCache's connector does inside vLLM for each request: before the prefill,
ask the store how many leading tokens it holds ("the number of matched tokens"), load
their K/V into the engine's cache, run the model on the rest only, and after the step
save the new full chunks. SGLang's HiCache does the same one level down its radix tree.

Whether loading pays depends on the prefix's length and on the machine: recomputing costs
about ``2 * n_params`` FLOPs per token (plus attention, which grows with the length), loading
costs the token's K/V bytes read, checksummed and copied. Their ratio, FLOPs per K/V byte, is
set by the model; the machine sets how many FLOPs one byte of reading buys. A CPU computes
slowly, so loading tends to win at every length; a GPU computes hundreds of times faster while
a disk reads no faster, so there a small model's short prefix can be cheaper to recompute
(attention's growth with the length tips long ones back to loading). `load_vs_recompute`
measures both sides on the machine it runs on, and `crossover` reads where loading starts to win.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache import Cache, StaticCache
from ..model import Transformer
from ..timing import timeit
from ..validate import positive_int
from .cachekind import resolve_kind
from .disk import DiskStore, StoreError, token_list


@dataclass
class Served:
    """What `prefill` did: the next-token ``logits`` ``(1, vocab)``, the filled ``cache``,
    how many tokens were ``loaded`` from the store and ``computed`` by the model, how
    many new chunks were ``stored``, why storing failed (``store_error``, else None), and the
    ``kind`` of cache the prefix was looked up and stored under (`kvlib.distributed.cachekind`)."""

    logits: torch.Tensor
    cache: Cache
    loaded: int
    computed: int
    stored: int
    store_error: str | None = None
    kind: str = "exact"


def _check_pair(model: Transformer, store: DiskStore) -> None:
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a kvlib Transformer, got {type(model).__name__}")
    if not isinstance(store, DiskStore):
        raise TypeError(f"store must be a DiskStore, got {type(store).__name__}")
    c = model.config
    if c.hybrid:
        raise ValueError(f"{c.name or 'this model'} has a per-layer cache policy; the disk tier stores full layers")
    want = (c.n_layer, c.n_kv_head, store.chunk_tokens, c.head_dim)
    if store.shape != want or store.dtype != model.dtype:
        raise ValueError(f"the store holds chunks {store.shape} {store.dtype}, the model makes {want} {model.dtype}")


@torch.inference_mode()
def prefill(model: Transformer, tokens: object, store: DiskStore, cache: Cache | None = None, *,
            kind: str | None = None) -> Served:
    """Prefill ``tokens`` (one sequence: a list of ids or a ``(T,)``/``(1, T)`` tensor) through ``store``.

    Loads the longest stored prefix into ``cache`` (default: a growing `StaticCache`), runs
    ``model`` on the rest, then stores the prompt's new full chunks. At least the last token
    is always computed, since its logits are the answer. A store that cannot write (disk
    full) does not fail the request: the error is reported in ``store_error``.

    Prefixes are looked up and stored under the cache's kind (``cache_kind(cache)``), so a
    quantized cache's K/V are served only to requests that run the same quantized cache, and an
    exact request gets exact K/V or recomputes them. A cache that evicts tokens (a window, sinks,
    H2O) holds no whole prefix: a ``ValueError``. For a cache class of your own, pass ``kind``
    (``"exact"`` if it returns what it was given).
    """
    _check_pair(model, store)
    ids = token_list(tokens)
    if not ids:
        raise ValueError("prefill needs at least one token, got none")
    if cache is None:
        cache = StaticCache.for_model(model.config, 1, len(ids), dtype=model.dtype, device=model.device, grow=True)
    if not isinstance(cache, Cache) or cache.seq_len != 0:
        raise ValueError(f"cache must be an empty kvlib Cache, got {cache!r}")
    kind = resolve_kind(cache, kind)  # before any work: an evicting cache is refused here
    prefix = store.lookup(ids, kind=kind, max_tokens=len(ids) - 1, device=model.device)
    prefix.fill(cache, kind=kind)
    rest = torch.tensor(ids[prefix.n_tokens :], device=model.device)[None]  # (1, T - loaded)
    logits = model(rest, cache, last_only=True)[:, -1]  # (1, vocab)
    try:
        stored, error = store.put(ids, cache, kind=kind).written, None
    except StoreError as e:
        stored, error = e.report.written if e.report else 0, str(e)
    return Served(logits, cache, prefix.n_tokens, rest.shape[1], stored, error, kind)


def _drop_page_cache(paths: Sequence[os.PathLike]) -> None:
    """Ask the OS to forget the files' cached pages, so the next read comes from the device."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _median_time(fn: Callable[[], object], before: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, ``before()`` run untimed ahead of each."""
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def load_vs_recompute(model: Transformer, tokens: object, lengths: Sequence[int], store_dir: str | os.PathLike,
                      *, model_id: str, chunk_tokens: int = 32, repeats: int = 3) -> list[dict]:
    """Per prefix length: the seconds to load it from a `DiskStore` into a cache, against the
    seconds to prefill it, each the median of ``repeats``. One row per length, with keys

    ``tokens``, ``bytes`` (its K/V on disk), ``recompute_s`` (a prefill into a fresh cache),
    ``load_s`` (lookup + checksum + fill, the file in the OS page cache: a CPU-memory tier) and
    ``load_cold_s`` (the same after the OS was told to drop the file's pages, so the read
    comes from the device, as far as the OS honours it; None where it cannot be asked).

    Every length must be a multiple of ``chunk_tokens``; ``tokens`` must be at least as long
    as the longest. The store under ``store_dir`` is filled once, by one prefill of the longest.
    """
    ids = token_list(tokens)
    positive_int("chunk_tokens", chunk_tokens)
    positive_int("repeats", repeats)
    if not lengths or any(not isinstance(n, int) or n <= 0 or n % chunk_tokens or n > len(ids) for n in lengths):
        raise ValueError(f"lengths must be positive multiples of chunk_tokens={chunk_tokens}, at most "
                         f"len(tokens)={len(ids)}; got {list(lengths)}")
    longest = max(lengths)

    def fresh(n: int) -> StaticCache:  # both sides fill a cache of exactly n slots, allocated in the timing
        return StaticCache.for_model(model.config, 1, n, dtype=model.dtype, device=model.device)

    per_token = 2 * model.config.n_layer * model.config.n_kv_head * model.config.head_dim * model.dtype.itemsize
    store = DiskStore.for_model(store_dir, model, model_id=model_id, chunk_tokens=chunk_tokens,
                                budget_bytes=2 * per_token * longest + (1 << 20))
    cache = fresh(longest)
    model(torch.tensor(ids[:longest], device=model.device)[None], cache, last_only=True)
    store.put(ids[:longest], cache)
    cold = hasattr(os, "posix_fadvise")
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)  # GPU work is async
    rows = []
    for n in lengths:
        prompt = torch.tensor(ids[:n], device=model.device)[None]  # (1, n)
        recompute = timeit(lambda: (model(prompt, fresh(n), last_only=True), sync()), warmup=1, repeats=repeats)["median"]

        def load() -> None:
            got = store.lookup(ids[:n], device=model.device)
            if got.n_tokens != n:
                raise RuntimeError(f"the store lost a chunk during the measurement: {got.n_tokens} of {n} tokens")
            got.fill(fresh(n))
            sync()

        files = [store.path(k) for k in store.keys_for(ids[:n])]
        row = {"tokens": n, "bytes": sum(os.path.getsize(p) for p in files), "recompute_s": recompute,
               "load_s": timeit(load, warmup=1, repeats=repeats)["median"],
               "load_cold_s": _median_time(load, lambda: _drop_page_cache(files), repeats) if cold else None}
        rows.append(row)
    return rows


def crossover(rows: Sequence[dict], load: str = "load_s") -> int | None:
    """The shortest measured length from which loading (``rows[i][load]``) beats recomputing at
    every longer length too; None if recomputing wins at the longest."""
    best = None
    for row in sorted(rows, key=lambda r: r["tokens"], reverse=True):
        if row[load] is None or row[load] >= row["recompute_s"]:
            break
        best = row["tokens"]
    return best
