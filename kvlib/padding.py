"""Batches of prompts with different lengths.

A tensor is a rectangle, so a batch of prompts of lengths 3 and 5 becomes a
``(2, 5)`` block with two pad slots. Three things keep the pads from changing
any real token's output:

* a **key mask** (``valid``, ``False`` on pads) so that no query attends to a pad;
* **position ids** that count only real tokens, so RoPE sees each prompt start at 0;
* reading each row's next-token logits at its **last real token**.

With left padding (``side="left"``) every row's last real token is the last
column, and each decode step appends at the same column for every row: that is
what `kvlib.generate` does, through `PaddedBatch`. Right padding works too, but
then the last real token sits at a different column in each row, and new tokens
land after the pads.
"""

from __future__ import annotations

import torch

from .attention import attention_mask
from .cache import Cache


def pad(
    rows: list[list[int]], pad_id: int = 0, side: str = "left", *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to one ``(B, T)`` tensor. Returns ``(ids, valid)``, ``valid`` False on pads."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
        raise TypeError("rows must be a non-empty list of token-id lists")
    if any(len(r) == 0 for r in rows):
        raise ValueError(f"row {[len(r) for r in rows].index(0)} is empty: every row needs at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
        raise TypeError("rows must contain only int token ids")
    T = max(len(r) for r in rows)
    ids, valid = [], []
    for r in rows:
        fill = T - len(r)
        ids.append([pad_id] * fill + list(r) if side == "left" else list(r) + [pad_id] * fill)
        valid.append([False] * fill + [True] * len(r) if side == "left" else [True] * len(r) + [False] * fill)
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(valid, device=device)


def _check_valid(valid: torch.Tensor) -> None:
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
        raise TypeError(f"valid must be a (batch, seq) bool tensor, got {getattr(valid, 'dtype', type(valid).__name__)} "
                        f"of shape {tuple(getattr(valid, 'shape', ()))}")


def position_ids(valid: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` positions that count real tokens only: each row's first real token is 0.

    Pads get the position of the real token before them (or 0); they are masked
    out as keys, so their value never matters.
    """
    _check_valid(valid)
    return (valid.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)


def _check_rows(valid: torch.Tensor) -> None:
    """Every row needs a real token (else its logits are NaN). One read of ``valid``, once per
    padded batch, never per step; a ``meta`` tensor has no values to read, so it is not checked."""
    if valid.device.type != "meta" and not bool(valid.any(dim=-1).all()):
        raise ValueError(f"rows {(~valid.any(dim=-1)).nonzero().flatten().tolist()} have no real token")


def last_index(valid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` column of each row's last real token: where its next-token logits are."""
    _check_valid(valid)
    _check_rows(valid)
    T = valid.shape[-1]
    cols = torch.arange(T, device=valid.device).expand_as(valid)  # (B, T)
    return torch.where(valid, cols, -1).amax(dim=-1)


class PaddedBatch(Cache):
    """A cache for a left-padded batch: it remembers which prompt slots are pads.

    Wrap any cache before the prefill: ``batch = PaddedBatch(cache, valid)`` with the
    prompt's ``valid`` ``(B, T)``. Then ``model(ids, batch)`` and every later
    ``model(next_tokens, batch)`` get the right positions and mask from the cache
    itself: pads are masked out as keys, and each row's positions count its real
    tokens only. Every token after the prompt is real. Storage is the wrapped cache's
    (``nbytes``, ``bytes_written``, ``spec``); the batch keeps a copy of ``valid`` beside it.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> ids = torch.tensor([[0, 5, 6], [7, 8, 9]])  # row 0 is left-padded
    >>> valid = torch.tensor([[False, True, True], [True, True, True]])
    >>> batch = kvlib.PaddedBatch(kvlib.DynamicCache(model.config.n_layer), valid)
    >>> padded = model(ids, batch)[0, -1]
    >>> torch.allclose(padded, model(torch.tensor([[5, 6]]))[0, -1], atol=1e-5)  # as if alone
    True
    """

    beside_kv = ("valid",)

    @classmethod
    def for_model(cls, model_or_config: object, *args, **kwargs) -> "PaddedBatch":
        """Not for a PaddedBatch: it wraps a cache, so build that one for the model and wrap it."""
        raise TypeError("PaddedBatch wraps a cache: PaddedBatch(kvlib.DynamicCache.for_model(model), valid)")

    def __init__(self, cache: Cache, valid: torch.Tensor) -> None:
        if not isinstance(cache, Cache):
            raise TypeError(f"PaddedBatch wraps a kvlib Cache, got {type(cache).__name__}")
        _check_valid(valid)
        if cache.seq_len != 0:
            raise ValueError(f"padded prompts need an empty cache; this one already holds {cache.seq_len} tokens")
        _check_rows(valid)  # once, before the prefill: a decode step reads nothing
        super().__init__(cache.n_layer)
        self.inner, self.valid = cache, valid.clone()  # the caller may reuse its mask

    def key_valid(self, n_keys: int) -> torch.Tensor:
        """``(B, n_keys)`` bool: the prompt's padding, then ``True`` for every later token."""
        B, T0 = self.valid.shape
        if n_keys < T0:
            raise ValueError(f"the padded prompt has {T0} tokens; a step must see at least that many keys, not {n_keys}")
        return torch.cat([self.valid, self.valid.new_ones(B, n_keys - T0)], dim=1)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        past, T = self.seq_len, tokens.shape[1]
        return position_ids(self.key_valid(past + T))[:, past:].to(tokens.device)  # (B, T)

    def mask(self, tokens: torch.Tensor) -> torch.Tensor:
        past, T = self.seq_len, tokens.shape[1]
        return attention_mask(T, past + T, self.key_valid(past + T), device=tokens.device, pads_see_themselves=True)

    # -- storage: the wrapped cache's ------------------------------------------------------------
    @property
    def spec(self):
        return self.inner.spec

    def update(self, key_states, value_states, layer_idx):
        before = self.inner.bytes_written
        out = self.inner.update(key_states, value_states, layer_idx)
        self.bytes_written += self.inner.bytes_written - before
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.inner.get_seq_length(layer_idx)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def reset(self) -> None:
        raise NotImplementedError("a PaddedBatch belongs to one padded prompt; reset the wrapped cache and wrap it anew")

    def crop(self, max_length: int) -> None:
        if self.crop_length(max_length) < self.valid.shape[1]:
            raise ValueError(f"cannot crop into the padded prompt of {self.valid.shape[1]} tokens; "
                             f"crop the wrapped cache and wrap it anew")
        self.inner.crop(max_length)

    def layer_kv(self, layer_idx: int):
        return self.inner.layer_kv(layer_idx)
