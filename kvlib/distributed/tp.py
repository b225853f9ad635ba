"""Tensor-parallel decode: one model split across ranks, each rank caching only its KV heads.

Megatron-LM's split, which vLLM and SGLang use for every Llama-family model:

- **attention by heads.** Rank ``r`` of ``p`` computes ``H / p`` query heads and the KV heads
  they read, from its own columns of ``wqkv``, and caches only those KV heads. Its slice of
  ``wo`` (the matching rows) turns its heads into a *partial* ``(B, T, d_model)``: the sum
  over ranks of the partials is the full output. One **all-reduce** adds them up.
- **the MLP by columns, then rows.** Rank ``r`` holds ``d_ff / p`` columns of the gate and
  up projections (SwiGLU acts column by column, so nothing is exchanged there) and the
  matching rows of ``w_down``: again a partial sum, and one more all-reduce.

So a block costs two all-reduces of ``B * T * d_model`` numbers, and every rank ends each
block with the same residual stream. The embedding, the norms and the output layer are
replicated (vLLM also splits the vocabulary; that changes no cache byte).

What each rank caches is the point. With ``p <= H_kv`` a rank holds ``H_kv / p`` KV heads,
so its cache is exactly ``1 / p`` of the whole. With ``p > H_kv`` there are fewer KV heads
than ranks: each KV head is **replicated** on ``p / H_kv`` ranks, each rank still caches one
head, and the cluster stores the cache ``p / H_kv`` times over. A size where neither of
``H_kv`` and ``p`` divides the other is refused, as vLLM refuses it. MLA's single latent
cannot be split by heads at all: it is replicated on every rank (`cluster.shard_bytes`),
which is why SGLang and vLLM run DeepSeek's attention data-parallel instead.

`shard(model, rank, size)` builds rank ``rank``'s model: a plain kvlib `Transformer` of the
local widths whose ``wo`` and ``w_down`` are wrapped in `AllReduce`. Any kvlib cache sized
for ``shard.config`` holds that rank's heads, and `kvlib.generate` runs on it unchanged,
every rank in lockstep. `generate_worker` is that loop, ready for `kvlib.distributed.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..cache import StaticCache
from ..config import ModelConfig
from ..generate import decode_step, prefill
from ..memory import dtype_bytes
from ..model import Linear, Transformer
from ..validate import int_in_range, positive_int
from .cluster import kv_heads_per_rank


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds: global query-head and KV-head ids, MLP columns."""

    rank: int
    size: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ff: tuple[int, int]  # [start, stop) of the MLP's hidden columns
    replicas: int  # how many ranks hold each of this rank's KV heads (1: no replication)


def plan(config: ModelConfig, size: int) -> list[Shard]:
    """Every rank's `Shard` for tensor-parallel size ``size``, or ``ValueError`` naming the rule.

    The rules are vLLM's: the query heads and the MLP's columns divide evenly, and either
    ``size`` divides the KV heads (each rank its own) or the KV heads divide ``size``
    (each KV head replicated on ``size / n_kv_head`` ranks).

    Example

    >>> from kvlib.distributed import tp
    >>> config = kvlib.PRESETS["tiny"]  # 4 query heads, 2 KV heads
    >>> [shard.kv_heads for shard in tp.plan(config, 2)]  # each rank its own KV head
    [(0,), (1,)]
    >>> [(shard.kv_heads, shard.replicas) for shard in tp.plan(config, 4)]  # each KV head on two ranks
    [((0,), 2), ((0,), 2), ((1,), 2), ((1,), 2)]
    >>> tp.plan(config, 3)
    Traceback (most recent call last):
    ...
    ValueError: tiny (random weights)'s 4 query heads do not divide among 3 ranks: ...
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"plan needs a ModelConfig, got {type(config).__name__}")
    positive_int("tensor-parallel size", size)
    H, H_kv, F = config.n_head, config.n_kv_head, config.d_ff
    name = config.name or "this model"
    if H % size:
        raise ValueError(f"{name}'s {H} query heads do not divide among {size} ranks: tensor-parallel size "
                         f"must divide n_head ({[s for s in range(1, H + 1) if H % s == 0]} here)")
    kv_heads_per_rank(H_kv, size)  # vLLM's rule for the KV heads: split, or replicate, or refuse
    if F % size:
        raise ValueError(f"{name}'s MLP width d_ff={F} does not divide among {size} ranks")
    q_per, f_per = H // size, F // size
    group = H // H_kv  # query heads per KV head
    shards = []
    for r in range(size):
        q = tuple(range(r * q_per, (r + 1) * q_per))
        if size <= H_kv:
            kv = tuple(range(r * H_kv // size, (r + 1) * H_kv // size))
        else:
            kv = (q[0] // group,)  # the one KV head its query heads read, replicated
        shards.append(Shard(r, size, q, kv, (r * f_per, (r + 1) * f_per), max(1, size // H_kv)))
    return shards


def local_config(config: ModelConfig, size: int, rank: int = 0) -> ModelConfig:
    """The widths one rank runs: ``n_head / size`` heads, its KV heads, ``d_ff / size``."""
    s = plan(config, size)[int_in_range("rank", rank, 0, size - 1)]
    return config.replace(n_head=len(s.q_heads), n_kv_head=len(s.kv_heads), d_ff=s.ff[1] - s.ff[0],
                          head_dim=config.head_dim, name=f"{config.name or 'model'} (rank {rank} of {size})")


class AllReduce(nn.Module):
    """Megatron's row-parallel linear: this rank's partial product, summed over every rank.

    ``forward(x)`` is ``all_reduce(x @ W_r)``, with ``W_r`` this rank's rows of the weight.
    ``calls`` and ``bytes`` count what it reduced (the tensor's size, per call); a ring
    all-reduce sends and receives ``2 (p - 1) / p`` times that per rank.
    """

    def __init__(self, linear: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group
        self.calls = 0
        self.bytes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # (B, T, d_model): this rank's partial sum
        dist.all_reduce(y, group=self.group)  # every rank now holds the full sum
        self.calls += 1
        self.bytes += y.numel() * y.element_size()
        return y


def _linear(weight: torch.Tensor) -> Linear:
    lin = Linear(*weight.shape)
    lin.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    return lin


@torch.no_grad()
def shard(model: Transformer, rank: int, size: int, group: dist.ProcessGroup | None = None) -> Transformer:
    """Rank ``rank``'s part of ``model`` (a new `Transformer` of `local_config`'s widths).

    Its attention and MLP weights are copies of its slices; the embedding, norms and output
    layer are ``model``'s own (replicated). Call it inside an initialised process group.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"shard needs a kvlib Transformer, got {type(model).__name__}")
    cfg = model.config
    s = plan(cfg, size)[int_in_range("rank", rank, 0, size - 1)]
    if not all(isinstance(m, Linear) for b in model.layers for m in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up)):
        raise TypeError("shard splits plain kvlib Linear weights; quantize after sharding, not before")
    H, H_kv, D, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
    heads = lambda ids, first: [c for h in ids for c in range((first + h) * D, (first + h + 1) * D)]  # noqa: E731
    qkv_cols = torch.tensor(heads(s.q_heads, 0) + heads(s.kv_heads, H) + heads(s.kv_heads, H + H_kv))
    wo_rows = torch.tensor(heads(s.q_heads, 0))
    f0, f1 = s.ff
    out = Transformer(local_config(cfg, size, rank), device="meta")
    out.tok_emb, out.norm, out.lm_head = model.tok_emb, model.norm, model.lm_head
    out.use_rope_table_of(model)
    for mine, full in zip(out.layers, model.layers):
        mine.attn_norm, mine.mlp_norm = full.attn_norm, full.mlp_norm
        mine.attn.wqkv = _linear(full.attn.wqkv.weight[:, qkv_cols])  # (d_model, (Hl + 2 Kl) D): [q | k | v]
        mine.attn.wo = AllReduce(_linear(full.attn.wo.weight[wo_rows]), group)  # (Hl D, d_model)
        gate_up = full.mlp.w_gate_up.weight  # (d_model, 2F): [gate | up]
        mine.mlp.w_gate_up = _linear(torch.cat([gate_up[:, f0:f1], gate_up[:, F + f0:F + f1]], dim=1))
        mine.mlp.w_down = AllReduce(_linear(full.mlp.w_down.weight[f0:f1]), group)  # (Fl, d_model)
        mine.attn.impl = full.attn.impl
    return out.eval()


