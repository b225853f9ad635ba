"""Packed ("varlen") batches: every sequence's tokens end to end in one row, no pads.

Padding makes a batch a rectangle. Packing lays the sequences end to end instead
and records where each one starts, as cumulative lengths ``cu_seqlens``: sequences
of 3, 5 and 2 tokens become one row of 10 tokens with ``cu_seqlens = [0, 3, 8, 10]``,
and sequence ``i`` is ``tokens[cu_seqlens[i]:cu_seqlens[i + 1]]``. This is the layout
of FlashAttention's varlen kernels (``flash_attn_varlen_func(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)``, with ``q`` shaped
``(total_tokens, heads, head_dim)``) and of vLLM, which flattens every token it
schedules in a step into one sequence.

Only attention needs the boundaries: the embedding, norms, projections and MLPs
treat each token on its own. In attention a query of sequence ``i`` sees the keys
of sequence ``i`` only, causally and aligned bottom-right (a sequence with cached
tokens has more keys than queries). Drawn over the whole row that is a
block-diagonal mask; a varlen kernel never computes the blocks off the diagonal.

* `cu_seqlens`, `pack`, `packed_positions`: lengths to boundaries, token lists to one row,
  positions that restart at every sequence.
* `packed_mask`: the block-diagonal causal mask, to look at and to check against.
* `packed_attention`: attention one segment at a time, as a varlen kernel computes it.
* `PackedBatch`: a cache that keeps the batch packed through prefill and decode, so
  no pad exists anywhere, in the tokens or in the cache.

Layout: FlashAttention's ``(tokens, heads, head_dim)`` here. The kvlib model's attention
hook sees ``(1, heads, tokens, head_dim)``: a packed batch is a batch of one row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import AttentionImpl, attend, causal_mask
from .cache import Cache, nbytes_of


def _lengths(lengths: Sequence[int] | torch.Tensor, name: str = "lengths") -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise TypeError(f"{name} must be a non-empty list of ints, got {lengths!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        raise TypeError(f"{name} must hold ints, got {lengths!r}")
    if min(lengths) < 1:
        raise ValueError(f"every sequence needs at least one token; {name} = {list(lengths)}")
    return list(lengths)


def cu_seqlens(lengths: Sequence[int] | torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``(B + 1,)`` int32 boundaries ``[0, l0, l0 + l1, ...]`` of sequences of ``lengths`` tokens."""
    out = [0]
    for n in _lengths(lengths):
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def segment_lengths(cu: torch.Tensor, total: int | None = None, name: str = "cu_seqlens") -> list[int]:
    """Check ``cu`` (a ``cu_seqlens``) and return each segment's length.

    It must be a 1-D integer tensor that starts at 0 and strictly increases (every
    segment holds a token), ending at ``total`` tokens when that is given.
    """
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be a 1-D integer tensor, got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    vals = cu.tolist()
    if len(vals) < 2 or vals[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold at least one segment, got {vals}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if min(lens) < 1:
        raise ValueError(f"{name} must strictly increase (no empty segment), got {vals}")
    if total is not None and vals[-1] != total:
        raise ValueError(f"{name} ends at {vals[-1]} but there are {total} tokens: {vals}")
    return lens


def pack(rows: list[list[int]], *, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists to one row: ``(ids (N,), cu_seqlens (B + 1,))`` with ``N = sum(len(r))``, no pads."""
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
        raise TypeError("rows must be a non-empty list of token-id lists")
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
        raise TypeError("rows must contain only int token ids")
    cu = cu_seqlens([len(r) for r in rows], device=device)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)  # (N,)
    return ids, cu


def packed_positions(cu: torch.Tensor, start: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """``(N,)`` RoPE positions of a packed row: each sequence counts from ``start[i]``
    (its tokens already cached; 0 by default), so a prompt starts at position 0."""
    lens = segment_lengths(cu)
    start = [0] * len(lens) if start is None else torch.as_tensor(start).tolist()
    if len(start) != len(lens):
        raise ValueError(f"start has {len(start)} entries for {len(lens)} sequences")
    return torch.cat([torch.arange(s, s + n, device=cu.device) for s, n in zip(start, lens)])


def _pairs(cu_q: torch.Tensor, cu_k: torch.Tensor | None) -> tuple[list[int], list[int], list[int], list[int]]:
    """Segment lengths and starts of queries and keys, checked against each other."""
    lq = segment_lengths(cu_q, name="cu_seqlens_q")
    lk = lq if cu_k is None else segment_lengths(cu_k, name="cu_seqlens_k")
    if len(lk) != len(lq):
        raise ValueError(f"cu_seqlens_q has {len(lq)} sequences but cu_seqlens_k has {len(lk)}")
    bad = [i for i, (a, b) in enumerate(zip(lq, lk)) if a > b]
    if bad:
        raise ValueError(f"sequences {bad} have more queries than keys ({[lq[i] for i in bad]} > "
                         f"{[lk[i] for i in bad]}): the queries must be the last tokens of their keys")
    sq = cu_q.tolist()[:-1]
    sk = sq if cu_k is None else cu_k.tolist()[:-1]
    return lq, lk, sq, sk


def packed_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """``(N_q, N_k)`` bool: query ``a`` may see key ``b`` if both belong to the same
    sequence and ``b`` is not in ``a``'s future (bottom-right causal within the sequence).

    ``cu_seqlens_k`` defaults to ``cu_seqlens_q`` (a prefill: each sequence's queries are its keys).
    """
    lq, lk, sq, sk = _pairs(cu_seqlens_q, cu_seqlens_k)
    mask = torch.zeros(sum(lq), sum(lk), dtype=torch.bool, device=cu_seqlens_q.device)
    for nq, nk, a, b in zip(lq, lk, sq, sk):
        mask[a:a + nq, b:b + nk] = causal_mask(nq, nk, device=mask.device)  # one diagonal block
    return mask


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    impl: AttentionImpl = "sdpa",
) -> torch.Tensor:
    """Attention over a packed batch, one sequence at a time: what a varlen kernel returns.

    q: ``(N_q, H, D)``; k, v: ``(N_k, H_kv, D)`` with ``H % H_kv == 0``; the cu_seqlens
    say where each sequence's queries and keys sit. Query ``j`` of a sequence with
    ``lq`` queries and ``lk`` keys is its key ``lk - lq + j`` (bottom-right causal).
    ``impl`` is the kernel run on each segment ("sdpa", "reference" or a function, as
    in `Transformer.set_attention_impl`). Returns ``(N_q, H, D)``.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    lq, lk, sq, sk = _pairs(cu_seqlens_q, cu_seqlens_k)
    if q.shape[0] != sum(lq) or k.shape[0] != sum(lk) or v.shape[0] != k.shape[0]:
        raise ValueError(f"cu_seqlens_q ends at {sum(lq)} and cu_seqlens_k at {sum(lk)}, but q has "
                         f"{q.shape[0]} tokens, k {k.shape[0]} and v {v.shape[0]}")
    outs = []
    for nq, nk, a, b in zip(lq, lk, sq, sk):
        qi = q[a:a + nq].transpose(0, 1)[None]  # (1, H, nq, D)
        ki, vi = k[b:b + nk].transpose(0, 1)[None], v[b:b + nk].transpose(0, 1)[None]  # (1, H_kv, nk, D)
        outs.append(attend(qi, ki, vi, None, impl)[0].transpose(0, 1))  # (nq, H, D)
    return torch.cat(outs)  # (N_q, H, D)


class PackedBatch(Cache):
    """A cache that keeps a batch packed: each sequence's keys end to end in one row, no pads.

    Build it with the prompts' lengths, run ``model(ids[None], batch)`` on the packed
    prompt (`pack`), then ``model(next_tokens[None], batch)`` with one token per sequence
    for each decode step. It gives the model each step's positions and block-diagonal
    mask, and holds the step's ``cu_seqlens_q`` and ``cu_seqlens_k`` for a varlen
    kernel (`packed_attention`). Storage grows by copying, like `DynamicCache`; a
    server writes into fixed blocks instead (chapter 9's paging).
    """

    def __init__(self, n_layer: int, prompt_lengths: Sequence[int] | torch.Tensor) -> None:
        super().__init__(n_layer)
        self.prompt_lengths = _lengths(prompt_lengths, "prompt_lengths")
        self.lengths = [0] * len(self.prompt_lengths)  # tokens cached per sequence
        self.keys: list[torch.Tensor | None] = [None] * n_layer  # (1, H_kv, sum(lengths), D) each
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.cu_seqlens_q: torch.Tensor | None = None  # this step's, set when it begins
        self.cu_seqlens_k: torch.Tensor | None = None

    def step_lengths(self) -> list[int]:
        """New tokens per sequence in the next step: the prompts first, then one each."""
        return self.prompt_lengths if sum(self.lengths) == 0 else [1] * len(self.lengths)

    def begin_step(self, tokens: torch.Tensor) -> None:
        """Check a step's ``(1, N)`` tokens and set its ``cu_seqlens_q`` and ``cu_seqlens_k``."""
        new = self.step_lengths()
        if tokens.dim() != 2 or tokens.shape != (1, sum(new)):
            raise ValueError(f"this step of a packed batch takes (1, {sum(new)}) tokens ({new} per "
                             f"sequence), got {tuple(tokens.shape)}")
        self.cu_seqlens_q = cu_seqlens(new, device=tokens.device)
        self.cu_seqlens_k = cu_seqlens([a + b for a, b in zip(self.lengths, new)], device=tokens.device)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        self.begin_step(tokens)
        return packed_positions(self.cu_seqlens_q, start=self.lengths)[None]  # (1, N)

    def mask(self, tokens: torch.Tensor) -> torch.Tensor:
        self.begin_step(tokens)
        return packed_mask(self.cu_seqlens_q, self.cu_seqlens_k)[None, None]  # (1, 1, N_q, N_k)

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        new = self.step_lengths()
        if key_states.shape[0] != 1 or key_states.shape[2] != sum(new):
            raise ValueError(f"a packed batch is one row of {sum(new)} new tokens ({new} per sequence); "
                             f"got keys of shape {tuple(key_states.shape)}")
        old = cu_seqlens(self.lengths).tolist() if sum(self.lengths) else None  # before this step
        cu_new = cu_seqlens(new).tolist()
        out = []
        for store, x in ((self.keys, key_states), (self.values, value_states)):
            pieces = []
            for i in range(len(new)):  # sequence i: its cached tokens, then its new ones
                if old is not None:
                    pieces.append(store[layer_idx][:, :, old[i]:old[i + 1]])
                pieces.append(x[:, :, cu_new[i]:cu_new[i + 1]])
            store[layer_idx] = torch.cat(pieces, dim=2)  # (1, H_kv, sum(lengths) + N, D)
            out.append(store[layer_idx])
        self.count_written(*out)  # every sequence re-concatenated: the whole layer, rewritten
        if layer_idx == self.n_layer - 1:  # the last layer closes the step
            self.lengths = [a + b for a, b in zip(self.lengths, new)]
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        k = self.keys[self.check_layer(layer_idx)]
        return 0 if k is None else k.shape[2]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    def reset(self) -> None:
        self.keys, self.values = [None] * self.n_layer, [None] * self.n_layer
        self.lengths = [0] * len(self.prompt_lengths)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a packed batch holds one length per sequence; it has no single "
                                  "length to crop to. reset() it and prefill again")

    def layer_kv(self, layer_idx: int):
        k = self.keys[self.check_layer(layer_idx)]
        return None if k is None else (k, self.values[layer_idx])
