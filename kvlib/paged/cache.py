"""The paged KV cache: per-layer block pools, block tables, copy-on-write and prefix sharing.

* A sequence's *block table* maps its logical block ``i`` (tokens ``i*block_size`` to ``(i+1)*block_size - 1``) to a
  physical block of the pool (`kvlib.paged.BlockAllocator` hands them out). Token ``t`` lives in *slot* ``table[t //
  block_size] * block_size + t % block_size`` (`slot_mapping`).
* `PagedCache` holds one key pool and one value pool per layer, ``keys[layer]`` and ``values[layer]``, each
  ``(num_blocks, block_size, kv_heads, head_dim)``, and the tables.
* ``with cache.step(sids, tokens) as batch: logits = model(tokens, batch)`` runs one forward over several sequences
  of different lengths. The `PagedBatch` is an ordinary `kvlib.Cache` (in `kvlib.paged.batch`): it gathers each
  sequence's keys through its table and supplies every sequence's own positions and causal mask. ``cache.step(sids,
  rows, packed=True)`` takes rows of different lengths and runs them as one packed row, a `PackedPagedBatch` (the
  serving engine's step). The step is *committed* (blocks reserved, the new K/V written into their slots, full
  blocks sealed) when the ``with`` block ends without an error, or by ``batch.commit()`` (inside the block or after
  it: either way it is stored once); a forward that raises halfway leaves the cache exactly as it was. Committing is
  the only way a step changes the pool, and only the batch can ask for it: its ``commit`` refuses, before changing
  anything, a batch that is stale, incomplete or already committed.

The step's life (open, staged, committed or dropped) is `kvlib.paged.batch`'s; this module keeps the tables and the
pools, and stores a checked step (`PagedCache._commit`, which only a batch calls). The batch module never imports
this one.

Nothing here is global: block tables, slots and positions are passed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache import model_layout
from ..config import ModelConfig
from ..validate import positive_int
from .batch import PackedPagedBatch, PagedBatch, gather, slot_mapping
from .blocks import BlockAllocator, OutOfBlocks, chain_hash

if TYPE_CHECKING:
    from ..model import Transformer

__all__ = ["PagedCache"]


def _token_rows(tokens: torch.Tensor | Sequence[Sequence[int]], batch: int, ragged: bool = False) -> list[list[int]]:
    """``(batch, T)`` token ids as lists of ints (a tensor is read back to the host once). With
    ``ragged`` the rows may differ in length (a packed step), each holding at least one token."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be int ids, got {tokens.dtype}")
        rows = tokens.tolist() if tokens.dim() == 2 else None
    else:
        rows = [list(r) for r in tokens]
        bad = [t for r in rows for t in r if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise TypeError(f"tokens must be int ids, got {type(bad[0]).__name__} {bad[0]!r}")
    lengths = None if rows is None else [len(r) for r in rows]
    if ragged and (rows is None or len(rows) != batch or min(lengths, default=0) < 1):
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else lengths
        raise ValueError(f"a packed step takes one non-empty token list per sequence ({batch}), got lengths {got}")
    if not ragged and (rows is None or len(rows) != batch or not rows[0] or any(n != lengths[0] for n in lengths)):
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else lengths
        raise ValueError(f"tokens must be (batch={batch}, T >= 1), got {got}; steps of different lengths "
                         "go in one packed step: step(sids, rows, packed=True)")
    return rows


# -- the paged cache ----------------------------------------------------------------------------------
@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)  # the block table
    tokens: list[int] = field(default_factory=list)  # ids whose K/V are stored, for sealing full blocks