def traffic(model: Transformer) -> tuple[int, int]:
    """``(calls, bytes)`` all-reduced so far by a `shard`'s `AllReduce` layers."""
    reducers = [m for m in model.modules() if isinstance(m, AllReduce)]
    return sum(m.calls for m in reducers), sum(m.bytes for m in reducers)


def allreduce_bytes(config: ModelConfig, tokens: int, batch: int = 1, dtype: str | int = "fp32") -> int:
    """Bytes all-reduced to run ``tokens`` positions of ``batch`` rows: two per block.

    ``2 * n_layer * batch * tokens * d_model`` numbers, whatever the size: each all-reduce
    sums one ``(batch, tokens, d_model)`` activation.
    """
    return 2 * config.n_layer * batch * tokens * config.d_model * dtype_bytes(dtype)


def build(source) -> Transformer:
    """The model a worker runs: SmolLM2 (``"smollm2"``), or for a ``(ModelConfig, seed)`` pair a
    random model, the same in every process (seeded, ``std=0.2``: no near-ties, so argmax is the
    model's). What a launch passes instead of weights: each process builds its own."""
    if source == "smollm2":
        from ..pretrained import load_smollm2

        return load_smollm2()[0]
    config, seed = source
    model = Transformer(config)
    model.reset_parameters(seed=seed, std=0.2)
    return model.eval()


@torch.inference_mode()
def greedy(model: Transformer, prompt: list[int], n_new: int, cache) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every step's logits ``(n_new, vocab)``: prefill, then decode steps."""
    logits = prefill(model, torch.tensor([prompt]), cache)  # (1, vocab)
    tokens, rows = [], []
    for i in range(n_new):
        rows.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        if i + 1 < n_new:
            logits = decode_step(model, torch.tensor([tokens[-1]]), cache)
    return tokens, torch.stack(rows)


def generate_worker(rank: int, size: int, source, prompts: list[list[int]], n_new: int) -> dict:
    """One rank of a tensor-parallel greedy run over ``prompts`` (for `launch`).

    Every rank returns its shard, its cache's bytes and what it all-reduced; rank 0 also
    returns the tokens and logits (every rank computes the same: the residual stream is
    all-reduced, and the output layer replicated).
    """
    model = build(source)
    mine = shard(model, rank, size)
    out: dict = {"shard": plan(model.config, size)[rank], "cache_bytes": [], "tokens": [], "logits": []}
    del model  # the full weights: this rank keeps its slices (and the replicated ends)
    for prompt in prompts:
        cache = StaticCache.for_model(mine.config, 1, len(prompt) + n_new)
        tokens, logits = greedy(mine, prompt, n_new, cache)
        out["cache_bytes"].append(cache.nbytes)
        out["tokens"].append(tokens)
        if rank == 0:
            out["logits"].append(logits)
    out["allreduce_calls"], out["allreduce_bytes"] = traffic(mine)
    return out

