"""Section (h): decode attention over a long cache: how fast it streams, and split-KV.

`attention_bandwidth` asks whether attention reads the cache at the memory's speed. Every
layer gets a cache of its own (so nothing sits in the CPU's caches), and three readers of
the same bytes take turns: PyTorch's fused SDPA with ``enable_gqa`` (one task per query
head, so each KV head is read once per query head that shares it), kvlib's
`decode_attention` (each KV head read once), and a plain ``x @ W`` over a matrix of the
same bytes, the line a streaming kernel can reach.

`split_vs_sdpa` then times FlashDecoding's split-KV against the fused kernel.

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

from kvlib import timing
from kvlib.attention import decode_attention
from kvlib.kernels import split_kv_attention
from kvlib.model import Transformer


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


def attention_bandwidth(model: Transformer, contexts: tuple[int, ...], repeats: int) -> dict:
    """(h) GB/s of one decode step's attention over every layer at each of ``contexts``:
    SDPA (``"sdpa"``), `decode_attention` (``"grouped"``) and ``x @ W`` over the same bytes
    (``"matvec"``), the fastest of ``repeats`` taking turns, in the model's dtype.

    Bytes are the cache's: ``n_layer x 2 x n_kv_head x context x head_dim`` numbers.
    """
    c, dt = model.config, model.dtype
    out = {}
    for ctx in contexts:
        shape = (1, c.n_kv_head, ctx, c.head_dim)
        q = torch.full((1, c.n_head, 1, c.head_dim), 0.01, dtype=dt)  # (1, H, 1, D)
        kv = [(torch.rand(shape, dtype=dt), torch.rand(shape, dtype=dt)) for _ in range(c.n_layer)]
        mats = [torch.rand(2 * ctx, c.n_kv_head * c.head_dim, dtype=dt) for _ in range(c.n_layer)]  # same bytes
        row = torch.full((1, 2 * ctx), 0.01, dtype=dt)  # (1, 2 ctx)
        fns = {"sdpa": lambda: [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in kv],
               "grouped": lambda: [decode_attention(q, k, v) for k, v in kv],
               "matvec": lambda: [row @ w for w in mats]}
        best = timing.round_robin(fns, repeats=repeats)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        out[str(ctx)] = {name: nbytes / t / 1e9 for name, t in best.items()} | {"bytes": nbytes}
        del kv, mats
    return out