class PagedCache:
    """Per-layer block pools shared by many sequences, each with its own block table.

    Lifecycle: ``sid, cached = cache.add(prompt)`` starts a sequence (reusing cached prompt blocks);
    ``with cache.step([sid, ...], tokens) as b: model(tokens, b)`` appends; ``cache.fork(sid)`` shares a
    sequence copy-on-write; ``cache.truncate(sid, n)`` rolls it back; ``cache.free(sid)`` ends it.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.PagedCache.for_model(model.config, num_blocks=8, block_size=4)
    >>> sid, cached = cache.add([1, 2, 3, 4, 5])  # nothing cached yet: run all five
    >>> with cache.step([sid], torch.tensor([[1, 2, 3, 4, 5]])) as batch:
    ...     logits = model(torch.tensor([[1, 2, 3, 4, 5]]), batch)
    >>> cache.num_tokens(sid), cache.block_table(sid)  # five tokens in two blocks of four
    (5, [0, 1])
    >>> cache.add([1, 2, 3, 4, 9])  # a second sequence finds the first full block cached
    (1, 4)
    """

    def __init__(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
        hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash,
    ) -> None:
        for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim)):
            positive_int(name, val)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.allocator = BlockAllocator(num_blocks, block_size, hash_fn=hash_fn)
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        shape = (num_blocks, block_size, n_kv_head, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.copies = 0  # copy-on-write block copies so far
        self.version = 0  # bumped by every change to the tables; a PagedBatch made before it is stale
        self._open: PagedBatch | None = None  # the step being run, until it is committed or dropped

    @classmethod
    def for_model(
        cls,
        model_or_config: "Transformer | ModelConfig",
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs,
    ) -> "PagedCache":
        """A cache shaped for a `kvlib.Transformer` or a `kvlib.ModelConfig`: its layers, KV heads
        and head_dim, in the model's dtype and on its device unless ``dtype``/``device`` say
        otherwise (a config has neither: fp32 on the CPU). ``kwargs``: ``prefix_caching``, ``hash_fn``."""
        config, dtype, device = model_layout(model_or_config, dtype, device)
        return cls(config.n_layer, config.n_kv_head, config.head_dim, num_blocks=num_blocks, block_size=block_size,
                   dtype=dtype, device=device, **kwargs)

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return 2 * self.n_layer * self.keys[0][0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool, used or not."""
        return self.num_blocks * self.block_bytes

    @property
    def open_step(self) -> PagedBatch | PackedPagedBatch | None:
        """The step `step` handed out that is neither committed nor dropped yet (None if none)."""
        return self._open

    # -- sequences ----------------------------------------------------------------------------------
    def _seq(self, sid) -> _Seq:
        if sid not in self.seqs:
            raise IndexError(f"no sequence {sid!r} in this cache (live: {sorted(self.seqs)})")
        return self.seqs[sid]

    def __len__(self) -> int:
        return len(self.seqs)

    def num_tokens(self, sid: int) -> int:
        """Tokens whose keys and values sequence ``sid`` holds (`Cache.seq_len` for one sequence)."""
        return len(self._seq(sid).tokens)

    def block_table(self, sid: int) -> list[int]:
        return list(self._seq(sid).blocks)

    def tokens(self, sid: int) -> list[int]:
        return list(self._seq(sid).tokens)

    def add(self, prompt: Sequence[int] = ()) -> tuple[int, int]:
        """Start a sequence. Returns ``(sid, cached)``: the first ``cached`` prompt tokens' K/V are already in
        the pool (prefix-cache hits), so run only ``prompt[cached:]``. At least the last prompt token is always
        left to run, even when every block hits: its logits are what the next token is sampled from."""
        self._settle()
        prompt = [int(t) for t in prompt]
        seq, bs = _Seq(), self.block_size
        if self.prefix_caching:
            parent = None
            for i in range(len(prompt) // bs):
                block = self.allocator.lookup(parent, prompt[i * bs : (i + 1) * bs])
                if block is None:
                    break  # a chain: after the first miss nothing later can hit
                seq.blocks.append(block)
                parent = block
            cached = min(len(seq.blocks) * bs, max(len(prompt) - 1, 0))
            seq.tokens = prompt[:cached]  # a fully cached prompt ends inside its last (sealed) block: copy-on-write
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = seq
        self.version += 1
        return sid, len(seq.tokens)

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid``; the first write to a shared block copies it."""
        self._settle()
        parent = self._seq(sid)
        held = parent.blocks[: -(-len(parent.tokens) // self.block_size)]  # blocks holding written tokens only
        for block in held:
            self.allocator.share(block)
        child = self._next_id
        self._next_id += 1
        self.seqs[child] = _Seq(list(held), list(parent.tokens))
        self.version += 1
        return child

    def free(self, sid: int) -> None:
        """End a sequence: drop its ownership of every block, last block first (evicted first)."""
        self._settle()
        seq = self._seq(sid)
        for block in reversed(seq.blocks):
            self.allocator.free(block)
        del self.seqs[sid]
        self.version += 1

    def truncate(self, sid: int, n: int) -> None:
        """Keep the first ``n`` tokens of a sequence (roll back a draft, or re-time a step).

        Blocks past the new end are freed; a kept block that is shared or sealed is
        copied before it is written again, so no other sequence sees the rollback.
        """
        self._settle()
        seq = self._seq(sid)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(seq.tokens):
            raise IndexError(f"cannot truncate sequence {sid} of {len(seq.tokens)} tokens to {n!r}")
        keep = -(-n // self.block_size)
        for block in reversed(seq.blocks[keep:]):
            self.allocator.free(block)
        del seq.blocks[keep:]
        del seq.tokens[n:]
        self.version += 1

    # -- making room --------------------------------------------------------------------------------
    def _writable_tail(self, seq: _Seq) -> bool:
        """Can the next token be written into the sequence's last block in place?"""
        i = len(seq.tokens) // self.block_size
        if i >= len(seq.blocks):
            return True  # the next token starts a block not allocated yet
        block = seq.blocks[i]  # partly filled, or the sealed block a fully cached prompt ends inside
        return self.allocator.refcount[block] == 1 and not self.allocator.is_sealed(block)

    def blocks_needed(self, sids: Sequence[int], n_new: int | Sequence[int]) -> int:
        """Blocks a step that appends ``n_new`` tokens to each of ``sids`` would take from the free
        list; ``n_new`` is one count for all, or one per sequence (a packed step)."""
        counts = [n_new] * len(sids) if isinstance(n_new, int) else list(n_new)
        if len(counts) != len(sids):
            raise ValueError(f"{len(counts)} token counts for {len(sids)} sequences")
        need, tails = 0, {}
        for sid, n in zip(sids, counts):
            seq = self._seq(sid)
            if n <= 0:
                continue  # writes nothing: takes nothing
            want = -(-(len(seq.tokens) + n) // self.block_size)  # ceil
            need += max(want - len(seq.blocks), 0)
            i = len(seq.tokens) // self.block_size
            if i < len(seq.blocks):
                tails[seq.blocks[i]] = tails.get(seq.blocks[i], 0) + 1  # owners writing this block now
        for block, k in tails.items():
            if self.allocator.is_sealed(block) or self.allocator.refcount[block] > k:
                need += k  # every writer copies it
            else:
                need += k - 1  # all its owners write: the last one finds itself alone and writes in place
        return need

    def _copy_on_write(self, seq: _Seq) -> None:
        i = len(seq.tokens) // self.block_size
        old = seq.blocks[i]
        new = self.allocator.allocate()
        for pool in self.keys + self.values:
            pool[new].copy_(pool[old])  # the whole block: its first tokens are this sequence's too
        self.allocator.free(old)
        seq.blocks[i] = new
        self.copies += 1

    def _reserve(self, seq: _Seq, n_new: int) -> int:
        """Make room for ``n_new`` tokens; returns the blocks copied on write (0 or 1)."""
        copied = 0
        if not self._writable_tail(seq):
            self._copy_on_write(seq)
            copied = 1
        while len(seq.blocks) * self.block_size < len(seq.tokens) + n_new:
            seq.blocks.append(self.allocator.allocate())
        return copied

    def step(
        self, sids: Sequence[int], tokens: torch.Tensor | Sequence[Sequence[int]], *, packed: bool = False,
        varlen: bool = True) -> PagedBatch | PackedPagedBatch:
        """The `Cache` one model forward runs against, for ``tokens`` after sequences ``sids``.

        ``tokens`` is ``(B, T)``: the sequences may hold different numbers of tokens, and the `PagedBatch`
        supplies each one's positions and mask. With ``packed=True`` it is one token list per sequence, of any
        lengths (a decode token for one, a prompt chunk for another), and the `PackedPagedBatch` runs them as
        one row ``(1, N)``, each sequence over its own keys (``varlen=False``: the row under a block-diagonal
        mask). Use it as ``with cache.step(sids, tokens) as batch:`` so the step is committed when the forward
        succeeds. Raises `OutOfBlocks`, before anything changes, if the pool cannot hold the step.

        Example

        >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
        >>> cache = kvlib.PagedCache.for_model(model.config, num_blocks=8, block_size=4)
        >>> a, _ = cache.add([1, 2, 3])
        >>> b, _ = cache.add([4, 5, 6])
        >>> with cache.step([a, b], torch.tensor([[1, 2, 3], [4, 5, 6]])) as batch:
        ...     logits = model(torch.tensor([[1, 2, 3], [4, 5, 6]]), batch)
        >>> with cache.step([a, b], torch.tensor([[7], [8]])) as batch:  # one decode token each
        ...     step = model(torch.tensor([[7], [8]]), batch)
        >>> torch.allclose(step[1, -1], model(torch.tensor([[4, 5, 6, 8]]))[0, -1], atol=1e-5)
        True
        """
        self._settle()
        sids = list(sids)
        if not sids:
            raise ValueError("step needs at least one sequence")
        if len(set(sids)) != len(sids):
            raise ValueError(f"a sequence appears twice in one step: {sids}")
        if not isinstance(packed, bool) or not isinstance(varlen, bool):
            raise TypeError(f"packed and varlen must each be True or False, got packed={packed!r}, varlen={varlen!r}")
        seqs = [self._seq(s) for s in sids]
        rows = _token_rows(tokens, len(sids), ragged=packed)  # host ints: the tables and prefix index live on the host
        need = self.blocks_needed(sids, [len(r) for r in rows])
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"this step needs {need} blocks but only {self.allocator.num_free} are free")
        lengths = [len(s.tokens) for s in seqs]
        self._open = (PackedPagedBatch(self, sids, rows, lengths, varlen) if packed
                      else PagedBatch(self, sids, rows, lengths))
        return self._open

    def _settle(self) -> None:
        """Before any change: a step that ran every layer must have been committed; any other is dropped."""
        batch, self._open = self._open, None
        if batch is not None and batch.complete and not batch.committed:
            self._open = batch
            raise ValueError(
                "the last step ran every layer but was never committed: use `with cache.step(...) as batch:` "
                "or call batch.commit() after the forward"
            )

    def _commit(self, batch: PagedBatch | PackedPagedBatch) -> int:
        """Package-internal: store a step its ``commit`` has checked (complete, fresh, this cache's open step, room
        in the pool). Reserves its slots (copy-on-write, new blocks), writes each sequence's new K/V into them,
        extends the token lists and seals full blocks. Returns the bytes copy-on-write copied (whole blocks)."""
        if self._open is not batch:  # the batch checked this; a guard against any other caller
            raise ValueError(f"this {type(batch).__name__} is not the open step of this cache")
        seqs = [self.seqs[s] for s in batch.sids]
        copies = sum(self._reserve(seq, c) for seq, c in zip(seqs, batch.counts))
        bs = self.block_size
        slots = [slot_mapping(seq.blocks, n, n + c, bs) for seq, n, c in zip(seqs, batch.start, batch.counts)]
        slots = torch.tensor([s for row in slots for s in row], device=self.device)  # (N,): where each new token goes
        for layer in range(self.n_layer):
            k, v = batch.new_kv(layer)  # (N, H, D) each
            H, D = k.shape[1:]
            self.keys[layer].view(-1, H, D)[slots] = k
            self.values[layer].view(-1, H, D)[slots] = v
        for seq, new in zip(seqs, batch.new_tokens):
            before = len(seq.tokens)
            seq.tokens.extend(new)
            if self.prefix_caching:
                self.allocator.seal_full(seq.blocks, seq.tokens, since=before)
        self.version += 1
        self._open = None
        return copies * self.block_bytes

    def _close(self, batch: PagedBatch | PackedPagedBatch) -> None:
        """Package-internal: forget ``batch`` if it is the open step (its forward failed, or its commit was
        refused): nothing was written, so there is nothing to undo."""
        if self._open is batch:
            self._open = None

    # -- reading back ---------------------------------------------------------------------------------
    def layer_kv(self, sid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values in ``layer``, contiguous: each ``(1, kv_heads, len, head_dim)``."""
        seq = self._seq(sid)
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} is out of range for {self.n_layer} layers")
        if not seq.tokens:
            raise ValueError(f"sequence {sid} is empty")
        table = torch.tensor([seq.blocks], device=self.device)  # (1, n)
        n = len(seq.tokens)
        return gather(self.keys[layer], table, n), gather(self.values[layer], table, n)

    def check(self) -> None:
        """Raise ``AssertionError`` unless every reference count equals the number of tables holding the block."""
        self.allocator.check()
        owners = [0] * self.num_blocks
        for sid, seq in self.seqs.items():
            if len(set(seq.blocks)) != len(seq.blocks):
                raise AssertionError(f"sequence {sid} holds a block twice: {seq.blocks}")
            if len(seq.blocks) * self.block_size < len(seq.tokens):
                raise AssertionError(f"sequence {sid} has {len(seq.tokens)} tokens but {len(seq.blocks)} blocks")
            for b in seq.blocks:
                owners[b] += 1
        for b, (n, rc) in enumerate(zip(owners, self.allocator.refcount)):
            if n != rc:
                raise AssertionError(f"block {b} is in {n} block tables but has reference count {rc}")

    def __repr__(self) -> str:
        a = self.allocator
        return (
            f"PagedCache(blocks={a.num_used}/{a.num_blocks} used, block_size={self.block_size}, "
            f"sequences={len(self.seqs)}, nbytes={self.nbytes})"
        )
