"""How big the KV cache and the weights are, and what fits in a given memory.

In a Llama every layer stores a key and a value vector per KV head per token::

    cache bytes = 2 (K and V) * n_layer * batch * n_kv_head * seq_len * head_dim * dtype_bytes

Many newer models mix layers whose caches differ (`kvlib.layers`): a sliding-window layer keeps
only its last W tokens, a chunked layer the tokens of the current chunk, a shared layer nothing
of its own, an MLA layer one latent vector per token instead of K and V. So the cache is a sum
over layers, each counting the tokens it holds (`kvlib.layers.tokens_held`)::

    cache bytes = batch * dtype_bytes * sum over layers of  numbers per token * tokens held
                  numbers per token = 2 * n_kv_head * head_dim   (full, window, chunked)
                                      r                          (latent(r): one vector)
                                      0                          (shared: reads another layer's)

For an all-full model the sum is the product above. The weights, by contrast, do not grow with
batch or context. This module is the one home of that arithmetic (cache bytes, parameter counts,
dtype widths); `kvlib.cost` builds per-step bytes and FLOPs on it, and `kvlib.simulate` serves
request traces from a pool of these bytes.

``dtype`` is the width of one stored number, in any form a tensor's is given or named: a
``torch.dtype`` (``torch.bfloat16``), a name from `DTYPE_BYTES` (``"bf16"``) or a byte count.
The default, ``None``, is the dtype of a kvlib model's cache: fp32, as a fresh
`kvlib.Transformer` is, so ``kv_cache_bytes(config, n)`` is ``cache.nbytes`` of its cache after
``n`` tokens. A real model served on a GPU stores fp16 or bf16: say so, ``dtype="fp16"``.
"""

from __future__ import annotations

import torch

from .config import PRESETS, ModelConfig
from .layers import tokens_held
from .validate import int_at_least, positive_int

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
# What dtype=None means here and in kvlib.cost: a kvlib model's dtype (its cache's), unless it is cast.
MODEL_DTYPE = torch.float32
# A serving GPU's width of weights and cache: the default of kvlib.hardware.step_time, whose peaks are a
# GPU's. Not the default here: pass dtype="fp16" (or DEFAULT_DTYPE) to size a served model.
DEFAULT_DTYPE = "fp16"
DType = str | int | torch.dtype | None  # what every dtype= argument of memory and cost takes


