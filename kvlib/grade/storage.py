"""Graders of what a cache keeps: the size formula, the cache protocol, a window, and a fork's block tables."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence

import torch

from ..cache import Cache
from ..check import PROPERTIES, CacheCheckError, _held_tensors, _storage_key, check_cache, property_name, storage_bytes
from ..config import PRESETS, ModelConfig
from ..memory import kv_cache_bytes
from ..paged.blocks import BlockAllocator, BlockTableError, check_block_tables
from ..validate import positive_int
from .result import Grade, as_ints, fail, need_callable, raised

__all__ = ["grade_cache", "grade_fork", "grade_kv_formula", "grade_window_cache"]


# -- the size formula ------------------------------------------------------------------------------
def _rank(c: ModelConfig) -> int:
    """Teaching order: plain MHA, GQA, an explicit head_dim, window/chunked layers, latent/shared layers."""
    kinds = {k.kind for k in c.layer_kinds()}
    if kinds & {"latent", "shared"}:
        return 4
    if kinds & {"window", "chunked"}:
        return 3
    if c.d_model % c.n_head or c.head_dim != c.d_model // c.n_head:
        return 2
    return 0 if c.n_kv_head == c.n_head else 1


def _configs(configs: object) -> dict[str, ModelConfig]:
    if configs is None:
        return {name: PRESETS[name] for name in sorted(PRESETS, key=lambda n: _rank(PRESETS[n]))}  # stable sort
    if isinstance(configs, Mapping):
        for name, c in configs.items():
            if not isinstance(name, str) or not isinstance(c, ModelConfig):
                raise TypeError(f"configs maps a model's name (a str) to its ModelConfig, got {name!r}: "
                                f"{type(c).__name__}")
        out = dict(configs)
    elif isinstance(configs, (list, tuple)):
        unknown = [n for n in configs if not isinstance(n, str) or n not in PRESETS]
        if unknown:
            raise ValueError(f"configs names no preset: {unknown}; the presets are {sorted(PRESETS)}")
        out = {name: PRESETS[name] for name in configs}
    else:
        raise TypeError(f"configs must be None, a list of preset names or a dict name -> ModelConfig, "
                        f"got {type(configs).__name__}")
    if not out:
        raise ValueError("configs is empty: there is no model to grade on")
    return out


_KINDS = {"window": "windowed", "chunked": "chunked", "latent": "latent", "shared": "shared"}


def _facts(c: ModelConfig) -> str:
    """The numbers that size ``c``'s cache: ``"62 layers, n_head 32, ...; 52 of 62 layers windowed (window 1024)"``."""
    out = f"{c.n_layer} layers, n_head {c.n_head}, n_kv_head {c.n_kv_head}, d_model {c.d_model}, head_dim {c.head_dim}"
    sizes = {"window": "window {}", "chunked": "chunk {}", "latent": "width {}", "shared": ""}
    for kind, adjective in _KINDS.items():
        some = [k for k in c.layer_kinds() if k.kind == kind]
        if some:
            each = sorted({sizes[kind].format(k.size) + (f" with {k.sinks} sinks" if k.sinks else "") for k in some})
            out += f"; {len(some)} of {c.n_layer} layers {adjective}" + (f" ({', '.join(each)})" if each[0] else "")
    return out


def grade_kv_formula(fn: Callable[[ModelConfig, int], int], configs: object = None,
                     lengths: Sequence[int] = (1, 4096, 131072)) -> Grade:
    """``fn(config, seq_len) -> int``, the bytes of K and V for one sequence at 2 bytes a number
    (bf16), against `kvlib.memory.kv_cache_bytes` ``(config, seq_len, 1, "bf16")``.

    ``configs``: None (every preset of `kvlib.PRESETS`, plain MHA first, then GQA, then explicit
    ``head_dim``, window and chunked layers, latent layers), a list of preset names, or a dict
    name -> `ModelConfig` for a model that is not a preset. Every model at every length in order.
    """
    need_callable("fn", fn, "a function fn(config, seq_len) -> int")
    models = _configs(configs)
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise TypeError(f"lengths must be a non-empty list or tuple of ints, got {lengths!r}")
    for n in lengths:
        positive_int("each length", n)
    checked: list[str] = []
    for name, config in models.items():
        for n in lengths:
            checked.append(f"{name} at {n}")
            want, on = kv_cache_bytes(config, n, 1, "bf16"), f"{name} ({_facts(config)}) at seq_len {n}"
            try:
                got = fn(config, n)
            except Exception as e:
                return fail("kv_formula", checked, "kv bytes", on, f"your function {raised(e)}")
            if not isinstance(got, int) or isinstance(got, bool):
                return fail("kv_formula", checked, "kv bytes", on,
                            f"your function returned {type(got).__name__} {got!r}, not an int number of bytes")
            if got != want:
                return fail("kv_formula", checked, "kv bytes", on, f"your function gives {got:,} bytes, "
                            f"kvlib.memory.kv_cache_bytes {want:,} ({got / want:.2f}x as much)")
    return Grade("kv_formula", True, tuple(checked))


