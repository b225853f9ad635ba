"""Each paper's press, written the slow way: loops over heads and queries, one softmax at a time.

This is the yardstick both kvpress and `kvlib.press` are held to. It reads one layer's
activations (`LayerStates`: the normalised input ``x``, queries before and after RoPE,
keys after RoPE, values, all from one uncached forward of kvlib's model) and returns
per KV head a score for every position, ``(H_kv, S)``, with ``+inf`` on the positions
the press always keeps (SnapKV's observation window, TOVA's last token, the sinks).
`keep` then takes the ``n_kept`` best per head.

Where a paper leaves a choice open, the reference takes kvpress 0.5.5's and says so, and
the choice is an argument, so that a difference can be tested by switching it:

* SnapKV: the last ``window`` queries vote; each query's weights are its causal softmax
  over the whole passage; the votes are *averaged* and smoothed by an *average* pool of
  ``kernel`` (zero-padded, divided by ``kernel`` at the edges too); the query heads of one
  GQA group are averaged (``group="mean"``; the paper's per-head selection needs MHA).
  ``pool="max"`` is the other smoothing SnapKV's own code offers.
* PyramidKV: SnapKV's scores, and a per-layer budget falling linearly from the first
  layer to the last (`pyramid_budget`), ``n_kept`` counting the window.
* TOVA: the last query's softmax over every position, averaged over *all* query heads, so
  every KV head keeps the same positions.
* Expected attention: queries before RoPE (past the sinks) as a Gaussian; its mean and
  covariance rotated by RoPE averaged over the next ``n_future`` positions; the expected
  ``exp(q.k / sqrt(D))`` softmaxed over the keys past the sinks, averaged over the group,
  times ``||v||``.
* StreamingLLM: the ``n_sink`` first positions and the most recent ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.model import Transformer, rope_cos_sin

INF = float("inf")


@dataclass
class LayerStates:
    """One layer's activations for a ``(1, S)`` passage: ``x`` ``(S, d_model)`` (after
    ``attn_norm``), ``q_pre`` and ``q`` ``(H, S, D)`` (before and after RoPE), ``k`` ``(H_kv, S, D)``
    (after RoPE), ``v`` ``(H_kv, S, D)``."""

    x: torch.Tensor
    q_pre: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@torch.inference_mode()
def layer_states(model: Transformer, ids: torch.Tensor) -> list[LayerStates]:
    """Every layer's `LayerStates`, caught by forward hooks on one uncached forward of ``ids`` ``(1, S)``."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be (1, S), got {tuple(ids.shape)}")
    out: list[LayerStates] = []

    def hook(attn, inputs, _output):
        x, cos, sin = inputs[:3]  # x (1, S, d_model); cos, sin (1, S, 1, D)
        H, H_kv, D = attn.n_head, attn.n_kv_head, attn.head_dim
        qkv = attn.wqkv(x).view(1, x.shape[1], H + 2 * H_kv, D)[0]  # (S, heads, D)
        q_pre, k_pre, v = qkv[:, :H], qkv[:, H : H + H_kv], qkv[:, H + H_kv :]
        c, s = cos[0], sin[0]  # (S, 1, D)
        rot = lambda t: t * c + torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1) * s  # noqa: E731
        out.append(LayerStates(x[0], q_pre.transpose(0, 1), rot(q_pre).transpose(0, 1), rot(k_pre).transpose(0, 1),
                               v.transpose(0, 1)))

    hooks = [block.attn.register_forward_hook(hook) for block in model.layers]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def n_kept(seq_len: int, ratio: float) -> int:
    """Positions kept per head at ``compression_ratio`` ``ratio``: ``int(S * (1 - ratio))``, at least 1."""
    return max(1, int(seq_len * (1 - ratio)))


def keep(scores: torch.Tensor, n: int) -> list[list[int]]:
    """The ``n`` best positions of each row of ``scores`` ``(H_kv, S)``, ascending, one list per head."""
    out = []
    for row in scores:
        order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))  # ties: the earlier position
        out.append(sorted(order[:n]))
    return out


