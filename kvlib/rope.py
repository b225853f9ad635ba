"""Rotary position embeddings (RoPE): the cos and sin of each position's angles, and the rotation.

RoPE encodes a token's position by rotating its query and key: dimension pair
``(i, i + head_dim/2)`` of a vector at position ``p`` turns by the angle
``p * base^(-2i/head_dim)``. A query and a key then score by their *distance*, so a
cached key, rotated once when it was written, never needs touching again.

* `rope_cos_sin`: the cos and sin tables for any ``(B, T)`` positions, computed on the spot;
* `rope_table`: the same for every position ``0 .. max_seq_len - 1`` in one call, so that
  looking a position up gives the same bits whatever step it is in (what
  `Transformer.set_batch_invariant` keeps; `kvlib.invariant` says why it matters);
* `apply_rope`: the rotation ("rotate half", Hugging Face Llama's layout).

A leaf module: it imports only torch, so the model, the caches that re-rotate keys
(`kvlib.evict`, `kvlib.press`) and `kvlib.mla` can all use it.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_cos_sin", "rope_table"]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer ``positions`` ``(B, T)``: each ``(B, T, head_dim)``.

    Dimension pair ``(i, i + head_dim/2)`` rotates at frequency ``base^(-2i/head_dim)``
    (the "rotate half" layout used by Hugging Face Llama).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_table(
    max_seq_len: int, head_dim: int, base: float, *, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position ``0 .. max_seq_len - 1``, in one call: each ``(max_seq_len, head_dim)``.

    ``cos[positions]`` then gives a ``(B, T, head_dim)`` table whose every row has fixed bits:
    computed per step, a position's ``cos`` would sit at another place in another-sized
    tensor, and torch's vectorised ``cos`` may round its last elements differently.
    """
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    cos, sin = rope_cos_sin(torch.arange(max_seq_len, device=device)[None], head_dim, base, dtype=dtype)
    return cos[0], sin[0]  # (max_seq_len, head_dim) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by the angles in ``cos``/``sin``; all three broadcast together,
    e.g. ``x`` ``(B, T, H, D)`` with ``cos`` ``(B, T, 1, D)``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # "rotate half"
    return x * cos + rotated * sin
