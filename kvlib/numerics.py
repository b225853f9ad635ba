"""When two correct ways of running a model disagree: how far, and whether it flips a token.

A cached decode step and a full recompute compute the same function, but not the same
sequence of floating-point operations: a one-row matrix product against a many-row one,
SDPA with or without a mask, keys split into other blocks. Float addition is not
associative, so the last bits differ, and a greedy token flips wherever the two best
logits are closer than that difference. This module runs one sequence several ways,
always feeding the same tokens (teacher forcing), and measures the gap:

* `recomputed`: one forward over the whole sequence (what the naive loop computes);
* `cached`: a prefill, then one decode step per token;
* `chunked`: the sequence fed in chunks through a cache (chunked prefill);
* `batched`: `cached`, with other sequences of the same length in the batch;
* `paged`: `cached`, through a `kvlib.PagedCache`.

Each returns logits ``(n, vocab)`` for positions ``start .. T-1`` of ``ids`` ``(1, T)``
(the logits at position ``p`` choose token ``p + 1``). `drift` compares two of them.
`kvlib.invariant` is the cure: with ``model.set_batch_invariant(True)`` all five agree bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import DynamicCache
from .model import Transformer
from .validate import int_at_least, int_in_range


def _check(model: Transformer, ids: torch.Tensor, start: int) -> int:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be one sequence, (1, T), got {getattr(ids, 'shape', type(ids).__name__)}")
    T = ids.shape[1]
    int_in_range("start", start, 0, T - 1)
    return T


@torch.inference_mode()
def recomputed(model: Transformer, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """One forward over all of ``ids``: logits ``(T - start, vocab)`` at positions ``start..T-1``."""
    _check(model, ids, start)
    return model(ids)[0, start:]


@torch.inference_mode()
def cached(model: Transformer, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Prefill ``ids[:, :start + 1]``, then one decode step per later token: ``(T - start, vocab)``."""
    T = _check(model, ids, start)
    cache = DynamicCache(model.config.n_layer)
    rows = [model(ids[:, : start + 1], cache, last_only=True)[0]]  # (1, vocab)
    rows += [model(ids[:, p : p + 1], cache)[0] for p in range(start + 1, T)]
    return torch.cat(rows)


@torch.inference_mode()
def chunked(model: Transformer, ids: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
    """``ids`` fed ``chunk`` tokens at a time through one cache, every position scored."""
    T = _check(model, ids, start)
    int_at_least("chunk", chunk, 1)
    cache = DynamicCache(model.config.n_layer)
    return torch.cat([model(ids[:, s : s + chunk], cache)[0] for s in range(0, T, chunk)])[start:]


@torch.inference_mode()
def batched(model: Transformer, ids: torch.Tensor, others: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`cached`, run as row 0 of a batch with ``others`` ``(B - 1, T)`` beside it."""
    T = _check(model, ids, start)
    if not isinstance(others, torch.Tensor) or others.dim() != 2 or others.shape[1] != T:
        raise ValueError(f"others must be (B - 1, {T}) token ids, got {getattr(others, 'shape', others)!r}")
    batch = torch.cat([ids, others.to(ids.device)])  # (B, T)
    cache = DynamicCache(model.config.n_layer)
    rows = [model(batch[:, : start + 1], cache, last_only=True)[0]]
    rows += [model(batch[:, p : p + 1], cache)[0] for p in range(start + 1, T)]
    return torch.cat(rows)


@torch.inference_mode()
def paged(model: Transformer, ids: torch.Tensor, start: int = 0, block_size: int = 16) -> torch.Tensor:
    """`cached` through a `kvlib.PagedCache` with ``block_size``-token blocks (keys gathered, masked)."""
    from .paged import PagedCache

    T = _check(model, ids, start)
    cache = PagedCache.for_model(model.config, num_blocks=-(-T // block_size), block_size=block_size,
                                 dtype=model.dtype, device=model.device)
    sid, _ = cache.add()
    rows = []
    for lo, hi in [(0, start + 1)] + [(p, p + 1) for p in range(start + 1, T)]:
        with cache.step([sid], ids[:, lo:hi]) as batch:
            rows.append(model(ids[:, lo:hi], batch, last_only=True)[0])
    return torch.cat(rows)


@dataclass(frozen=True)
class Drift:
    """How far ``other`` logits are from ``reference`` ones, and what that does to greedy tokens.

    max_diff: the largest ``|reference - other|`` over every position and vocabulary entry.
    near_ties: positions whose reference top-1 minus top-2 margin is below ``max_diff``,
        where a difference that large *could* flip the greedy token.
    flips: positions where the two argmaxes differ; first_flip the first (None: none).
    """

    positions: int
    max_diff: float
    min_margin: float
    near_ties: int
    flips: int
    first_flip: int | None

    @property
    def identical(self) -> bool:
        return self.max_diff == 0.0


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row, ``(n, vocab) -> (n,)``: how close each greedy choice is to a tie."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def drift(reference: torch.Tensor, other: torch.Tensor) -> Drift:
    """Compare two ``(n, vocab)`` logit tensors for the same positions (see `Drift`)."""
    if reference.shape != other.shape or reference.dim() != 2:
        raise ValueError(f"need two (n, vocab) tensors of one shape, got {tuple(reference.shape)} and {tuple(other.shape)}")
    diff = float((reference.float() - other.float()).abs().max())
    m = margins(reference)
    flipped = (reference.argmax(-1) != other.argmax(-1)).nonzero().flatten().tolist()
    return Drift(positions=len(m), max_diff=diff, min_margin=float(m.min()), near_ties=int((m < diff).sum()),
                 flips=len(flipped), first_flip=flipped[0] if flipped else None)


def first_difference(a: torch.Tensor | list[int], b: torch.Tensor | list[int]) -> int | None:
    """The first index where two token sequences differ (a length difference counts), or None."""
    a = a.flatten().tolist() if isinstance(a, torch.Tensor) else list(a)
    b = b.flatten().tolist() if isinstance(b, torch.Tensor) else list(b)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))
