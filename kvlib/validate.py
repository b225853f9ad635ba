"""The argument checks every module shares, so each rule and its message live in one place.

Each function returns the value it checked, so a constructor can write
``self.block_size = positive_int("block_size", block_size)``. Misuse raises
``ValueError`` (a wrong value) or ``TypeError`` (a wrong kind of thing), with
the argument's name and the value it got.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def an_int(name: str, value: object) -> int:
    """``value`` if it is an int (a bool is not, nor is ``2.0``); else ``TypeError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int ``>= minimum``; else ``TypeError`` (not an int) or ``ValueError``."""
    if an_int(name, value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int ``> 0``; else ``TypeError`` (not an int) or ``ValueError``."""
    if an_int(name, value) <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def int_in_range(name: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an int with ``low <= value <= high``; else ``TypeError`` or ``ValueError``."""
    if not low <= an_int(name, value) <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def token_ids(what: str, tokens: object, vocab_size: int) -> list[int]:
    """``tokens`` as a list of ints, if it is non-empty and every id lies in ``[0, vocab_size)``;
    else ``ValueError`` (empty) or ``IndexError`` (an id out of range), naming ``what``."""
    ids = []
    for t in tokens:
        try:
            ids.append(operator.index(t))  # ints, numpy ints, one-element integer tensors
        except TypeError:
            raise TypeError(f"{what}: token ids are integers, got {type(t).__name__} {t!r}") from None
    if not ids:
        raise ValueError(f"{what} needs at least one token (a non-empty prompt), got none")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise IndexError(f"{what}: token ids must lie in [0, {vocab_size}), got min {min(ids)} max {max(ids)}")
    return ids


def check_token_range(tokens: torch.Tensor, vocab_size: int) -> None:
    """``IndexError`` naming the first id outside ``[0, vocab_size)``. Reads the values: on a GPU, a sync."""
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise IndexError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")


def positions_to_score(at: Sequence[int] | torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    """``logits_at`` as a ``(K,)`` long tensor on ``device``, every index in ``[0, T)``. Host ints are
    checked here; a tensor's values only on the CPU (on a GPU, reading them would be a sync)."""
    if isinstance(at, torch.Tensor):
        if at.dim() != 1 or at.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"logits_at must be a (K,) int64/int32 tensor, got {at.dtype} {tuple(at.shape)}")
        if at.device.type == "cpu" and len(at) and not (0 <= int(at.min()) and int(at.max()) < T):
            raise IndexError(f"logits_at holds {int(at.min())}..{int(at.max())}, outside the {T} positions [0, {T})")
        return at.to(device=device, dtype=torch.long)
    if not isinstance(at, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in at):
        raise TypeError(f"logits_at must be a list of int positions or a (K,) int tensor, got {at!r}")
    bad = [i for i in at if not 0 <= i < T]
    if bad:
        raise IndexError(f"logits_at position {bad[0]} is outside the {T} positions [0, {T})")
    return torch.tensor(at, dtype=torch.long, device=device)