# -- the cache protocol ------------------------------------------------------------------------------
def _property_at(err: BaseException) -> str | None:
    """The `kvlib.check` property that was running when ``err`` was raised (its outermost frame)."""
    names = {prop.__name__: property_name(prop) for prop in PROPERTIES}
    for frame, _ in traceback.walk_tb(err.__traceback__):
        if frame.f_globals.get("__name__") == "kvlib.check" and frame.f_code.co_name in names:
            return names[frame.f_code.co_name]
    return None


def grade_cache(make: Callable[..., Cache], **check_cache_kwargs) -> Grade:
    """`kvlib.check.check_cache` on ``make(n_layer, batch, n_kv_head, head_dim, dtype)``'s caches: its
    `CacheCheckError` becomes the failure (its message as it is), an exception of the cache's own
    too (``"[crop and reset] your cache raised ..."``). Keywords go to ``check_cache``."""
    started = False

    def factory(*args):
        nonlocal started
        started = True
        return make(*args)

    if not callable(make) or isinstance(make, type):
        check_cache(make, **check_cache_kwargs)  # raises its TypeError, naming what it got
    try:
        return Grade("cache", True, tuple(check_cache(factory, **check_cache_kwargs)))
    except Exception as e:
        if not started:  # check_cache refused its own arguments: the grader's caller's mistake
            raise
        prop, skip = _property_at(e), check_cache_kwargs.get("not_applicable") or {}
        names = [n for n in map(property_name, PROPERTIES) if n not in skip]
        checked = names[: names.index(prop) + 1] if prop in names else names
        why = str(e) if isinstance(e, CacheCheckError) else f"[{prop}] your cache {raised(e)}"
        return Grade("cache", False, tuple(checked), why)


# -- a window cache ----------------------------------------------------------------------------------
WINDOW_PROPERTIES = ("attends to the last W", "holds at most W", "tokens seen")


