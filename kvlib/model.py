"""A Llama-style decoder with one forward path for every way of running it.

``model(tokens)`` recomputes everything (the naive loop). ``model(tokens, cache=c)`` on an empty cache is a
*prefill*; the same call with one new token per sequence is a *decode step*. Positions default to "right after what
the cache holds", so the three cases share every line below.

Blocks are pre-norm: RMSNorm -> attention (RoPE on q and k, GQA via ``n_kv_head``) -> residual, RMSNorm -> SwiGLU
MLP -> residual.

The parts are public, so that a reader can wire a layer by hand and compare it with the model's own (chapter 2
does): `Transformer` has ``embed``, ``layers``, ``norm`` and ``lm_head``; each `Block` has ``attn_norm``, ``attn``,
``mlp_norm`` and ``mlp``; each `Attention` has ``wqkv``, ``wo`` and ``layer``; `rope_cos_sin` and `apply_rope`
rotate (from the leaf module `kvlib.rope`, importable from here too). Their docstrings give the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import hybrid, invariant
from .attention import AttentionImpl, attend, attention_mask
from .cache import Cache
from .config import ModelConfig
from .rope import apply_rope, rope_cos_sin, rope_table  # re-exported: kvlib.model.apply_rope is where they were
from .validate import an_int, check_token_range, int_in_range, positions_to_score


class Linear(nn.Module):
    """``y = x @ weight`` with ``weight`` stored ``(in_features, out_features)``.

    ``nn.Linear`` stores the transpose, ``(out, in)``. The math is identical;
    the layout matters for speed. A decode step multiplies one row vector by
    every weight matrix, and on the CPUs we measured, torch's matrix-vector
    path streamed small ``(in, out)`` matrices (SmolLM2's are a few MB) clearly
    faster than ``(out, in)`` ones, and large ones about equally fast
    (``python -m kvbench`` reports both ratios).
    """

    batch_invariant = False  # set by Transformer.set_batch_invariant: every row by the same call

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.linear(x, self.weight)
        return x @ self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[0]}, out_features={self.weight.shape[1]}"


class RMSNorm(nn.Module):
    batch_invariant = False  # set by Transformer.set_batch_invariant: a fixed-order mean

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused call; same result as the lines below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()  # normalise in fp32 even when the model runs in half precision
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """One layer's grouped-query self-attention, with RoPE and the cache call.

    ``attn(x, cos, sin, cache, mask)``: ``x`` ``(B, T, d_model)`` (already normalised by the
    block's ``attn_norm``), ``cos``/``sin`` ``(B, T, 1, head_dim)`` from `rope_cos_sin`,
    ``mask`` as `attend` takes it; returns ``(B, T, d_model)``. Its parts, for wiring by hand
    (``H = n_head``, ``H_kv = n_kv_head``, ``D = head_dim``):

    - ``wqkv``: a `Linear`, weight ``(d_model, (H + 2 * H_kv) * D)``. Its output viewed as
      ``(B, T, H + 2 * H_kv, D)`` holds the H query heads, then the H_kv key heads, then
      the H_kv value heads: ``[q | k | v]``.
    - ``wo``: a `Linear`, weight ``(H * D, d_model)``, applied to the heads concatenated.
    - ``layer``: this layer's index, the ``layer_idx`` it passes to ``cache.update``.
    - ``n_head``, ``n_kv_head``, ``head_dim``: H, H_kv and D.
    - ``impl``: the attention kernel, set by `Transformer.set_attention_impl`.

    (`kvlib.wquant.quantize_weights` replaces ``wqkv`` and ``wo`` by quantized layers of the
    same shapes.)
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v in one matmul: columns [q | k | v]
        self.wqkv = Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim)
        self.wo = Linear(cfg.n_head * cfg.head_dim, cfg.d_model)
        # "sdpa" (torch's fused kernel), "reference" (kvlib.attention), or your own
        # fn(q, k, v, mask) -> y; see Transformer.set_attention_impl
        self.impl: AttentionImpl = "sdpa"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * H_kv, D)  # (B, T, heads, D): [q | k | v] heads
        qk = apply_rope(qkv[:, :, : H + H_kv], cos, sin)  # q and k share positions: rotate both at once
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
        k = qk[:, :, H:].transpose(1, 2)  # (B, H_kv, T, D)
        v = qkv[:, :, H + H_kv :].transpose(1, 2)  # (B, H_kv, T, D)
        if cache is None:
            y = attend(q, k, v, mask, self.impl)  # (B, H, T, D); mask None = plain bottom-right causal
        else:  # NEW: append this step's k, v; attend over everything cached (cache.update, then attend)
            y = cache.update_and_attend(q, k, v, self.layer, mask, self.impl)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.wo(y)


