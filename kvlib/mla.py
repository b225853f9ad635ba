"""Multi-head latent attention (MLA), in the style of DeepSeek-V2.

MHA caches ``2 * H * D`` numbers per token per layer. MLA caches a single
latent vector ``c_kv`` of ``d_c`` numbers, from which every head's key and
value are *up-projected*, plus one small RoPE key ``k_rope`` of ``d_rope``
numbers shared by all heads (RoPE cannot be folded into the up-projection,
so the position-dependent part of the key is kept apart, "decoupled")::

    c_kv   = RMSNorm(x W_dkv)                      (B, T, d_c)      cached
    k_rope = RoPE(x W_kr)                          (B, T, d_rope)   cached
    k_h    = [c_kv W_uk_h , k_rope]                (B, S, d_nope + d_rope)
    v_h    =  c_kv W_uv_h                          (B, S, d_v)
    q_h    = [q_nope_h , RoPE(q_rope_h)]

Two ways to compute the same attention:

* **naive**: up-project the whole cached ``c_kv`` to keys and values at every
  step, then attend as usual. Work per step grows with ``S * d_c * H * (d_nope + d_v)``.
* **absorbed**: ``q_nope_h · (c_kv W_uk_h) = (q_nope_h W_uk_hᵀ) · c_kv``, so fold
  ``W_uk`` into the query and attend over ``c_kv`` directly; likewise apply
  ``W_uv`` after the weighted sum of latents. The cache is read as it is.
  A head's score is two dot products, ``q^C·k^C + q^R·k^R``, which is one dot
  product of concatenations: ``[q_nope_h W_uk_hᵀ, q_rope_h] · [c_kv, k_rope]``.
  So the absorbed form *is* multi-query attention (`MLAAttention.absorbed_qkv`):
  ``H`` query heads share one KV head whose keys are ``d_c + d_rope`` wide
  (576 in DeepSeek-V2) and whose values are the ``d_c``-wide latents.

Both are here, and the tests check that they agree. `cost_per_cached_token`
counts what each form reads and computes per cached token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .attention import causal_mask, softmax
from .cache import DynamicCache
from .model import Linear, RMSNorm, apply_rope, rope_cos_sin
from .validate import positive_int


@dataclass(frozen=True)
class MLAConfig:
    d_model: int
    n_head: int
    d_c: int  # latent width: DeepSeek-V2's kv_lora_rank
    d_nope: int  # per-head key width that comes from the latent (qk_nope_head_dim)
    d_rope: int  # width of the shared, RoPE-rotated key (qk_rope_head_dim)
    d_v: int  # per-head value width (v_head_dim)
    d_cq: int | None = None  # query latent width (q_lora_rank); None: a full-rank query projection
    n_layer: int = 1
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("d_model", "n_head", "d_c", "d_nope", "d_rope", "d_v", "n_layer"):
            v = getattr(self, f)
            positive_int(f"MLAConfig.{f}", v)
        if self.d_rope % 2:
            raise ValueError(f"RoPE rotates pairs, so d_rope must be even, got {self.d_rope}")
        if self.d_cq is not None and (not isinstance(self.d_cq, int) or self.d_cq <= 0):
            raise ValueError(f"d_cq must be a positive int or None, got {self.d_cq!r}")

    def kv_elements_per_token(self) -> int:
        """Numbers cached per token, all layers: ``n_layer * (d_c + d_rope)``."""
        return self.n_layer * (self.d_c + self.d_rope)

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        return self.kv_elements_per_token() * dtype_bytes


# DeepSeek-V2 (236 B total, 21 B active parameters), from its paper and config.json:
# 60 layers, d_model 5120, 128 heads, kv_lora_rank 512, q_lora_rank 1536,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
DEEPSEEK_V2 = MLAConfig(d_model=5120, n_head=128, d_c=512, d_nope=128, d_rope=64, d_v=128, d_cq=1536,
                        n_layer=60, name="DeepSeek-V2")
# DeepSeek-V2-Lite (16 B total): the same head shapes, 16 heads, full-rank queries, 27 layers.
DEEPSEEK_V2_LITE = MLAConfig(d_model=2048, n_head=16, d_c=512, d_nope=128, d_rope=64, d_v=128, d_cq=None,
                             n_layer=27, name="DeepSeek-V2-Lite")


class LatentCache(DynamicCache):
    """A per-layer cache of ``c_kv`` ``(B, 1, S, d_c)`` (in ``keys``) and ``k_rope`` ``(B, 1, S, d_rope)`` (in ``values``).

    The same `Cache` protocol as the K/V caches (``update``, ``seq_len``, ``nbytes``,
    ``crop``, ``reset``); only the two tensors have different widths, so its `spec` is a
    `CacheSpec` with ``kv_heads=1``, ``head_dim=d_c`` and ``value_dim=d_rope``, and every
    later update is checked against it (batch, widths, dtype and device).
    """

    same_width = False  # c_kv (d_c wide) and k_rope (d_rope wide)

    @classmethod
    def for_model(cls, model_or_config: object) -> "LatentCache":
        """A cache for an `MLAAttention` layer or an `MLAConfig`: ``cfg.n_layer`` layers. It makes
        its tensors at the first update, in the dtype and on the device of what the layer writes."""
        cfg = getattr(model_or_config, "cfg", model_or_config)
        if not isinstance(cfg, MLAConfig):
            raise TypeError(f"LatentCache.for_model takes an MLAAttention or an MLAConfig, got "
                            f"{type(model_or_config).__name__}")
        return cls(cfg.n_layer)


class MLAAttention(nn.Module):
    """One MLA attention layer; ``forward(..., absorbed=True)`` uses the weight-absorbed form."""

    def __init__(self, cfg: MLAConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, dq = cfg.n_head, cfg.d_nope + cfg.d_rope
        if cfg.d_cq is None:
            self.w_q = Linear(cfg.d_model, H * dq)
        else:  # low-rank query: DeepSeek-V2 compresses queries too (it saves activations, not cache)
            self.w_dq = Linear(cfg.d_model, cfg.d_cq)
            self.q_norm = RMSNorm(cfg.d_cq, cfg.norm_eps)
            self.w_uq = Linear(cfg.d_cq, H * dq)
        self.w_dkv = Linear(cfg.d_model, cfg.d_c + cfg.d_rope)  # columns [c_kv | k_rope]
        self.kv_norm = RMSNorm(cfg.d_c, cfg.norm_eps)
        self.w_ukv = Linear(cfg.d_c, H * (cfg.d_nope + cfg.d_v))  # per head: [W_uk | W_uv]
        self.w_o = Linear(H * cfg.d_v, cfg.d_model)

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> "MLAAttention":
        """Random weights (norms at 1), for tests and toy experiments."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * std)
        return self

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` ``(d_c, H, d_nope)`` and ``W_uv`` ``(d_c, H, d_v)``, views of ``w_ukv``."""
        c = self.cfg
        w = self.w_ukv.weight.view(c.d_c, c.n_head, c.d_nope + c.d_v)  # (d_c, H, d_nope + d_v)
        return w[..., : c.d_nope], w[..., c.d_nope :]

    @property
    def scale(self) -> float:
        """The softmax scale, ``1 / sqrt(d_nope + d_rope)``: a head's key is that wide."""
        return 1.0 / math.sqrt(self.cfg.d_nope + self.cfg.d_rope)

    def _check_x(self, x: torch.Tensor) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a (B, T, d_model) tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.cfg.d_model}), got {tuple(x.shape)}")
        return x.shape[0], x.shape[1]

    def _project(self, x: torch.Tensor, positions: torch.Tensor | None, cache: LatentCache | None):
        """The new tokens' query parts, and the latents and RoPE keys of every cached token."""
        c = self.cfg
        B, T = self._check_x(x)
        past = 0 if cache is None else cache.tokens_seen
        if positions is None:
            positions = torch.arange(past, past + T, device=x.device)
        cos, sin = rope_cos_sin(positions.expand(B, T), c.d_rope, c.rope_base, dtype=x.dtype)  # (B, T, d_rope)

        q = self.w_q(x) if c.d_cq is None else self.w_uq(self.q_norm(self.w_dq(x)))
        q = q.view(B, T, c.n_head, c.d_nope + c.d_rope)  # (B, T, H, d_nope + d_rope)
        q_nope, q_rope = q.split([c.d_nope, c.d_rope], dim=-1)
        q_rope = apply_rope(q_rope, cos[:, :, None], sin[:, :, None])  # (B, T, H, d_rope)

        c_kv, k_rope = self.w_dkv(x).split([c.d_c, c.d_rope], dim=-1)  # (B, T, d_c), (B, T, d_rope)
        c_kv = self.kv_norm(c_kv)
        k_rope = apply_rope(k_rope, cos, sin)  # one rotated key for all heads
        if cache is not None:  # cache the latent and the RoPE key; nothing per head
            c_all, kr_all = cache.update(c_kv[:, None], k_rope[:, None], self.layer)  # (B, 1, S, .)
            c_kv, k_rope = c_all[:, 0], kr_all[:, 0]  # (B, S, d_c), (B, S, d_rope)
        return q_nope, q_rope, c_kv, k_rope

    def absorbed_qkv(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: LatentCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The absorbed form as multi-query attention: one KV head shared by all ``H`` heads.

        Returns ``q`` ``(B, H, T, d_c + d_rope)`` (each head's ``[q_nope W_ukᵀ, q_rope]``),
        ``k`` ``(B, 1, S, d_c + d_rope)`` (the cached ``[c_kv, k_rope]`` as it is) and
        ``v`` ``(B, 1, S, d_c)`` (the cached latent). Attention over them, with scale
        `scale`, then ``W_uv`` per head, is the layer's attention. Like ``forward``, it
        appends ``x``'s latent to ``cache``.
        """
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions, cache)
        W_uk, _ = self._up_weights()
        q_lat = torch.einsum("bthn,chn->bhtc", q_nope, W_uk)  # (B, H, T, d_c): W_uk folded into q
        q = torch.cat([q_lat, q_rope.transpose(1, 2)], dim=-1)  # (B, H, T, d_c + d_rope)
        k = torch.cat([c_kv, k_rope], dim=-1)[:, None]  # (B, 1, S, d_c + d_rope)
        return q, k, c_kv[:, None]  # v: (B, 1, S, d_c)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LatentCache | None = None,
        absorbed: bool = False,
    ) -> torch.Tensor:
        """``x`` ``(B, T, d_model)`` -> ``(B, T, d_model)``; the new tokens follow whatever ``cache`` holds."""
        c = self.cfg
        B, T = self._check_x(x)
        H = c.n_head
        W_uk, W_uv = self._up_weights()
        if absorbed:  # multi-query attention over the latents, then W_uv once per head
            q, k, v = self.absorbed_qkv(x, positions, cache)
            S = k.shape[2]
            mask = causal_mask(T, S, device=x.device)  # (T, S), bottom-right
            scores = torch.einsum("bhtc,bsc->bhts", q, k[:, 0]) * self.scale  # q^C·k^C + q^R·k^R
            w = softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, T, S)
            o_lat = torch.einsum("bhts,bsc->bhtc", w, v[:, 0])  # (B, H, T, d_c): weighted latents
            o = torch.einsum("bhtc,chv->bthv", o_lat, W_uv)  # (B, T, H, d_v): W_uv applied once
        else:  # up-project every cached latent to per-head keys and values, at every step
            q_nope, q_rope, c_kv, k_rope = self._project(x, positions, cache)
            S = c_kv.shape[1]
            mask = causal_mask(T, S, device=x.device)  # (T, S), bottom-right
            k_nope = torch.einsum("bsc,chn->bhsn", c_kv, W_uk)  # (B, H, S, d_nope): all S, every step
            v = torch.einsum("bsc,chv->bhsv", c_kv, W_uv)  # (B, H, S, d_v)
            k_r = k_rope[:, None].expand(B, H, S, c.d_rope)  # (B, H, S, d_rope): shared by the heads
            k = torch.cat([k_nope, k_r], dim=-1)  # (B, H, S, d_nope + d_rope)
            qh = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # (B, H, T, d_nope + d_rope)
            scores = (qh @ k.transpose(-2, -1)) * self.scale  # (B, H, T, S)
            w = softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = (w @ v).transpose(1, 2)  # (B, T, H, d_v)
        return self.w_o(o.reshape(B, T, H * c.d_v))


def cost_per_cached_token(cfg: MLAConfig, form: str = "absorbed", dtype_bytes: float = 2) -> dict[str, float]:
    """Bytes read and FLOPs done for each cached token, per layer, by one decode query.

    ``form``: "absorbed" (MQA over the ``d_c + d_rope`` latent), "naive" (up-project each
    cached latent to every head's key and value, then attend), or "expanded" (a cache of
    the up-projected keys and values, as multi-head attention stores them). A multiply-add
    is 2 FLOPs; ``intensity`` is FLOPs per byte, to set against a roofline's ridge.
    """
    if not isinstance(cfg, MLAConfig):
        raise TypeError(f"cfg must be an MLAConfig, got {type(cfg).__name__}")
    if not isinstance(dtype_bytes, (int, float)) or isinstance(dtype_bytes, bool) or not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be a positive number, got {dtype_bytes!r}")
    H, dk = cfg.n_head, cfg.d_nope + cfg.d_rope
    attend_kv = H * (dk + cfg.d_v)  # multiply-adds: scores against a key, weight on a value
    macs = {
        "expanded": attend_kv,
        "naive": H * cfg.d_c * (cfg.d_nope + cfg.d_v) + attend_kv,  # up-projection, then the same
        "absorbed": H * (cfg.d_c + cfg.d_rope) + H * cfg.d_c,  # 576-wide keys, 512-wide values
    }
    if form not in macs:
        raise ValueError(f"form must be one of {sorted(macs)}, got {form!r}")
    numbers = H * (dk + cfg.d_v) if form == "expanded" else cfg.d_c + cfg.d_rope  # cached per token
    out = {"bytes": numbers * dtype_bytes, "flops": 2 * macs[form]}
    out["intensity"] = out["flops"] / out["bytes"]
    return out
