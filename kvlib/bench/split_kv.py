"""Section (h): split-KV attention (FlashDecoding) against PyTorch's fused SDPA.

At decode time there is one query per head, so attention over a long cache offers only
batch x KV heads independent problems, each a long reduction over ``context`` keys. A GPU
with a hundred streaming multiprocessors leaves most of them idle; FlashDecoding cuts the
keys into splits, attends to each in parallel and merges the partial results exactly with
their log-sum-exps (`kvlib.kernels.split_kv_attention`). On a CPU the fused kernel already
keeps the few cores busy, so splitting can only add work (padding copies, scores written
to memory, the merge). This section measures how much: one layer's decode attention over
``context`` cached keys, fused SDPA against each split count, taking turns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import timing
from ..kernels import split_kv_attention
from ..model import Transformer


def split_vs_sdpa(model: Transformer, context: int, splits: tuple[int, ...], repeats: int) -> dict:
    """(h) One decode step's attention over ``context`` cached tokens, one layer's shapes:
    PyTorch's fused SDPA against `split_kv_attention` at each split count (ms, fastest of
    ``repeats``, round-robin)."""
    c = model.config
    q = torch.full((1, c.n_head, 1, c.head_dim), 0.01)  # (1, H, 1, D): one new token
    k = torch.full((1, c.n_kv_head, context, c.head_dim), 0.01)  # (1, H_kv, context, D)
    v = torch.full((1, c.n_kv_head, context, c.head_dim), 0.01)  # (1, H_kv, context, D)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    fns |= {f"split {n}": (lambda n=n: split_kv_attention(q, k, v, n_splits=n)) for n in splits}
    best = timing.round_robin(fns, repeats=repeats)
    return {name: 1e3 * t for name, t in best.items()}