def _token_kv(t: int, layer: int, B: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``t``'s keys and values in ``layer``, ``(B, H, 1, D)`` each, as a model gives them: views into
    one ``(B, 1, 3·H·D)`` fused projection. Seeded per token and layer: every token's rows differ."""
    qkv = torch.randn(B, 1, 3 * H * D, generator=torch.Generator().manual_seed(1000 * layer + t))
    return tuple(qkv[..., i * H * D:(i + 1) * H * D].view(B, 1, H, D).transpose(1, 2) for i in (1, 2))


def _which(got: torch.Tensor, fed: torch.Tensor, first: dict[float, int]) -> list[int | None]:
    """Which fed token each row of ``got`` ``(B, H, S, D)`` is: looked up by its first number in ``first``
    (number -> token), then compared whole with that token's rows in ``fed`` ``(B, H, N, D)``; None: none."""
    ids = [first.get(x) for x in got[0, 0, :, 0].tolist()]
    at = torch.tensor([0 if i is None else i for i in ids], dtype=torch.long)  # (S,)
    same = (got.detach().to("cpu", fed.dtype) == fed[:, :, at]).all(-1).all(1).all(0).tolist()  # (S,)
    return [i if ok else None for i, ok in zip(ids, same)]


def _tokens(rows: list[int | None]) -> str:
    """``"tokens 1..8"``, or the rows as a list (``?``: a row that equals no token fed)."""
    if None not in rows:
        rows = sorted(rows)
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return f"tokens {rows[0]}..{rows[-1]}" if len(rows) > 1 else f"token {rows[0]}"
    shown = ", ".join("?" if r is None else str(r) for r in rows[:12]) + (", ..." if len(rows) > 12 else "")
    return f"tokens [{shown}] ({len(rows)} rows{'; ?: a row equal to no token fed' if None in rows else ''})"


def _window_rows(out: object, fed: dict[str, tuple[torch.Tensor, dict]], n: int, W: int) -> str | None:
    """What is wrong with an update's return value ``out`` after ``n`` tokens; None if nothing. ``fed``: for
    keys and for values, every token's rows ``(B, H, N, D)`` and a map from a row's first number to its token."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        return f"update returned {type(out).__name__}, not (keys, values) tensors"
    B, H, _, D = fed["keys"][0].shape
    want, rows = list(range(max(0, n - W), n)), {}
    for what, got in zip(("keys", "values"), out):
        if got.dim() != 4 or tuple(got.shape[:2]) != (B, H) or got.shape[3] != D:
            return f"update returned {what} of shape {tuple(got.shape)}, not ({B}, {H}, S, {D})"
        rows[what] = _which(got, *fed[what])
        if None in rows[what] or sorted(rows[what]) != want:
            return f"update returned the {what} of {_tokens(rows[what])}; the last {len(want)} are {_tokens(want)}"
    if rows["keys"] != rows["values"]:
        return f"update returned keys and values of different tokens, row by row: {rows['keys']}, {rows['values']}"
    return None


def grade_window_cache(make: Callable[..., Cache], window: int, tokens: int | None = None) -> Grade:
    """A window cache from ``make(n_layer, batch, n_kv_head, head_dim, dtype)``, fed ``tokens`` (default
    ``4 * window``) decode steps of one token (2 layers, batch 1, 2 KV heads of 16, float32, each token's
    values its own). After every update, in this order of report:

    - "attends to the last W": ``update`` returns the last ``min(seen, window)`` tokens' keys and values,
      compared as a set of rows (a decode query sees every key it gets: their order does not matter);
    - "holds at most W": `kvlib.check.storage_bytes` is at most ``window`` tokens' K and V for all layers;
      integer tensors (positions, indices) may add up to one int64 per held slot per KV head per layer;
    - "tokens seen": ``cache.tokens_seen`` (``get_seq_length()`` for a cache without it) counts every
      token fed, evicted or not (a kvlib cache's ``get_seq_length`` counts what it holds).
    """
    need_callable("make", make, "a function make(n_layer, batch, n_kv_head, head_dim, dtype) -> a cache")
    W = positive_int("window", window)
    N = 4 * W if tokens is None else positive_int("tokens", tokens)
    L, B, H, D = 2, 1, 2, 16
    per_token, slack = L * 2 * B * H * D * 4, L * B * H * W * 8  # one token's K and V in every layer; int64 slots
    on = f"{N} tokens fed one at a time (window {W}, {L} layers, batch {B}, {H} KV heads of {D}, float32)"
    first: dict[str, str] = {}  # property -> its first failure
    fed = [{what: (torch.zeros(B, H, N, D), {}) for what in ("keys", "values")} for _ in range(L)]  # per layer
    try:
        cache = make(L, B, H, D, torch.float32)
    except Exception as e:
        first[WINDOW_PROPERTIES[0]] = f"make({L}, {B}, {H}, {D}, torch.float32) {raised(e)}"
    for t in range(N if not first else 0):
        prop = WINDOW_PROPERTIES[0]
        try:
            for layer in range(L):
                k, v = _token_kv(t, layer, B, H, D)
                for (rows, by_first), x in zip(fed[layer].values(), (k, v)):
                    rows[:, :, t] = x[:, :, 0]
                    by_first[float(x[0, 0, 0, 0])] = t
                out = cache.update(k, v, layer)
                why = None if prop in first else _window_rows(out, fed[layer], t + 1, W)
                if why:
                    first[prop] = f"after {t + 1} token{'s' if t else ''}, layer {layer}: {why}"
            prop = WINDOW_PROPERTIES[1]
            if prop not in first:
                held = storage_bytes(cache)
                ints = {_storage_key(x): x.untyped_storage().nbytes() for x in _held_tensors(cache)
                        if not x.is_floating_point()}
                allowed = min(sum(ints.values()), slack)
                if held > W * per_token + allowed:
                    extra = f", plus {allowed:,} bytes of integer bookkeeping" if allowed else ""
                    floats = {id(x): x for x in _held_tensors(cache) if x.is_floating_point()}.values()
                    shown = sum(x.numel() * x.element_size() for x in floats)  # what the tensors themselves span
                    views = (f"; the tensors it holds show only {shown / per_token:.3g} tokens' worth: they are views "
                             "into larger storage, which stays alive with them") if shown < held - allowed else ""
                    first[prop] = (f"after {t + 1} token{'s' if t else ''}, the cache keeps {held:,} bytes of storage "
                                   f"alive (kvlib.check.storage_bytes): it holds {(held - allowed) / per_token:.3g} "
                                   f"tokens' worth, the window is {W} ({W * per_token:,} bytes{extra}){views}")
            prop = WINDOW_PROPERTIES[2]
            if prop not in first:
                seen = getattr(cache, "tokens_seen", None)
                said = "cache.tokens_seen"
                if seen is None:
                    seen, said = cache.get_seq_length(), "cache.get_seq_length()"
                if seen != t + 1:
                    also = f" (get_seq_length() is {cache.get_seq_length()})" if said == "cache.tokens_seen" else ""
                    first[prop] = f"after {t + 1} token{'s' if t else ''} fed, {said} is {seen!r}{also}"
        except Exception as e:
            first.setdefault(prop, f"after {t + 1} token{'s' if t else ''}, your cache {raised(e)}")
            break
        if len(first) == len(WINDOW_PROPERTIES):
            break
    for i, prop in enumerate(WINDOW_PROPERTIES):
        if prop in first:
            return fail("window_cache", list(WINDOW_PROPERTIES[: i + 1]), prop, on, first[prop])
    return Grade("window_cache", True, WINDOW_PROPERTIES)


# -- forking a paged sequence ------------------------------------------------------------------------
def grade_fork(fork: Callable[[BlockAllocator, list[int]], list[int]]) -> Grade:
    """``fork(allocator, parent_table) -> child_table``: the child starts as the parent's copy, and both
    will append. A `kvlib.paged.BlockAllocator` of 8 blocks of 4 slots; the parent holds 10 tokens in 3
    blocks (the last partial). `kvlib.paged.check_block_tables` runs after the fork (on both tables),
    after the parent finished (one ``free`` per table entry; the child's table) and after the child
    finished (no table: every block free). After the fork, besides: the partial last block is not the
    parent's (both will write into it), and the full ones are the parent's (shared, not copied)."""
    need_callable("fork", fork, "a function fork(allocator, parent_table) -> child_table")
    pool = BlockAllocator(num_blocks=8, block_size=4)
    pool.reorder_free([5, 2, 7, 0, 3, 6, 1, 4])  # scrambled, as a busy pool's free list is
    parent = [pool.allocate() for _ in range(3)]
    on = f"a parent of 10 tokens in blocks {parent} (block size 4, the last block partial), a pool of 8 blocks"
    checked = ["after the fork"]

    def tables(step: str, held: dict[str, list[int]]) -> Grade | None:
        try:
            check_block_tables(pool, held)
        except BlockTableError as e:
            return fail("fork", checked, "block tables agree with reference counts", on, f"{step}: {e}")
        return None

    try:
        out = fork(pool, list(parent))
    except Exception as e:
        return fail("fork", checked, "block tables agree with reference counts", on,
                    f"after the fork: your fork {raised(e)}")
    child = as_ints(out)
    if child is None or len(child) != len(parent):
        return fail("fork", checked, "block tables agree with reference counts", on, f"after the fork: your fork "
                    f"returned {out!r}, not the child's table of {len(parent)} block ids")
    if (bad := tables("after the fork", {"parent": parent, "child": child})) is not None:
        return bad
    checked.append("copy on write")
    if child[-1] == parent[-1]:
        return fail("fork", checked, "copy on write", on, f"after the fork: both tables end in block {child[-1]}, "
                    f"the partial block both sequences append to")
    checked.append("full blocks shared")
    if child[:-1] != parent[:-1]:
        return fail("fork", checked, "full blocks shared", on, f"after the fork: the child's full blocks are "
                    f"{child[:-1]}, the parent's {parent[:-1]}")
    for step, freed, left in (("after the parent finished", parent, {"child": child}),
                              ("after the child finished", child, {})):
        checked.append(step)
        try:
            for block in freed:
                pool.free(block)
        except Exception as e:
            return fail("fork", checked, "block tables agree with reference counts", on,
                        f"{step}: freeing its blocks (one free per table entry) {raised(e)}")
        if (bad := tables(step, left)) is not None:
            return bad
    if pool.num_free != pool.num_blocks:
        return fail("fork", checked, "block tables agree with reference counts", on,
                    f"after the child finished: {pool.num_free} of {pool.num_blocks} blocks are free")
    return Grade("fork", True, tuple(checked))