def _causal_softmax(q: torch.Tensor, k: torch.Tensor, t: int) -> torch.Tensor:
    """Query at position ``t`` ``(D,)`` against keys ``(S, D)``: its weights ``(S,)``, zero after ``t``."""
    logits = (k[: t + 1] @ q) / math.sqrt(q.shape[-1])
    w = torch.zeros(k.shape[0], dtype=torch.float32)
    w[: t + 1] = torch.softmax(logits.float(), dim=0)
    return w


def _pool(row: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Smooth ``row`` ``(n,)`` over a centred window of ``kernel``: zero-padded average, or max."""
    half, n = kernel // 2, row.shape[0]
    out = torch.empty_like(row)
    for j in range(n):
        part = row[max(0, j - half) : min(n, j + half + 1)]
        out[j] = part.sum() / kernel if pool == "avg" else part.max()
    return out


def snapkv(st: LayerStates, window: int = 64, kernel: int = 5, pool: str = "avg", group: str = "mean") -> torch.Tensor:
    """SnapKV's scores ``(H_kv, S)``: the last ``window`` queries' attention to the earlier
    positions, averaged, pooled, and reduced over each GQA group (``"mean"`` or ``"max"``)."""
    H, S, _ = st.q.shape
    H_kv = st.k.shape[0]
    if not window < S:
        raise ValueError(f"SnapKV's window ({window}) must be shorter than the passage ({S})")
    per_head = torch.zeros(H, S - window)
    for h in range(H):
        k = st.k[h // (H // H_kv)]  # query head h reads KV head h // group size
        for t in range(S - window, S):
            per_head[h] += _causal_softmax(st.q[h, t], k, t)[: S - window] / window
        per_head[h] = _pool(per_head[h], kernel, pool)
    grouped = per_head.view(H_kv, H // H_kv, S - window)
    reduced = grouped.mean(1) if group == "mean" else grouped.max(1).values  # (H_kv, S - window)
    return torch.cat([reduced, torch.full((H_kv, window), INF)], dim=1)


def pyramid_budget(layer: int, n_layer: int, seq_len: int, ratio: float, window: int = 64, beta: int = 20) -> int:
    """PyramidKV's per-layer budget (the window included): an arithmetic progression from the
    first layer's ``top`` down to the last layer's ``bottom``, whose mean is ``S * (1 - ratio)``.

    ``bottom = (average - window) / beta`` above the window, ``top`` as much above the average as
    ``bottom`` is below; ``top`` is capped at ``S - window`` (and ``bottom`` raised to keep the
    mean). Outside ``S >= top >= bottom >= window``, every layer keeps ``S * (1 - ratio)``.
    """
    extra = seq_len * (1 - ratio)  # the average budget beyond the window...
    bottom = extra / beta
    top = 2 * extra - bottom
    if top >= seq_len - window:
        top = seq_len - window
        bottom = 2 * extra - top
    if not seq_len >= top >= bottom >= window:
        return max(1, round(seq_len * (1 - ratio)))
    step = (top - bottom) / (n_layer - 1) if n_layer > 1 else 0.0
    return round(top - layer * step)


def tova(st: LayerStates) -> torch.Tensor:
    """TOVA's scores ``(H_kv, S)``: the last query's weights averaged over all query heads; the last position kept."""
    H, S, _ = st.q.shape
    H_kv = st.k.shape[0]
    mean = torch.zeros(S)
    for h in range(H):
        mean += _causal_softmax(st.q[h, S - 1], st.k[h // (H // H_kv)], S - 1) / H
    mean[S - 1] = INF
    return mean.expand(H_kv, S).clone()


def _mean_rope(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """RoPE's rotation ``R`` ``(D, D)`` (``q -> R q``), averaged over ``positions``."""
    R = torch.zeros(head_dim, head_dim)
    half = head_dim // 2
    for p in positions.tolist():
        cos, sin = rope_cos_sin(torch.tensor([[p]]), head_dim, base)
        c, s = cos[0, 0], sin[0, 0]  # (D,)
        rot = torch.diag(c)
        rot[:half, half:] -= torch.diag(s[:half])  # q_i cos - q_{i+D/2} sin
        rot[half:, :half] += torch.diag(s[half:])  # q_{i+D/2} cos + q_i sin
        R += rot / len(positions)
    return R


def expected_attention(st: LayerStates, rope_base: float, n_future: int = 512, n_sink: int = 4,
                       covariance: bool = True, vnorm: bool = True, mean_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Expected attention's scores ``(H_kv, S)``; the ``n_sink`` first positions kept.

    ``mean_rope``: `_mean_rope` for positions ``S .. S + n_future - 1`` (the same for every
    layer, so the caller may compute it once)."""
    H, S, D = st.q.shape
    H_kv = st.k.shape[0]
    R = mean_rope if mean_rope is not None else _mean_rope(torch.arange(S, S + n_future), D, rope_base)
    scores = torch.zeros(H_kv, S - n_sink)
    for h in range(H):
        q = st.q_pre[h, n_sink:]  # (S - n_sink, D): the queries, sinks left out
        mu = q.mean(0)
        cov = (q - mu).T @ (q - mu) / q.shape[0]  # biased, as the Gaussian's maximum likelihood
        mu, cov = R @ mu, R @ cov @ R.T  # rotated to the future positions, on average
        k = st.k[h // (H // H_kv), n_sink:]  # (S - n_sink, D)
        logits = k @ mu / math.sqrt(D)  # (S - n_sink,): E[q].k / sqrt(D)
        if covariance:  # + Var[q.k / sqrt(D)] / 2, the log-normal's correction: k^T cov k / (2 D)
            logits = logits + ((k @ cov) * k).sum(-1) / (2 * D)
        scores[h // (H // H_kv)] += torch.softmax(logits, 0) / (H // H_kv)
    if vnorm:
        scores = scores * st.v[:, n_sink:].norm(dim=-1)
    return torch.cat([torch.full((H_kv, n_sink), INF), scores], dim=1)


def streaming_llm(seq_len: int, n_heads: int, ratio: float, n_sink: int = 4) -> torch.Tensor:
    """StreamingLLM's scores ``(H_kv, S)``: 1 on the sinks and the most recent positions, 0 between."""
    n = n_kept(seq_len, ratio)
    s = torch.zeros(n_heads, seq_len)
    s[:, :n_sink] = 1
    s[:, seq_len - (n - n_sink) :] = 1
    return s


def scores(press: str, states: list[LayerStates], ratio: float, rope_base: float, **options) -> list[torch.Tensor]:
    """Every layer's reference scores for ``press`` (a `kvpresscheck.workload` name)."""
    if press in ("snapkv", "pyramidkv"):
        opts = {k: options[k] for k in ("window", "kernel", "pool", "group") if k in options}
        return [snapkv(st, **opts) for st in states]
    if press == "tova":
        return [tova(st) for st in states]
    if press == "expected_attention":
        S, D = states[0].q.shape[1:]
        n_future = options.get("n_future", 512)
        R = _mean_rope(torch.arange(S, S + n_future), D, rope_base)
        return [expected_attention(st, rope_base, n_future, mean_rope=R,
                                   **{k: options[k] for k in ("n_sink", "covariance", "vnorm") if k in options})
                for st in states]
    if press == "streaming_llm":
        return [streaming_llm(st.q.shape[1], st.k.shape[0], ratio, options.get("n_sink", 4)) for st in states]
    raise ValueError(f"no reference for press {press!r}")


def kept(press: str, layer_scores: list[torch.Tensor], ratio: float, **options) -> list[list[list[int]]]:
    """Per layer, per KV head, the positions the press keeps (ascending)."""
    S, L = layer_scores[0].shape[1], len(layer_scores)
    if press == "pyramidkv":
        w, beta = options.get("window", 64), options.get("beta", 20)
        return [keep(s, pyramid_budget(i, L, S, ratio, w, beta)) for i, s in enumerate(layer_scores)]
    return [keep(s, n_kept(S, ratio)) for s in layer_scores]