class MLP(nn.Module):
    """SwiGLU: ``w_down(silu(gate) * up)``, with ``gate`` and ``up`` the two halves of ``w_gate_up(x)``.

    Its parts: ``w_gate_up``, a `Linear` with weight ``(d_model, 2 * d_ff)`` (columns
    ``[gate | up]``), and ``w_down``, a `Linear` with weight ``(d_ff, d_model)``.
    """

    batch_invariant = False  # set by Transformer.set_batch_invariant: silu off the scalar tail

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = Linear(cfg.d_model, 2 * cfg.d_ff)  # columns [gate | up]
        self.w_down = Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        act = invariant.elementwise(F.silu, gate) if self.batch_invariant else F.silu(gate)
        return self.w_down(act * up)  # SwiGLU


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``.

    ``block(x, cos, sin, cache, mask)`` maps ``(B, T, d_model)`` to ``(B, T, d_model)``, with
    the arguments `Attention` takes. Its parts: ``attn_norm`` and ``mlp_norm`` (`RMSNorm`
    over ``d_model``), ``attn`` (`Attention`) and ``mlp`` (`MLP`).
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """A Llama-family decoder built from a `ModelConfig`.

    Its parts, for wiring a forward by hand: ``embed(tokens)`` (ids ``(B, T)`` to
    ``(B, T, d_model)``), ``layers`` (the `Block` list, ``n_layer`` long), ``norm`` (the
    final `RMSNorm`) and ``lm_head`` (a `Linear`, weight ``(d_model, vocab_size)``; with
    tied embeddings it is also the embedding table, and ``tok_emb`` is None).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.DynamicCache(model.config.n_layer)
    >>> model(torch.tensor([[1, 2, 3]]), cache).shape  # the prefill: logits (B, T, vocab)
    torch.Size([1, 3, 128])
    >>> model(torch.tensor([[4]]), cache).shape, cache.seq_len  # one decode step
    (torch.Size([1, 1, 128]), 4)
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Transformer needs a ModelConfig, got {type(config).__name__}")
        if config.family != "llama" or any(kind.kind == "latent" for kind in config.layer_kinds()):
            raise ValueError(f"kvlib only runs Llama-family models with K/V caches; {config.name or config.family} "
                             f"is for memory math (latent MLA layers run in kvlib.mla)")
        self.config = config
        with torch.device(device) if device is not None else nullcontext():
            # tied embeddings: one (d_model, vocab) matrix for both ends (the lm_head, and a token's column)
            self.tok_emb = None if config.tie_embeddings else nn.Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = Linear(config.d_model, config.vocab_size)
        if dtype is not None:
            self.to(dtype=dtype)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # set_batch_invariant's
        if self.lm_head.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None, std: float = 0.02) -> None:
        """Random weights (normal with ``std``; norms at 1): for tests and toy models.

        The default 0.02 gives nearly flat logits; tests that compare greedy tokens use
        ``std=0.2`` so that no two logits tie and argmax is decided by the model, not rounding.
        """
        if not std > 0:
            raise ValueError(f"std must be positive, got {std!r}")
        g = torch.Generator(device="cpu")
        g.manual_seed(seed) if seed is not None else g.seed()
        with torch.no_grad():
            for name, p in self.named_parameters():  # norms at 1, everything else drawn
                p.fill_(1.0) if name.endswith("norm.weight") else p.copy_(torch.randn(p.shape, generator=g) * std)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # the final norm: float even when kvlib.wquant stores matrices in int8

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, d_model)`` vectors."""
        if self.tok_emb is None:
            if hasattr(self.lm_head, "embedding_rows"):  # a quantized lm_head (kvlib.wquant) reads its own rows
                return self.lm_head.embedding_rows(tokens)
            return F.embedding(tokens, self.lm_head.weight.t())  # rows of (vocab, d_model) view
        return self.tok_emb(tokens)

    def forward(self, tokens: torch.Tensor, cache: Cache | None = None, *, positions: torch.Tensor | None = None,
                key_valid: torch.Tensor | None = None, mask: torch.Tensor | None = None, last_only: bool = False,
                logits_to_keep: int = 0, logits_at: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` (or ``(B, 1, vocab)`` with ``last_only``).

        tokens: ``(B, T)`` int ids, appended after whatever ``cache`` holds.
        By default the cache says where they sit and what they may see
        (``cache.positions(tokens)``, ``cache.mask(tokens)``): right after its
        contents for a plain cache, per sequence for a `PaddedBatch` or `PagedBatch`.
        Explicit arguments win, and are checked against the step's shape:
        positions: ``(B, T)`` or ``(T,)`` RoPE positions.
        key_valid: ``(B, past + T)`` bool, ``False`` on padding keys.
        mask: ``(B or 1, 1, T, past + T)`` bool, True where a query may attend.

        logits_to_keep: score only the last this-many positions, ``(B, logits_to_keep,
        vocab)``; 0 keeps all (Hugging Face's argument of the same name). The vocabulary
        projection is a fifth of SmolLM2's FLOPs, so context tokens that are only there to be
        attended to should not pay for it. ``last_only`` is ``logits_to_keep=1``.
        logits_at: score only these positions of each row, ``(B, K, vocab)`` for ``K`` indices
        (a list of ints, or a ``(K,)`` int tensor; empty is allowed). A packed row holds many
        sequences, and sampling needs only each one's last token: vLLM's ``logits_indices``.

        Token ids are range-checked here only on the CPU, where it costs no device
        sync; `generate`, `stream` and the paged `Engine` check prompts once, up front.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be an int64/int32 tensor, got {getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be (batch, seq) with seq >= 1, got shape {tuple(tokens.shape)}")
        if tokens.device.type == "cpu":
            check_token_range(tokens, self.config.vocab_size)
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"cache must be a kvlib Cache, got {type(cache).__name__}")
        cache = hybrid.cache_for(self.config, cache)  # a hybrid model's cache must know its layers
        B, T = tokens.shape
        an_int("logits_to_keep", logits_to_keep)
        if not 0 <= logits_to_keep <= T:
            raise ValueError(f"logits_to_keep must be in [0, {T}] for {T} tokens, got {logits_to_keep}")
        if last_only:
            logits_to_keep = 1
        at = None if logits_at is None else positions_to_score(logits_at, T, tokens.device)
        if at is not None and logits_to_keep:
            raise ValueError(f"pass logits_at or last_only/logits_to_keep, not both (logits_to_keep={logits_to_keep})")
        # Keys attended to come after the `held` ones; positions count every token seen (kvlib.cache.protocol).
        # `end` is one past this step's largest position (a packed paged batch: its `longest` sequence).
        held, longest = (0, None) if cache is None else (cache.tokens_held, getattr(cache, "longest", None))
        end = (T if cache is None else cache.position_end(T)) if longest is None else longest
        if end > self.config.max_seq_len:
            raise ValueError(f"{end - T} tokens seen + {T} new tokens exceeds max_seq_len={self.config.max_seq_len}"
                             if longest is None else f"a sequence of {longest} tokens exceeds max_seq_len="
                             f"{self.config.max_seq_len}")
        positions = self._positions(tokens, cache, positions)
        mask = self._mask(tokens, cache, held, key_valid, mask)

        if self._rope_table is not None:  # batch-invariant: one table, looked up
            cos, sin = (t[positions].to(self.dtype) for t in self._rope_table)  # (B, T, D) each
        else:
            cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_base, dtype=self.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D): broadcast over heads
        x = self.embed(tokens)  # (B, T, d_model)
        for block in self.layers:
            x = block(x, cos, sin, cache, mask)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # (B, keep, d_model): generation needs only the last
        elif at is not None:
            x = x.index_select(1, at)  # (B, K, d_model): the chosen positions only
        return self.lm_head(self.norm(x))

    @staticmethod
    def _positions(tokens: torch.Tensor, cache: Cache | None, positions: torch.Tensor | None) -> torch.Tensor:
        B, T = tokens.shape
        if positions is None:
            if cache is not None:
                return cache.positions(tokens)
            return torch.arange(T, device=tokens.device).expand(B, T)
        if positions.dim() == 1 and positions.shape[0] == T:
            positions = positions[None].expand(B, T)  # (B, T)
        if positions.shape != (B, T):
            raise ValueError(f"positions must be (B, T)=({B}, {T}) or ({T},), got {tuple(positions.shape)}")
        return positions

    @staticmethod
    def _mask(
        tokens: torch.Tensor, cache: Cache | None, past: int, key_valid: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The step's mask: explicit ``mask``, else from ``key_valid``, else the cache's (None = plain causal)."""
        B, T = tokens.shape
        if mask is not None and key_valid is not None:
            raise ValueError("pass either mask or key_valid, not both")
        if key_valid is not None:
            return attention_mask(T, past + T, key_valid, device=tokens.device, pads_see_themselves=True)
        if mask is None:
            mask = None if cache is None else cache.mask(tokens)
            if mask is None:
                return None
            origin = f"{type(cache).__name__}.mask()"
        else:
            origin = "mask"
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1:] != (1, T, past + T):
            raise ValueError(
                f"{origin} must be bool ({B} or 1, 1, {T}, {past + T}) for {T} new tokens after {past} cached, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        return mask

    def _apply(self, fn, recurse: bool = True):
        # .to/.float/.cuda: a layer that cannot move (kvlib.prepack) refuses before any moves (nn.Module would not)
        for m in self.modules():
            if m is not self and hasattr(m, "check_apply"):
                m.check_apply(fn)
        return super()._apply(fn, recurse)

    def first_layers(self, n: int) -> "Transformer":
        """A smaller model made of this one's embedding, first ``n`` blocks, final norm and lm_head.

        The weights are shared, not copied. Its outputs are not good text, but it costs less than
        the full model (more than ``n / n_layer`` of it: the embedding and output layer stay).
        """
        int_in_range("n", n, 1, self.config.n_layer)
        small = Transformer(self.config.replace(n_layer=n, name=f"{self.config.name} (first {n} layers)"), device="meta")
        small.tok_emb, small.norm, small.lm_head = self.tok_emb, self.norm, self.lm_head
        small.layers = nn.ModuleList(self.layers[:n])
        small.use_rope_table_of(self)  # the shared blocks are batch-invariant if this model is
        return small.eval()

    def with_layers(self, layers) -> "Transformer":
        """This model with another layer pattern (`kvlib.layers`; None: all full), sharing its weights:
        how to measure what bolting a pattern onto weights trained without it costs."""
        other = Transformer(self.config.replace(layers=layers), device="meta")
        other.tok_emb, other.norm, other.lm_head, other.layers = self.tok_emb, self.norm, self.lm_head, self.layers
        other.use_rope_table_of(self)
        return other.eval()

    @property
    def batch_invariant(self) -> bool:
        """Whether `set_batch_invariant` is on: every reduction in an order no batch can change."""
        return self._rope_table is not None

    def set_batch_invariant(self, on: bool = True) -> None:
        """Make a sequence's logits bit-identical whatever it is batched, cached or chunked with.

        Every `Linear` then multiplies row by row, `RMSNorm` and attention sum in a fixed
        order, and RoPE reads one table (`kvlib.invariant` explains each). Slower, a prefill
        most of all; ``on=False`` restores the fast kernels. Call it after moving the model.
        """
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool, got {type(on).__name__}")
        linears = [self.lm_head] + [m for b in self.layers for m in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up,
                                                                      b.mlp.w_down)]
        if not all(hasattr(m, "batch_invariant") for m in linears):  # kvlib.wquant's and prepack's layers
            raise TypeError("set_batch_invariant needs plain kvlib Linear layers; "
                            "this model has quantized or prepacked ones")
        for m in self.modules():
            if isinstance(getattr(type(m), "batch_invariant", None), bool):  # Linear, RMSNorm, MLP (not the model)
                m.batch_invariant = on
        self.set_attention_impl(invariant.attention if on else "sdpa")
        c = self.config  # every position's cos and sin in one call, once: each position's bits are then fixed
        self._rope_table = rope_table(c.max_seq_len, c.head_dim, c.rope_base, dtype=self.dtype,
                                      device=self.device) if on else None

    def use_rope_table_of(self, source: "Transformer") -> None:
        """Look RoPE up in ``source``'s table (None unless ``source`` is batch-invariant), as a model
        built from ``source``'s layers must (`first_layers`, `with_layers`, a tensor-parallel shard)."""
        if not isinstance(source, Transformer):
            raise TypeError(f"use_rope_table_of needs a kvlib Transformer, got {type(source).__name__}")
        mine, theirs = self.config, source.config
        fits = mine.max_seq_len <= theirs.max_seq_len
        if (mine.head_dim, mine.rope_base) != (theirs.head_dim, theirs.rope_base) or not fits:
            raise ValueError(
                f"RoPE tables differ: this model has head_dim={mine.head_dim}, rope_base={mine.rope_base}, "
                f"max_seq_len={mine.max_seq_len}; the source {theirs.head_dim}, {theirs.rope_base}, "
                f"{theirs.max_seq_len}"
            )
        self._rope_table = source._rope_table

    def set_attention_impl(self, impl: str | Callable) -> None:
        """Choose every layer's attention: "sdpa" (fast), "reference" (readable), or a function.

        A function is called as ``fn(q, k, v, mask) -> y`` with ``q`` ``(B, H, T, D)``,
        ``k`` and ``v`` ``(B, H_kv, S, D)`` (the whole cache, this step included) and
        ``mask`` the bool ``(B or 1, 1, T, S)`` bottom-right causal + padding mask
        (True = may attend); it returns ``(B, H, T, D)``. Use it to try a kernel of your own.
        """
        if not callable(impl) and impl not in ("sdpa", "reference"):
            raise ValueError(f"attention impl must be 'sdpa', 'reference' or a function (q, k, v, mask) -> y, got {impl!r}")
        for block in self.layers:
            block.attn.impl = impl
