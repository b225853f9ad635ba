"""A disk tier for prefixes: chunks of K/V keyed by a hash chain, stored as safetensors files.

A prompt that comes back (the same system prompt, the same document, the next turn of a
chat) has the same keys and values for its shared prefix. A GPU holds only so many, so
serving systems keep a second tier in CPU memory or on an SSD and load a prefix back
instead of recomputing it:

* **LMCache** cuts the token stream into chunks (256 tokens by default), keys each by a
  hash of its tokens *and every token before it* (a prefix hash chain), and stores each
  chunk's K/V for every layer in a storage backend (CPU memory, local disk, a remote
  server); a returning prompt retrieves its longest run of stored chunks.
* **SGLang HiCache** puts a CPU-memory tier and a storage tier below the radix tree of
  GPU pages, and writes pages through or back to them; a hit in a lower tier is loaded
  back onto the GPU before the prefill of the rest.
* **vLLM's offloading connector** (vLLM 0.11+, through the KV connector API that LMCache
  plugs into too) does the same per block, into CPU memory: it saves full blocks and, when the scheduler
  asks how many tokens are already computed, answers from the offloaded store.

`DiskStore` is that idea at its smallest: one safetensors file per chunk, every layer's
keys and values in it, named by the chunk's key. A chunk is safe to serve only if it
is whole and is the chunk asked for, so the store

* writes atomically and checks a sha256 of the tensor bytes on every read
  (`kvlib.distributed.chunkfile`: a partial or damaged file is a miss, and is removed);
* keeps the chunk's token ids and parent key in the metadata and compares them with the
  request, as `kvlib.paged.blocks`' prefix index does: a hash that matches only finds a
  candidate, so a collision or a file copied to the wrong name is a miss;
* evicts least-recently-used chunks under a byte budget shared by every process that
  opens the directory: a hit touches the file's mtime, and a writer deletes the oldest
  files until the new chunk fits;
* keys every chunk by the *kind* of cache that made it (`kvlib.distributed.cachekind`):
  exact, or lossy with its settings. A 2-bit quantized cache's K/V are not an exact
  model's, so they are stored apart and served only to requests that run the same cache;
  a cache that evicts tokens holds no whole prefix and is refused.

Shapes: a chunk file holds ``keys`` and ``values``, each ``(n_layer, H_kv, chunk_tokens, D)``;
a lookup returns per-layer ``(1, H_kv, n, D)`` tensors, batch 1, as a `kvlib.cache.Cache`
takes them. `kvlib.distributed.tiered` runs a model through the store.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache import Cache
from ..validate import an_int, int_at_least, positive_int
from .cachekind import EXACT, MAX_KIND_CHARS, check_kind, chunk_key, fingerprint, resolve_kind
from .chunkfile import SUFFIX, StoreError, decode, encode, temp_writer, write_temp
from .launch import alive

try:  # POSIX: one writer at a time makes room and renames, so the budget holds across processes
    import fcntl
except ImportError:  # Windows: no lock, and the budget may be overshot by racing writers
    fcntl = None


def token_list(tokens: object) -> list[int]:
    """``tokens`` (a list of ints, or a ``(T,)`` / ``(1, T)`` integer tensor) as a list of ints."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must hold integer ids, got dtype {tokens.dtype}")
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be (T,) or (1, T): the store keeps one sequence, got {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be a list of ints or an integer tensor, got {type(tokens).__name__}")
    for t in tokens:
        if an_int("a token id", t) < 0:
            raise ValueError(f"token ids must be non-negative, got {t}")
    return list(tokens)


@dataclass
class Prefix:
    """A lookup's answer: the first ``n_tokens`` tokens' K/V, per layer ``(1, H_kv, n_tokens, D)``,
    made by a cache of ``kind`` (`kvlib.distributed.cachekind`)."""

    n_tokens: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    kind: str = EXACT

    def fill(self, cache: Cache, *, kind: str | None = None) -> Cache:
        """Append this prefix to an empty ``cache`` with ``update``; return it. The cache must be of
        the prefix's kind: lossy K/V never go into an exact cache, nor exact ones into a lossy cache
        (whose later layers would have seen rounded K/V). A cache class that `cache_kind` does not
        know takes an exact prefix, or the prefix of the ``kind`` you name for it."""
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a kvlib Cache, got {type(cache).__name__}")
        try:
            kind = resolve_kind(cache, kind)
        except TypeError:  # a cache class of your own: trusted with exact K/V, as any Cache's update is
            kind = EXACT if self.kind == EXACT else f"a {type(cache).__name__}, of unknown kind"
        if kind != self.kind:
            raise ValueError(f"this prefix was made by a cache of kind {self.kind}; the cache to fill is of "
                             f"kind {kind}: look the prefix up with kind=cache_kind(cache)")
        if cache.seq_len != 0:
            raise ValueError(f"a prefix fills an empty cache; this one holds {cache.seq_len} tokens")
        if self.keys and cache.n_layer != len(self.keys):
            raise ValueError(f"the prefix has {len(self.keys)} layers, the cache {cache.n_layer}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, layer)
        return cache


@dataclass
class PutReport:
    """What a `DiskStore.put` did, chunk by chunk from the start of the prompt."""

    written: int = 0  # new chunk files
    present: int = 0  # already stored (touched, so they count as recently used)
    no_room: int = 0  # full chunks not stored: the budget was taken by this prompt's own earlier chunks


class DiskStore:
    """Chunks of K/V on disk under ``root``, keyed by a hash chain, LRU under ``budget_bytes``.

    ``model_id`` names the weights: the store cannot tell two weight sets of the same shape
    apart, so K/V from another model would be served under the same id (LMCache keys by
    model name for the same reason). ``chunk_tokens`` is the granularity of reuse: only
    whole chunks are stored and loaded. Several processes may open the same ``root``.

    Chunks are stored under the kind of cache that made them (`kvlib.distributed.cachekind`): a
    lookup for one kind never returns another's.

    Errors: a budget below one chunk file (`chunk_file_bytes`: its tensors and its header) is a
    ``ValueError`` here; a write that fails (no space left on the device) raises `StoreError`
    from ``put`` after removing its temp file; a read that fails in any way is a miss, never
    an exception.

    Example

    >>> import tempfile
    >>> from kvlib.distributed.disk import DiskStore
    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> prompt = list(range(1, 41))
    >>> cache = kvlib.DynamicCache(model.config.n_layer)
    >>> logits = model(torch.tensor([prompt]), cache)
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = DiskStore.for_model(root, model, model_id="tiny, seed 0", chunk_tokens=16)
    ...     report = store.put(prompt, cache)  # two whole chunks of 16; the last 8 tokens are not stored
    ...     prefix = store.lookup(prompt + [99])
    >>> report.written, prefix.n_tokens
    (2, 32)
    >>> torch.equal(prefix.keys[0], cache.keys[0][:, :, :32])  # layer 0's keys, back from disk
    True
    """

    def __init__(self, root: str | os.PathLike, *, model_id: str, n_layer: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, chunk_tokens: int = 256, budget_bytes: int = 1 << 30,
                 stale_temp_s: float = 600.0) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty str naming the weights, got {model_id!r}")
        for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                          ("chunk_tokens", chunk_tokens), ("budget_bytes", budget_bytes)):
            positive_int(name, val)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.shape = (n_layer, n_kv_head, chunk_tokens, head_dim)  # of a chunk's keys, and of its values
        self.dtype, self.chunk_tokens, self.budget_bytes = dtype, chunk_tokens, budget_bytes
        self.chunk_bytes = 2 * n_layer * n_kv_head * chunk_tokens * head_dim * dtype.itemsize  # tensors only
        self._layout = (model_id, n_layer, n_kv_head, head_dim, dtype)
        self.fingerprint = fingerprint(*self._layout)  # of exact K/V; a lossy cache's adds its kind
        self.file_bytes = self.chunk_file_bytes()
        if budget_bytes < self.file_bytes:
            raise ValueError(f"budget_bytes={budget_bytes} cannot hold one chunk file of {self.file_bytes} bytes "
                             f"({self.chunk_bytes} bytes of tensors, 2 x {n_layer} layers x {n_kv_head} heads x "
                             f"{chunk_tokens} tokens x {head_dim} x {dtype.itemsize} bytes, and its header); "
                             f"raise budget_bytes to at least {self.file_bytes} or lower chunk_tokens")
        if isinstance(stale_temp_s, bool) or not isinstance(stale_temp_s, (int, float)) or not stale_temp_s > 0:
            raise ValueError(f"stale_temp_s must be a positive number of seconds, got {stale_temp_s!r}")
        self.stale_temp_s = stale_temp_s
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.evictions = self.corrupt = 0  # this process's counts, in chunks
        self.sweep()

    @classmethod
    def for_model(cls, root: str | os.PathLike, model_or_config: object, *, model_id: str,
                  dtype: torch.dtype | None = None, **kwargs) -> "DiskStore":
        """A store shaped for ``model_or_config`` (a `kvlib.Transformer` or a `kvlib.ModelConfig`):
        its layers, KV heads and head_dim, and ``dtype`` (default: the model's; a config's is fp32,
        as a fresh `kvlib.Transformer`'s is). Other keywords go to the constructor."""
        from ..cache import model_layout  # the one rule every for_model follows

        c, dtype, _ = model_layout(model_or_config, dtype)
        return cls(root, model_id=model_id, n_layer=c.n_layer, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
                   dtype=dtype, **kwargs)

    def chunk_file_bytes(self, max_token_id: int = 2**31 - 1) -> int:
        """Bytes of the largest chunk file this store writes for token ids up to ``max_token_id``:
        its tensors (`chunk_bytes`) and its safetensors header (shapes, the fingerprint with the
        longest kind kvlib names, the keys, the ids as JSON). The smallest budget that fits one."""
        empty = torch.zeros(self.shape, dtype=self.dtype)
        fp = fingerprint(*self._layout, "x" * MAX_KIND_CHARS)  # the longest kind there may be
        return len(encode(empty, empty.clone(), fingerprint=fp, key="f" * 64, parent="f" * 64,
                          tokens=json.dumps([max_token_id] * self.chunk_tokens)))

    def _fingerprint(self, kind: str) -> str:
        return fingerprint(*self._layout, check_kind(kind))

    # -- keys and files ---------------------------------------------------------------------------
    def keys_for(self, tokens: object, kind: str = EXACT) -> list[str]:
        """The chain of keys of ``tokens``' full chunks (a partial last chunk has none), made by a
        cache of ``kind``."""
        ids, ct, out, parent, fp = token_list(tokens), self.chunk_tokens, [], None, self._fingerprint(kind)
        for i in range(len(ids) // ct):
            parent = chunk_key(parent, fp, ids[i * ct : (i + 1) * ct])
            out.append(parent)
        return out

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def files(self) -> list[Path]:
        """Every stored chunk file (temp files of writers in flight are not chunks)."""
        return sorted(p for p in self.root.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))

    def __len__(self) -> int:
        return len(self.files())

    @property
    def nbytes(self) -> int:
        """Bytes of every stored chunk file, all processes' writes included."""
        return sum(size for _, size, _ in self._scan())

    def _scan(self) -> list[tuple[int, int, Path]]:
        """``(mtime_ns, size, path)`` of every chunk file, oldest first (LRU order)."""
        out = []
        for p in self.files():
            with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size, p))
        return sorted(out)

    def _touch(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` used now. A later chunk gets an older time than its parent, so under
        LRU a prefix loses its tail first and never its head (a tail without its head is dead)."""
        now = time.time_ns()
        for i, key in enumerate(keys):
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(key), ns=(now - i, now - i))

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Hold the directory's lock: making room and renaming is one step across processes."""
        with open(self.root / ".lock", "a+b") as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield

    # -- writing ----------------------------------------------------------------------------------
    def _make_room(self, need: int, keep: set[str]) -> bool:
        """Delete the least recently used chunks (none in ``keep``) until ``need`` more bytes fit."""
        files = self._scan()
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total + need <= self.budget_bytes:
                break
            if p.name[: -len(SUFFIX)] in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                self.evictions += 1
            total -= size
        return total + need <= self.budget_bytes

    def put(self, tokens: object, kv: Cache | Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            kind: str | None = None) -> PutReport:
        """Store every full chunk of ``tokens`` not stored yet, from ``kv``: a kvlib `Cache` or
        per-layer ``(k, v)`` pairs ``(1, H_kv, S, D)``, whose first ``len(tokens)`` positions
        must be those tokens' keys and values. Raises `StoreError` if a write fails.

        ``kind`` is the kind of cache that made them: by default ``cache_kind(kv)`` for a `Cache`
        (an evicting cache is a ``ValueError``) and ``"exact"`` for pairs."""
        ids, made_by = token_list(tokens), resolve_kind(kv, kind)
        layers = self._layers(kv, len(ids))
        report, keys, ct, fp = PutReport(), self.keys_for(ids, made_by), self.chunk_tokens, self._fingerprint(made_by)
        for i, key in enumerate(keys):
            if self.path(key).exists():
                report.present += 1
                continue
            k = torch.stack([lk[0, :, i * ct : (i + 1) * ct] for lk, _ in layers]).cpu().contiguous()  # (L, H, ct, D)
            v = torch.stack([lv[0, :, i * ct : (i + 1) * ct] for _, lv in layers]).cpu().contiguous()  # (L, H, ct, D)
            data = encode(k, v, fingerprint=fp, key=key, parent=keys[i - 1] if i else "",
                          tokens=json.dumps(ids[i * ct : (i + 1) * ct]))
            try:
                if len(data) > self.budget_bytes:
                    raise StoreError(errno.EFBIG, f"a chunk file of {len(data)} bytes exceeds "
                                                  f"budget_bytes={self.budget_bytes}")
                if not self._store(key, data, keep=set(keys[: i + 1])):
                    report.no_room = len(keys) - i
                    break
            except StoreError as e:
                e.report = report  # the chunks before this one are stored, whole
                raise
            report.written += 1
        self._touch(keys[: report.written + report.present])
        return report

    def _store(self, key: str, data: bytes, keep: set[str]) -> bool:
        """Write one chunk file atomically, after making room; False if only chunks in ``keep`` are left."""
        tmp = write_temp(self.root, key, data)
        try:
            with self._lock():
                if not self._make_room(len(data), keep):
                    return False
                os.replace(tmp, self.path(key))  # atomic: readers see the old name's file or the whole new one
            return True
        except OSError as e:
            raise StoreError(e.errno, f"could not store chunk {key[:12]}... in {self.root}: {e}") from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # still there only if it was not renamed

    def _layers(self, kv: object, n_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``kv`` as per-layer ``(k, v)``, each checked against the store's shape and ``n_tokens``."""
        L, H, _, D = self.shape
        if isinstance(kv, Cache):
            kv = [kv.layer_kv(layer) for layer in range(kv.n_layer)]
        if not isinstance(kv, (list, tuple)) or len(kv) != L:
            got = len(kv) if isinstance(kv, (list, tuple)) else type(kv).__name__
            raise ValueError(f"kv must be a Cache or {L} per-layer (k, v) pairs, got {got}")
        for layer, pair in enumerate(kv):
            if pair is None or not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"layer {layer} of kv holds no (k, v) pair (an empty cache layer?)")
            for name, t in zip("kv", pair):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"layer {layer}'s {name} must be a tensor, got {type(t).__name__}")
                if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != H or t.shape[3] != D or t.shape[2] < n_tokens:
                    raise ValueError(f"layer {layer}'s {name} must be (1, {H}, >= {n_tokens}, {D}) for "
                                     f"{n_tokens} tokens, got {tuple(t.shape)}")
                if t.dtype != self.dtype:
                    raise TypeError(f"layer {layer}'s {name} is {t.dtype}; this store holds {self.dtype}")
        return list(kv)

    # -- reading ----------------------------------------------------------------------------------
    def _read(self, key: str, parent: str | None, tokens: list[int],
              fp: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chunk stored under ``key``, if it is whole and is exactly the one asked for (made by
        the weights and cache kind of fingerprint ``fp``); else None."""
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                data, ino = f.read(), os.fstat(f.fileno()).st_ino
        except OSError:  # not stored, or evicted by another process a moment ago
            return None
        try:
            meta, k, v = decode(data)  # whole and unchanged, or ValueError
            whole = (meta["fingerprint"] == fp and meta["key"] == key
                     and k.shape == v.shape == self.shape and k.dtype == v.dtype == self.dtype)
        except ValueError:
            whole = False
        if not whole:
            self.corrupt += 1
            with contextlib.suppress(OSError):
                if os.stat(p).st_ino == ino:  # remove the damaged file, not one a writer just put there
                    p.unlink()
            return None
        if meta["tokens"] != tokens or meta["parent"] != (parent or ""):
            return None  # a whole chunk, of another prefix: a hash collision, or a file under a wrong name
        return k, v

    def lookup(self, tokens: object, *, kind: str = EXACT, max_tokens: int | None = None,
               device: torch.device | str | None = None) -> Prefix:
        """The longest stored prefix of ``tokens`` in whole chunks (at most ``max_tokens`` tokens),
        made by a cache of ``kind`` (default ``"exact"``; pass ``cache_kind(cache)`` for the cache
        you will fill).

        Each chunk is read, its checksum, tokens and parent checked; the first that fails
        ends the prefix. Never raises for what is on disk: a damaged file is a miss.
        """
        ids, fp = token_list(tokens), self._fingerprint(kind)
        keys = self.keys_for(ids, kind)
        if max_tokens is not None:
            keys = keys[: int_at_least("max_tokens", max_tokens, 0) // self.chunk_tokens]
        ks, vs, ct = [], [], self.chunk_tokens
        for i, key in enumerate(keys):
            got = self._read(key, keys[i - 1] if i else None, ids[i * ct : (i + 1) * ct], fp)
            if got is None:
                self.misses += 1
                break
            self.hits += 1
            ks.append(got[0])
            vs.append(got[1])
        if not ks:
            return Prefix(0, kind=kind)
        self._touch(keys[: len(ks)])
        k = torch.cat(ks, dim=2).to(device or "cpu")  # (L, H, n, D)
        v = torch.cat(vs, dim=2).to(device or "cpu")
        return Prefix(len(ks) * ct, [k[layer][None] for layer in range(len(k))],  # L x (1, H, n, D)
                      [v[layer][None] for layer in range(len(v))], kind)

    # -- housekeeping -----------------------------------------------------------------------------
    def sweep(self, max_age_s: float | None = None) -> int:
        """Remove temp files left by writers that died: their process is gone, or they are older
        than ``max_age_s`` (default ``stale_temp_s``). Returns how many were removed."""
        age = self.stale_temp_s if max_age_s is None else max_age_s
        removed, now = 0, time.time()
        for p in self.root.iterdir():
            pid = temp_writer(p)
            if pid is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime > age or not alive(pid):
                    p.unlink()
                    removed += 1
        return removed

