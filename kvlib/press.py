"""Prompt compression as NVIDIA's kvpress does it: score every prompt token once, keep the best.

Chapter 10's caches stream: they evict as they read, so a prompt's own keys and values are computed under a budget.
A *press* reads the whole prompt first (a normal prefill, full attention), then, in every layer and for every KV
head, scores each prompt token and keeps the ``int(S * (1 - compression_ratio))`` best. Decoding then appends to
what was kept and evicts nothing more. The presses differ only in the score (``(B, H_kv, S)``, higher = keep):

* `SnapKVPress` (Li et al., 2024): the attention that the last ``window_size`` prompt queries pay each earlier key,
  averaged over those queries, smoothed along the text by an average pool of ``kernel_size``, and averaged over the
  query heads that share a KV head. The window itself is always kept.
* `PyramidKVPress` (Cai et al., 2024): SnapKV's scores, with a budget per layer falling linearly from the first
  layer to the last (`PyramidKVPress.n_kept`).
* `TOVAPress` (Oren et al., 2024): the attention of the last prompt query alone, averaged over *all* query heads, so
  every KV head keeps the same tokens.
* `ExpectedAttentionPress` (kvpress's authors, 2025): the attention that *future* queries should pay, from a
  Gaussian fitted to the prompt's queries (before RoPE), rotated to the average of the next ``n_future_positions``
  positions, times each value's norm.
* `StreamingLLMPress`: the first ``n_sink`` tokens and the most recent ones, as a press.

Every definition and default follows kvpress 0.5.5 (``kvpress/presses/*_press.py``); the one choice of ours is the
tie-break: equal scores keep the older token (kvpress's ``topk`` leaves ties unspecified). Scores take the prompt's
queries *after* RoPE, at positions ``0 .. S-1``, as the attention kernel saw them (kvpress projects them again).

`PressCache` holds the compressed cache; `prefill` runs the prompt with the cache's own attention, which computes
the step as the model's default kernel would, then compresses that layer (as kvpress's forward hook does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import attend_default, causal_mask, repeat_kv, softmax
from .evict import _Budgeted
from .model import Transformer, apply_rope, rope_cos_sin
from .validate import int_at_least, positive_int


def _check_qkv(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int, int]:
    """``(B, H, H_kv, S, D)`` of a layer's prompt, or ``ValueError`` naming the shapes."""
    if queries.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"queries must be (B, H, S, D) and keys, values (B, H_kv, S, D); got "
                         f"{tuple(queries.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    B, H, S, D = queries.shape
    H_kv = keys.shape[1]
    if keys.shape[0] != B or keys.shape[2:] != (S, D) or H % H_kv:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} must share batch, length "
                         f"and head_dim, with the query heads a multiple of the KV heads")
    return B, H, H_kv, S, D


