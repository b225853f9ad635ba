"""Change how many key/value heads a trained model has.

Query head ``h`` of a model with ``H`` query heads and ``H_kv`` KV heads reads
KV head ``h // (H / H_kv)``: the query heads come in ``H_kv`` contiguous groups.
Changing ``H_kv`` is a change to the K and V projection columns only:

* **more** KV heads (``new`` a multiple of ``old``): copy each KV head to every
  new head of its group. Every query head reads exactly the keys it read before,
  so the outputs are unchanged; only the cache grows.
* **fewer** KV heads (``old`` a multiple of ``new``): merge each group of
  ``old / new`` KV heads into one, by averaging their projection columns
  (``how="mean"``, the GQA paper's starting point for uptraining) or by keeping
  the first (``how="first"``). This changes the model; how much is measured.

K and V are linear in the weights, and RoPE rotates every head the same way,
so averaging the weights averages the keys and values themselves.
"""

from __future__ import annotations

import torch

from .model import Transformer
from .validate import positive_int


def _kv_columns(w: torch.Tensor, H: int, H_kv: int, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused ``(d_model, (H + 2 H_kv) D)`` wqkv into q ``(d, H D)``, k and v ``(d, H_kv, D)``."""
    d = w.shape[0]
    q, k, v = w.split([H * D, H_kv * D, H_kv * D], dim=1)
    return q, k.reshape(d, H_kv, D), v.reshape(d, H_kv, D)


def regroup(kv: torch.Tensor, new: int, how: str = "mean") -> torch.Tensor:
    """``(..., old, D)`` per-head weights (or keys) -> ``(..., new, D)``, grouping contiguous heads."""
    old = kv.shape[-2]
    if new == old:
        return kv.clone()
    if new > old:  # expand: each old head serves new / old consecutive new heads
        return kv.repeat_interleave(new // old, dim=-2)
    g = old // new
    grouped = kv.reshape(*kv.shape[:-2], new, g, kv.shape[-1])  # (..., new, g, D)
    return grouped.mean(dim=-2) if how == "mean" else grouped[..., 0, :]


def convert_kv_heads(model: Transformer, n_kv_head: int, how: str = "mean") -> Transformer:
    """A copy of ``model`` with ``n_kv_head`` KV heads; its weights are not shared with ``model``.

    ``n_kv_head`` must divide the query heads, and be a multiple or a divisor of
    the current KV-head count. ``how`` ("mean" or "first") only matters when heads
    are merged.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])  # 4 query heads, 2 KV heads
    >>> ids = torch.arange(1, 11)[None]
    >>> mha = kvlib.gqa.convert_kv_heads(model, 4)  # each KV head copied: the same model
    >>> torch.allclose(mha(ids), model(ids), atol=1e-5)
    True
    >>> kvlib.gqa.convert_kv_heads(model, 1).config.n_kv_head  # merged by their mean: MQA
    1
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a kvlib Transformer, got {type(model).__name__}")
    cfg = model.config
    H, old, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    positive_int("n_kv_head", n_kv_head)
    if H % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} does not divide the {H} query heads: the groups would be uneven")
    if n_kv_head % old and old % n_kv_head:
        raise ValueError(
            f"cannot regroup {old} KV heads into {n_kv_head}: one count must be a multiple of the other "
            f"(each new head must come from whole old heads, or each old head from whole new groups)"
        )
    if how not in ("mean", "first"):
        raise ValueError(f"how must be 'mean' or 'first', got {how!r}")
    label = f"{cfg.name} ({n_kv_head} KV heads{', ' + how if n_kv_head < old else ''})" if cfg.name else ""
    new = Transformer(cfg.replace(n_kv_head=n_kv_head, name=label), device="meta")
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("attn.wqkv.weight"):
            q, k, v = _kv_columns(p, H, old, D)
            k, v = regroup(k, n_kv_head, how), regroup(v, n_kv_head, how)  # (d, n_kv_head, D)
            p = torch.cat([q, k.flatten(1), v.flatten(1)], dim=1)  # (d, (H + 2 n_kv_head) D)
        state[name] = p.clone()
    new.load_state_dict(state, assign=True)
    return new.eval()