def check_config(config: object) -> ModelConfig:
    """``config`` if it is a `ModelConfig`; else ``TypeError`` naming what it got."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    return config


def dtype_bytes(dtype: DType = None) -> int:
    """Bytes of one stored number: ``None`` (a kvlib model's cache, `MODEL_DTYPE`: 4), a
    ``torch.dtype`` (``torch.float16`` -> 2), a name from `DTYPE_BYTES` (``"fp16"`` -> 2) or a
    positive byte count."""
    if dtype is None:
        return MODEL_DTYPE.itemsize
    if isinstance(dtype, torch.dtype) and dtype != torch.bool:
        return dtype.itemsize
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, a torch.dtype, a positive byte count, or "
                     f"None (a kvlib model's {MODEL_DTYPE}), got {dtype!r}")


def dtype_name(dtype: DType = None) -> str:
    """``dtype`` as a short name for messages: ``"fp32"``, ``"torch.bfloat16"``, ``"2-byte"``."""
    if dtype is None:
        return str(MODEL_DTYPE)
    return f"{dtype}-byte" if isinstance(dtype, int) and not isinstance(dtype, bool) else str(dtype)


# -- the weights ----------------------------------------------------------------------------------
def layer_matrix_params(config: ModelConfig) -> int:
    """Weights in one block's four matrices (kvlib fuses q/k/v and gate/up)::

        wqkv       d_model * (H + 2 H_kv) * D
        wo         H * D * d_model
        w_gate_up  d_model * 2 d_ff
        w_down     d_ff * d_model

    Llama-family shapes only (a GPT-2 MLP has no gate, and biases besides).
    """
    check_config(config)
    if config.family != "llama":
        name = config.name or config.family
        raise ValueError(f"weight counts assume a Llama-family block; {name} is {config.family!r}")
    d, H, H_kv, D, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    return d * (H + 2 * H_kv) * D + H * D * d + d * 2 * ff + ff * d


def matrix_params(config: ModelConfig, lm_head: bool = True) -> int:
    """Weights that one token is multiplied by: every block's matrices, plus
    the ``d_model * vocab`` lm_head unless ``lm_head=False``.

    The embedding lookup is a read, not a matmul, so it is not counted here.
    """
    per_layer = layer_matrix_params(config)
    head = config.d_model * config.vocab_size if lm_head else 0
    return config.n_layer * per_layer + head


def param_count(config: ModelConfig) -> int:
    """All parameters as kvlib stores them: matrices, 2 norms per block, the
    final norm, and an embedding table only when it is not tied to the lm_head.

    Equals ``sum(p.numel() for p in Transformer(config).parameters())``.
    For ``family="gpt2"`` it counts GPT-2's own layout instead: LayerNorms
    with biases, biased projections, a 4x GELU MLP, learned positions, and a
    head tied to the token embedding. For ``family="shapes"`` (Gemma 3, gpt-oss, Llama 4,
    DeepSeek-V3: only their cache shapes are kept) it raises a ValueError saying why,
    and so do `weight_bytes` and everything built on them.
    """
    check_config(config)
    if config.family == "shapes":
        raise ValueError(
            f"{config.name or 'this model'} is a 'shapes' preset: kvlib keeps its attention shapes, for "
            "the cache, but its blocks (mixture-of-experts MLPs, Gemma's GeGLU and extra norms, or MLA "
            "projections) are not kvlib's Llama block, so kvlib does not count its parameters"
        )
    if config.family == "gpt2":
        d, ff = config.d_model, config.d_ff
        per_layer = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
        return config.n_layer * per_layer + 2 * d + (config.vocab_size + config.max_seq_len) * d
    norms = (2 * config.n_layer + 1) * config.d_model
    embedding = 0 if config.tie_embeddings else config.vocab_size * config.d_model
    return matrix_params(config) + norms + embedding


def weight_bytes(config: ModelConfig, dtype: DType = None) -> int:
    """Bytes of all parameters stored at ``dtype`` (default: a kvlib model's fp32)."""
    return param_count(config) * dtype_bytes(dtype)


# -- the cache ------------------------------------------------------------------------------------
def numbers_per_token(config: ModelConfig, layer: int) -> int:
    """Numbers layer ``layer`` stores per token it holds: ``2 * n_kv_head * head_dim`` (a key and a
    value per KV head), ``r`` for an MLA ``latent(r)`` layer (one vector stands for both), and 0 for
    a shared layer (it reads its source's cache and stores nothing)."""
    check_config(config)
    kinds = config.layer_kinds()
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(kinds):
        raise IndexError(f"layer must be an int in 0..{len(kinds) - 1}, got {layer!r}")
    kind = kinds[layer]
    if kind.kind == "shared":
        return 0
    if kind.kind == "latent":
        return kind.size
    return 2 * config.n_kv_head * config.head_dim


def kv_bytes_by_layer(config: ModelConfig, seq_len: int, batch: int = 1, dtype: DType = None) -> list[int]:
    """Cache bytes of each layer for ``batch`` sequences of ``seq_len`` tokens:
    ``batch * numbers_per_token(layer) * tokens_held(kind, seq_len) * dtype_bytes(dtype)``."""
    check_config(config)
    int_at_least("seq_len", seq_len, 0)
    positive_int("batch", batch)
    width = dtype_bytes(dtype)
    return [batch * numbers_per_token(config, i) * tokens_held(kind, seq_len) * width
            for i, kind in enumerate(config.layer_kinds())]


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype: DType = None) -> int:
    """Bytes of keys and values for ``batch`` sequences of ``seq_len`` positions: the sum of
    `kv_bytes_by_layer`. For an all-full model that is
    ``2 * n_layer * batch * n_kv_head * seq_len * head_dim * dtype_bytes(dtype)``.

    Example

    >>> cfg = kvlib.PRESETS["llama-2-7b"]  # 32 layers, 32 KV heads of 128
    >>> kvlib.memory.kv_cache_bytes(cfg, seq_len=4096, dtype="fp16") == 2 * 32 * 32 * 4096 * 128 * 2
    True
    >>> kvlib.memory.kv_cache_bytes(cfg, 4096, batch=8, dtype=torch.float8_e4m3fn) / 2**30  # GiB
    8.0

    The default dtype is a kvlib model's, so the formula is what its cache holds:

    >>> tiny = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.DynamicCache(tiny.config.n_layer)
    >>> logits = tiny(torch.arange(1, 41)[None], cache)
    >>> kvlib.memory.kv_cache_bytes(tiny.config, 40) == cache.nbytes  # fp32, as the model
    True
    """
    return sum(kv_bytes_by_layer(config, seq_len, batch, dtype))


def kv_bytes_per_token(config: ModelConfig, dtype: DType = None) -> int:
    """Cache bytes of one token in every layer that stores it: ``kv_cache_bytes(config, 1)``.

    In an all-full model every token adds exactly this, at any length. In a hybrid model it is
    what a token adds only while the text is shorter than every window and chunk: past a
    window, that layer's bytes stop growing, so ``kv_cache_bytes(config, n)`` falls below
    ``n * kv_bytes_per_token(config)``. Size a hybrid model's cache with `kv_cache_bytes` at a
    length, and its growth at long context with `kv_growth_per_token`.
    """
    return kv_cache_bytes(config, 1, 1, dtype)


def kv_growth_per_token(config: ModelConfig, dtype: DType = None) -> int:
    """Cache bytes one more token adds to a long text, once every window is full: the bytes per
    token of the layers that keep every token (full and latent); windows and shared layers add
    none, and a chunked layer's bytes rise and fall within each chunk (none on average).
    Equal to `kv_bytes_per_token` for an all-full model."""
    check_config(config)
    width = dtype_bytes(dtype)
    return sum(numbers_per_token(config, i) * width
               for i, kind in enumerate(config.layer_kinds()) if kind.kind in ("full", "latent"))


def _all_full(config: ModelConfig, what: str, instead: str) -> None:
    """Raise a ValueError naming why ``what`` needs every token to cost the same: no window or
    chunked layer, whose cache stops growing once the text outgrows it (full, latent and shared
    layers are fine: each token adds the same bytes to them at any length)."""
    bounded = sorted({str(k) for k in config.layer_kinds() if k.kind in ("window", "chunked")})
    if bounded:
        raise ValueError(
            f"{what} assumes every token costs the same, but {config.name or 'this model'} has "
            f"{', '.join(bounded)} layers, whose caches stop growing once a text outgrows them: {instead}"
        )


# -- what fits ------------------------------------------------------------------------------------
def _free_bytes(config: ModelConfig, memory_bytes: int, dtype: str | int, weights: bool) -> int:
    free = memory_bytes - (weight_bytes(config, dtype) if weights else 0)
    if free < 0:
        raise ValueError(
            f"{config.name or 'the model'}'s weights ({weight_bytes(config, dtype) / GiB:.1f} GiB at "
            f"{dtype_name(dtype)}) "
            f"do not fit in {memory_bytes / GiB:.1f} GiB"
        )
    return free


def max_tokens(config: ModelConfig, memory_bytes: int, dtype: DType = None, *, weights: bool = True) -> int:
    """How many cached tokens (summed over the batch) fit in ``memory_bytes``,
    after the weights if ``weights=True``. Activations and fragmentation are ignored.

    Only for models in which every token costs the same, however the tokens are divided into
    sequences: full, latent and shared layers. With window or chunked layers a sequence's cost
    depends on its length (a window layer holds at most W of its tokens), so a token budget
    means nothing and this raises a ValueError: use `max_batch`.

    Example

    >>> cfg = kvlib.PRESETS["llama-3-8b"]
    >>> kvlib.memory.kv_bytes_per_token(cfg, "fp16")  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    131072
    >>> kvlib.memory.max_tokens(cfg, 80 * 2**30, "fp16")  # an 80 GiB GPU, after 15 GiB of fp16 weights
    532827
    """
    check_config(config)
    _all_full(config, "max_tokens", "ask max_batch(config, memory_bytes, seq_len) instead")
    return _free_bytes(config, memory_bytes, dtype, weights) // kv_bytes_per_token(config, dtype)


def max_batch(config: ModelConfig, memory_bytes: int, seq_len: int, dtype: DType = None) -> int:
    """The largest batch of ``seq_len``-token sequences whose cache fits beside the weights:
    the free bytes over ``kv_cache_bytes(config, seq_len)``, for any layer pattern.

    Example

    >>> cfg = kvlib.PRESETS["llama-3-8b"]
    >>> kvlib.memory.max_batch(cfg, 80 * 2**30, seq_len=8192, dtype="fp16")  # 532827 tokens // 8192
    65
    >>> mistral = kvlib.PRESETS["mistral-7b"]  # every layer a window of 4096: longer costs no more
    >>> kvlib.memory.max_batch(mistral, 80 * 2**30, 32768) == kvlib.memory.max_batch(mistral, 80 * 2**30, 4096)
    True
    """
    check_config(config)
    positive_int("seq_len", seq_len)
    return _free_bytes(config, memory_bytes, dtype, True) // kv_cache_bytes(config, seq_len, 1, dtype)


def pool_capacity(
    config: ModelConfig, memory_bytes: int, max_len: int, block_size: int = 16, dtype: DType = None
) -> tuple[int, int, float]:
    """``(blocks, tokens, max concurrency)`` of a paged pool of ``memory_bytes``, the way vLLM sizes it.

    A block holds ``block_size`` tokens of every layer's keys and values, so the pool
    has ``memory_bytes // (block_size * kv_bytes_per_token)`` blocks. One request of
    ``max_len`` tokens needs ``ceil(max_len / block_size)`` of them; *max concurrency*
    is the blocks over that, and *tokens* is concurrency times ``max_len``, truncated.
    These are the two numbers of vLLM's start-up line "KV cache size: N tokens, Maximum
    concurrency for L tokens per request: Xx" (vLLM 0.32: ``get_kv_cache_config_from_groups``,
    ``get_max_concurrency_for_kv_cache_config`` and ``get_kv_cache_capacity`` in
    ``vllm/v1/core/kv_cache_utils.py``). vLLM then keeps one block back as its null
    block, so requests share ``blocks - 1``.

    Not for models with window or chunked layers (a ValueError): vLLM pools those in groups, each
    sized for its own kind (a window layer's blocks are freed as the window slides), which this
    count does not model.
    """
    check_config(config)
    _all_full(config, "pool_capacity", "vLLM sizes a hybrid model's pool per group of layers")
    int_at_least("memory_bytes", memory_bytes, 0)
    positive_int("max_len", max_len)
    positive_int("block_size", block_size)
    blocks = memory_bytes // (block_size * kv_bytes_per_token(config, dtype))
    concurrency = blocks / -(-max_len // block_size)
    return blocks, int(concurrency * max_len), concurrency


def table(names: list[str] | None = None, seq_len: int = 4096, batch: int = 1, dtype: DType = None) -> list[dict]:
    """One row per preset: parameters, weight GiB, cache KiB per token, cache GiB at ``batch x seq_len``.

    "Per token" is the mean at ``seq_len``, ``kv_cache_bytes(seq_len) / seq_len``: for an
    all-full model that is `kv_bytes_per_token` at any length; for a hybrid model it falls as
    the text outgrows its windows. A ``"shapes"`` preset's parameters and weights are None
    (kvlib does not count them, see `param_count`).
    """
    positive_int("seq_len", seq_len)
    rows = []
    for name in names or [n for n in PRESETS if n != "tiny"]:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        c = PRESETS[name]
        counted = c.family != "shapes"
        rows.append({
            "model": c.name or name,
            "params": param_count(c) if counted else None,
            "weights_gib": weight_bytes(c, dtype) / GiB if counted else None,
            "kv_kib_per_token": kv_cache_bytes(c, seq_len, 1, dtype) / seq_len / 1024,
            "kv_gib": kv_cache_bytes(c, seq_len, batch, dtype) / GiB,
        })
    return rows