def _by_kv_head(scores: torch.Tensor, H_kv: int) -> torch.Tensor:
    """Average ``(B, H, S)`` scores over the query heads that share a KV head: ``(B, H_kv, S)``.
    `repeat_kv` gives query head ``h`` the KV head ``h // G``, so the groups are contiguous."""
    B, H, S = scores.shape
    return scores.view(B, H_kv, H // H_kv, S).mean(dim=2)  # (B, H_kv, G, S) -> (B, H_kv, S)


def window_attention(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """The softmax weights ``(B, H, window, S - window)`` that the last ``window`` queries pay to
    the keys before the window (each query saw everything up to itself: a causal mask)."""
    B, H, H_kv, S, D = _check_qkv(queries, keys, keys)
    q = queries[:, :, -window:]  # (B, H, w, D): the observation window
    logits = q @ repeat_kv(keys, H // H_kv).transpose(-2, -1) / math.sqrt(D)  # (B, H, w, S)
    logits = logits.masked_fill(~causal_mask(window, S, device=q.device), float("-inf"))
    w = softmax(logits.float(), dim=-1).to(q.dtype)  # fp32 softmax, as kvpress
    return w[..., : S - window]  # the window's own keys are kept anyway


class Press:
    """A scoring rule. Subclasses define `score`; `n_kept` says how many tokens a layer keeps."""

    def validate(self, seq_len: int) -> None:
        """``ValueError`` if a prompt of ``seq_len`` tokens is too short for this press."""
        positive_int("seq_len", seq_len)

    def score(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              rope_base: float | None = None) -> torch.Tensor:
        """Scores ``(B, H_kv, S)`` for one layer's prompt, higher = keep.

        queries: ``(B, H, S, D)``, after RoPE at positions ``0 .. S-1`` (what attention saw);
        keys, values: ``(B, H_kv, S, D)``, the keys after RoPE, as cached;
        rope_base: the model's RoPE base (`ExpectedAttentionPress` needs it; others ignore it).
        """
        raise NotImplementedError

    def n_kept(self, seq_len: int, compression_ratio: float, layer_idx: int = 0, n_layer: int = 1) -> int:
        """Tokens a layer keeps: ``max(1, int(seq_len * (1 - compression_ratio)))``, kvpress's rule.
        (In floating point ``1 - 0.8`` is a hair under 0.2: choose ratios exact in binary.)"""
        return max(1, int(seq_len * (1 - compression_ratio)))


@dataclass
class SnapKVPress(Press):
    """SnapKV: what the last ``window_size`` prompt queries attend to, pooled over ``kernel_size``."""

    window_size: int = 64
    kernel_size: int = 5

    def __post_init__(self) -> None:
        positive_int("window_size", self.window_size)
        if positive_int("kernel_size", self.kernel_size) % 2 == 0:
            raise ValueError(f"kernel_size must be odd (the pooled scores keep their length), got {self.kernel_size}")

    def validate(self, seq_len: int) -> None:
        if positive_int("seq_len", seq_len) <= self.window_size:
            raise ValueError(f"{type(self).__name__} needs a prompt longer than window_size={self.window_size}, "
                             f"got {seq_len} tokens")

    def score(self, queries, keys, values, rope_base=None):
        B, H, H_kv, S, D = _check_qkv(queries, keys, values)
        self.validate(S)
        w = window_attention(queries, keys, self.window_size)  # (B, H, window, S - window)
        s = w.mean(dim=-2)  # (B, H, S - window): averaged over the window's queries
        s = F.avg_pool1d(s, self.kernel_size, stride=1, padding=self.kernel_size // 2)  # zeros pad the ends
        s = _by_kv_head(s, H_kv)  # (B, H_kv, S - window)
        return torch.cat([s, (s.max() + 1).expand(*s.shape[:-1], self.window_size)], -1)  # the window: kept


@dataclass
class PyramidKVPress(SnapKVPress):
    """PyramidKV: SnapKV's scores, more tokens in the lower layers and fewer in the upper ones.

    ``beta`` sets the slope: the last layer keeps ``1/beta`` of the average budget beyond the
    window. Where the pyramid cannot fit (short prompts, small budgets) it falls back to
    SnapKV's budget, rounded.
    """

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        int_at_least("beta", self.beta, 1)

    def n_kept(self, seq_len, compression_ratio, layer_idx=0, n_layer=1):
        w = self.window_size
        mean_extra = seq_len * (1 - compression_ratio)  # the average layer's tokens beyond the window
        low = mean_extra / self.beta  # the last layer's
        high = 2 * mean_extra - low  # the first layer's: the mean of low and high is mean_extra
        if high >= seq_len - w:  # the first layer cannot hold more than the prompt
            high = seq_len - w
            low = 2 * mean_extra - high
        if not seq_len >= high >= low >= w:
            return max(1, round(seq_len * (1 - compression_ratio)))  # no pyramid: SnapKV's budget
        step = (high - low) / (n_layer - 1) if n_layer > 1 else 0.0
        return round(high - layer_idx * step)


@dataclass
class TOVAPress(Press):
    """TOVA: the last prompt query's attention, averaged over all query heads (one choice for all KV heads)."""

    def validate(self, seq_len: int) -> None:
        if positive_int("seq_len", seq_len) < 2:
            raise ValueError(f"TOVAPress needs at least 2 prompt tokens, got {seq_len}")

    def score(self, queries, keys, values, rope_base=None):
        B, H, H_kv, S, D = _check_qkv(queries, keys, values)
        self.validate(S)
        s = window_attention(queries, keys, 1)[:, :, 0].mean(dim=1)  # (B, S - 1): mean over every head
        s = s[:, None].expand(B, H_kv, S - 1)  # (B, H_kv, S - 1): the same for each KV head
        return torch.cat([s, (s.max() + 1).expand(*s.shape[:-1], 1)], -1)  # the last token: kept (no read)


@dataclass
class ExpectedAttentionPress(Press):
    """Expected Attention: the attention future queries should pay, from the prompt's query statistics.

    The prompt's queries (before RoPE, the first ``n_sink`` left out) give a mean ``mu`` and a
    covariance ``C`` per head. A future query at position ``t`` is rotated by ``R_t``; averaging
    ``R_t`` over the next ``n_future_positions`` positions gives ``R``. If ``q ~ N(R mu, R C R^T)``
    then ``E[exp(q . k / sqrt(D))] = exp(k . R mu / sqrt(D) + k^T R C R^T k / (2 D))``; the softmax
    of that over keys, averaged over a KV head's query heads, times ``||v||`` (+ ``epsilon``
    first) is the score. The first ``n_sink`` tokens are always kept.
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        positive_int("n_future_positions", self.n_future_positions)
        int_at_least("n_sink", self.n_sink, 0)

    def validate(self, seq_len: int) -> None:
        if positive_int("seq_len", seq_len) <= self.n_sink:
            raise ValueError(f"ExpectedAttentionPress needs more prompt tokens than n_sink={self.n_sink}, "
                             f"got {seq_len}")

    def score(self, queries, keys, values, rope_base=None):
        B, H, H_kv, S, D = _check_qkv(queries, keys, values)
        self.validate(S)
        if rope_base is None or not rope_base > 0:
            raise ValueError(f"ExpectedAttentionPress needs the model's rope_base (a positive number), "
                             f"got {rope_base!r}: PressCache(..., rope_base=model.config.rope_base)")
        n = self.n_sink
        pos = torch.arange(n, S, device=queries.device)[None]  # (1, S - n)
        cos, sin = rope_cos_sin(-pos, D, rope_base, torch.float32)  # rotate back: queries before RoPE
        q = apply_rope(queries[:, :, n:].float(), cos[:, None], sin[:, None])  # (B, H, S - n, D)
        mu = q.mean(dim=2)  # (B, H, D)
        # R_t is linear, so apply_rope(I) lists its columns: rows of R_t^T. Their mean is R^T.
        future = torch.arange(S, S + self.n_future_positions, device=queries.device)[None]
        cos, sin = rope_cos_sin(future, D, rope_base, torch.float32)  # (1, F, D)
        eye = torch.eye(D, device=queries.device)
        RT = apply_rope(eye[None], cos[0][:, None], sin[0][:, None]).mean(dim=0)  # (D, D): R^T
        mu = mu @ RT  # (B, H, D): R mu
        k = repeat_kv(keys[:, :, n:].float(), H // H_kv)  # (B, H, S - n, D)
        logits = (k @ mu[..., None])[..., 0] / math.sqrt(D)  # (B, H, S - n)
        if self.use_covariance:
            centered = q - q.mean(dim=2, keepdim=True)
            cov = centered.transpose(-2, -1) @ centered / (S - n)  # (B, H, D, D)
            cov = RT.T @ cov @ RT  # R C R^T
            logits = logits + ((k @ cov) * k).sum(-1) / D / 2  # k^T (R C R^T) k / (2 D)
        s = _by_kv_head(softmax(logits, dim=-1), H_kv)  # (B, H_kv, S - n)
        if self.use_vnorm:
            s = (s + self.epsilon) * values[:, :, n:].float().norm(dim=-1)
        s = s.to(keys.dtype)
        return torch.cat([(s.max() + 1).expand(*s.shape[:-1], n), s], -1)  # the sinks: kept first (no read)


@dataclass
class StreamingLLMPress(Press):
    """StreamingLLM as a press: the first ``n_sink`` tokens, then the most recent.

    kvpress scores 1 for the sinks and the last ``n_kept - n_sink`` tokens and 0 in between,
    which needs the ratio; we score the sinks above everything and every other token by its
    position, which keeps the same tokens at any ratio. Positions stay absolute: kvpress's
    ``KeyRerotationPress`` (not here) renumbers them as the paper and `kvlib.evict.SinkCache` do.
    """

    n_sink: int = 4

    def __post_init__(self) -> None:
        int_at_least("n_sink", self.n_sink, 0)

    def validate(self, seq_len: int) -> None:
        if positive_int("seq_len", seq_len) <= self.n_sink:
            raise ValueError(f"StreamingLLMPress needs more prompt tokens than n_sink={self.n_sink}, got {seq_len}")

    def score(self, queries, keys, values, rope_base=None):
        B, H_kv, S, _ = keys.shape
        self.validate(S)
        s = torch.arange(S, device=keys.device, dtype=torch.float32).expand(B, H_kv, S).clone()
        s[..., : self.n_sink] = S  # above every recent token
        return s


PRESSES = {"snapkv": SnapKVPress, "pyramidkv": PyramidKVPress, "tova": TOVAPress,
           "expected_attention": ExpectedAttentionPress, "streaming_llm": StreamingLLMPress}


def as_press(press: Press | str) -> Press:
    """A press, or a name in `PRESSES` (with kvpress's default hyper-parameters)."""
    if isinstance(press, str):
        if press not in PRESSES:
            raise ValueError(f"unknown press {press!r}; the presses are {sorted(PRESSES)}")
        return PRESSES[press]()
    if not isinstance(press, Press):
        raise TypeError(f"press must be a Press or one of {sorted(PRESSES)}, got {type(press).__name__}")
    return press


def check_ratio(compression_ratio: object) -> float:
    """``compression_ratio`` if it is a number in ``[0, 1)``; else ``TypeError``/``ValueError``."""
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)):
        raise TypeError(f"compression_ratio must be a float, got {type(compression_ratio).__name__}")
    if not 0 <= compression_ratio < 1:
        raise ValueError(f"compression_ratio must be in [0, 1) (the share of prompt tokens evicted), "
                         f"got {compression_ratio!r}")
    return float(compression_ratio)


def keep_top(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """Indices ``(B, H_kv, n_kept)`` of the highest ``scores`` ``(B, H_kv, S)``, ascending;
    equal scores keep the older token (a stable sort)."""
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n_kept]
    return top.sort(dim=-1).values


class PressCache(_Budgeted):
    """A cache compressed once, right after its prefill, by a press; decoding appends without eviction.

    The first update of an empty layer is its prefill. The cache's `attention` (which `prefill` installs with
    ``model.set_attention_impl``) computes that step exactly as the model's default kernel would, then scores the
    layer's prompt with the press and keeps the top `n_kept` tokens per KV head. Later updates append. Positions
    stay absolute, and `kept_positions` gives each layer's held positions ``(B, H_kv, n)``, ascending.

    With ``compression_ratio=0`` nothing is scored or evicted and the cache behaves as a `kvlib.DynamicCache`.
    Otherwise a prefilled layer whose attention did not run here cannot be compressed; its next update raises.
    """

    def __init__(self, n_layer: int, press: Press | str, compression_ratio: float,
                 *, rope_base: float | None = None) -> None:
        self.press, self.compression_ratio = as_press(press), check_ratio(compression_ratio)
        self.rope_base = rope_base
        super().__init__(n_layer, budget=0, recent=0)  # no running budget: the press decides once

    def reset(self) -> None:
        super().reset()
        self.pending = [False] * self.n_layer  # prefilled, not yet compressed
        self.pressed_at = [0] * self.n_layer  # tokens seen when each layer was compressed (0: not yet)
        self.last_layer: int | None = None

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        if self.pending[layer_idx]:
            raise ValueError(
                f"PressCache compresses in its own attention, and layer {layer_idx}'s prefill did not run it: "
                f"use kvlib.press.prefill(model, ids, press, ratio), or model.set_attention_impl(cache.attention)")
        prefill = self.get_seq_length(layer_idx) == 0 and self.compression_ratio > 0
        if prefill:
            self.press.validate(key_states.shape[2])  # before the forward goes further
        self._append(layer_idx, key_states, value_states, None)
        self.pending[layer_idx] = prefill
        self.last_layer = layer_idx
        return self.keys[layer_idx], self.values[layer_idx]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The model's default attention ``(B, H, T, D)``; after a prefill, the layer is then compressed."""
        if self.last_layer is None or k.shape[2] != self.get_seq_length(self.last_layer):
            raise ValueError("PressCache.attention must follow this cache's own update in the same layer")
        y = attend_default(q, k, v, mask)  # the model's default kernel, bit for bit (kvlib.attention)
        self._compress(self.last_layer, q)
        return y

    def _compress(self, layer: int, queries: torch.Tensor) -> None:
        if not self.pending[layer]:
            return
        self.pending[layer] = False
        k, v = self.keys[layer], self.values[layer]
        scores = self.press.score(queries, k, v, self.rope_base)  # (B, H_kv, S)
        n = self.press.n_kept(k.shape[2], self.compression_ratio, layer, self.n_layer)
        keep = keep_top(scores, min(n, k.shape[2]))  # (B, H_kv, n)
        idx = keep[..., None].expand(-1, -1, -1, k.shape[3])  # (B, H_kv, n, D)
        self.keys[layer], self.values[layer] = k.gather(2, idx), v.gather(2, idx)
        self.pos[layer] = self.pos[layer].gather(2, keep)
        self.pressed_at[layer] = self.seen[layer]
        self.count_written(self.keys[layer], self.values[layer])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens of the text: 0, or from the compressed prompt's length on
        (which prompt tokens the press kept depended on all of them)."""
        super().crop(max_length)
        self.pending = [p and self.get_seq_length(i) > 0 for i, p in enumerate(self.pending)]

    def _check_crop(self, n: int) -> None:
        if n < max(self.pressed_at):
            raise ValueError(f"cannot crop PressCache to {n} tokens: it compressed its {max(self.pressed_at)}-token "
                             f"prompt, whose kept tokens depended on all of it; prefill the first {n} again")


@torch.inference_mode()
def prefill_many(model: Transformer, ids: torch.Tensor, settings: list[tuple[Press | str, float]]
                 ) -> tuple[list[PressCache], torch.Tensor]:
    """One prefill of ``ids`` ``(B, S)`` compressed by each ``(press, compression_ratio)`` of
    ``settings``: the caches, in order, and the last position's logits ``(B, vocab)``.

    The model runs once; each layer's attention is computed once, then every cache scores
    and compresses its own copy of the layer's prompt."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a kvlib Transformer, got {type(model).__name__}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be an int64 tensor of token ids, got {type(ids).__name__}")
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be (S,) or (B, S) with S >= 1, got shape {tuple(ids.shape)}")
    if not isinstance(settings, (list, tuple)) or not settings:
        raise ValueError("settings must be a non-empty list of (press, compression_ratio) pairs")
    cfg = model.config
    caches = [PressCache(cfg.n_layer, p, r, rope_base=cfg.rope_base) for p, r in settings]
    for c in caches:
        if c.compression_ratio > 0:
            c.press.validate(ids.shape[1])
    lead, rest = caches[0], caches[1:]

    def attention(q, k, v, mask):  # k, v: the lead cache's copy of the layer's prompt
        layer = lead.last_layer
        for c in rest:
            c.update(k, v, layer)
            c._compress(layer, q)
        return lead.attention(q, k, v, mask)

    before = [block.attn.impl for block in model.layers]
    model.set_attention_impl(attention)
    try:
        logits = model(ids.to(model.device), lead, last_only=True)[:, -1]  # (B, vocab)
    finally:
        for block, impl in zip(model.layers, before):
            block.attn.impl = impl
    return caches, logits


def prefill(model: Transformer, ids: torch.Tensor, press: Press | str,
            compression_ratio: float) -> tuple[PressCache, torch.Tensor]:
    """Run the prompt ``ids`` ``(S,)`` or ``(B, S)`` through ``model``, compress it with ``press``.

    Returns the `PressCache`, ready for `kvlib.decode_step`, and the prompt's last logits
    ``(B, vocab)``, which the compression cannot change (it acts after each layer's attention).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> ids = torch.arange(1, 41)[None]  # a 40-token prompt
    >>> cache, logits = kvlib.press.prefill(model, ids, kvlib.press.SnapKVPress(window_size=8), 0.5)
    >>> cache.seq_len  # half the prompt kept
    20
    >>> torch.allclose(logits, model(ids)[:, -1], atol=1e-5)  # the prompt's last logits are untouched
    True
    """
    (cache,), logits = prefill_many(model, ids, [(press, compression_ratio)])
    return cache, logits

