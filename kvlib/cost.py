"""Back-of-the-envelope costs: bytes moved and FLOPs done per token.

A decode step does little arithmetic per byte it reads, so on a CPU (and on
most GPUs at batch 1) its speed is set by memory bandwidth::

    seconds per token  >=  decode_bytes_per_token(...) / bandwidth

The FLOP counts explain the other half of the story: without a cache every
step recomputes every earlier position, so the work grows with the square of
the length; with a cache each step costs one position.

Parameter and cache counts come from `kvlib.memory`, and ``dtype`` is what it is there:
the width of one stored number, for weights and cache alike, as a ``torch.dtype``, a name
(``"fp32"``, ``"fp16"``) or a byte count. The default, ``None``, is a kvlib model's (fp32,
as a fresh `kvlib.Transformer` is); a served model's fp16 is ``dtype="fp16"``, which is
`kvlib.hardware.step_time`'s default, since its peaks are a GPU's. Arguments come in one
order across both modules: the model, the lengths, ``batch``, then ``dtype``.
A multiply-add counts as 2 FLOPs. Norms, RoPE, softmax and the SwiGLU
product are left out of the FLOP counts: they are O(d_model) per token
against O(d_model²) for the matmuls.
"""

from __future__ import annotations

import warnings

from . import memory
from .config import ModelConfig
from .memory import DType
from .validate import int_at_least


def _old_order(old: tuple, batch: int, dtype: DType) -> tuple[int, DType]:
    """Until kvlib 0.5 the order was ``decode_bytes_per_token(config, context, dtype, batch)``. Those
    positional arguments still work, with a DeprecationWarning: read in the old order, never
    silently in the new one (``4`` was 4 bytes there, and would be a batch of 4 here)."""
    if not old:
        return batch, dtype
    if len(old) > 2 or (len(old) == 2 and batch != 1) or dtype is not None:
        raise TypeError(f"decode_bytes_per_token takes batch= and dtype= by name; got {len(old)} more positional "
                        "arguments beside them")
    warnings.warn("decode_bytes_per_token(config, context, dtype, batch): pass batch= and dtype= by name, in "
                  "kvlib.memory's order (batch, then dtype); positional ones stop working in kvlib 0.6",
                  DeprecationWarning, stacklevel=3)
    return (old[1] if len(old) == 2 else batch), old[0]


def decode_bytes_per_token(config: ModelConfig, context: int, *old: object, batch: int = 1,
                           dtype: DType = None) -> int:
    """Bytes one decode step must move to or from memory, ``context`` tokens already cached.

    ===================  ==================================================================
    every block          ``layer_matrix_params`` + 2 RMSNorm vectors of ``d_model``, read once
    final norm           ``d_model``
    lm_head              ``d_model * vocab``. With tied embeddings it *is* the embedding
                         table, so the lookup reads nothing new and it is counted once.
    embedding rows       ``batch * d_model`` when untied: one row per new token (tiny)
    KV cache read        ``kv_cache_bytes(context)``: every cached key and value, per sequence
    new K/V written      ``kv_cache_bytes(1)``: the step appends one position per sequence
    ===================  ==================================================================

    Weights are shared by the batch and read once per step; the cache is
    per sequence, so its terms scale with ``batch``. Activations and the
    ``batch * vocab`` logits are left out: they are small and mostly stay in
    cache. The matrices dominate until the KV term catches up at long context.
    """
    batch, dtype = _old_order(old, batch, dtype)
    memory.check_config(config)
    int_at_least("context", context, 0)
    int_at_least("batch", batch, 1)
    width = memory.dtype_bytes(dtype)
    weights = memory.matrix_params(config) + (2 * config.n_layer + 1) * config.d_model
    rows = 0 if config.tie_embeddings else batch * config.d_model
    return (weights + rows) * width + memory.kv_cache_bytes(config, context + 1, batch, width)


def flops_per_token(config: ModelConfig, context: int, lm_head: bool = True) -> int:
    """Forward FLOPs for one token that attends over ``context`` keys (itself included)::

        2 * matrix_params                       every weight, one multiply-add
        + 2 * 2 * n_layer * n_head * head_dim * context     q·k scores, then p·v

    ``lm_head=False`` drops the ``2 * d_model * vocab`` of the output layer, for
    positions whose logits are never computed.
    """
    memory.check_config(config)
    int_at_least("context", context, 1)
    attn = 2 * 2 * config.n_layer * config.n_head * config.head_dim * context
    return 2 * memory.matrix_params(config, lm_head=lm_head) + attn


def _positions_flops(config: ModelConfig, start: int, stop: int) -> int:
    """Body FLOPs (no lm_head) of the positions ``start .. stop-1``; position p sees p+1 keys.

    Summed in closed form: ``sum_{c=start+1}^{stop} c = (stop(stop+1) - start(start+1)) / 2``.
    """
    body = 2 * memory.matrix_params(config, lm_head=False)
    attn = 2 * 2 * config.n_layer * config.n_head * config.head_dim
    keys = (stop * (stop + 1) - start * (start + 1)) // 2
    return (stop - start) * body + attn * keys


def naive_flops(config: ModelConfig, prompt_len: int, new_tokens: int) -> int:
    """Total FLOPs of `kvlib.generate_naive`: step t = 0..n-1 runs all ``T_t = P + t``
    positions (causal, so position p attends over p+1 keys) and the lm_head on
    the last one only (``last_only=True``)::

        sum_t [ sum_{p<T_t} flops_per_token(p+1, lm_head=False) + 2 d_model vocab ]
    """
    memory.check_config(config)
    int_at_least("prompt_len", prompt_len, 1)
    int_at_least("new_tokens", new_tokens, 0)
    head = 2 * config.d_model * config.vocab_size
    return sum(_positions_flops(config, 0, prompt_len + t) + head for t in range(new_tokens))


def cached_flops(config: ModelConfig, prompt_len: int, new_tokens: int) -> int:
    """Total FLOPs of `kvlib.generate`: a prefill over the P prompt positions, then
    n-1 decode steps (the prefill already yields the first token). Each of the
    ``P + n - 1`` positions is computed exactly once, and the lm_head runs n times::

        sum_{p < P+n-1} flops_per_token(p+1, lm_head=False) + n * 2 d_model vocab
    """
    memory.check_config(config)
    int_at_least("prompt_len", prompt_len, 1)
    int_at_least("new_tokens", new_tokens, 0)
    if new_tokens == 0:
        return 0
    head = 2 * config.d_model * config.vocab_size
    return _positions_flops(config, 0, prompt_len + new_tokens - 1) + new_tokens * head


# -- one forward step: what the roofline model of `kvlib.hardware` needs --------------------------
def _check_step(config: ModelConfig, batch: int, context: int, new_tokens: int) -> None:
    memory.check_config(config)
    int_at_least("batch", batch, 1)
    int_at_least("context", context, 0)
    int_at_least("new_tokens", new_tokens, 1)


KV_SUB_BYTE = {"int4": 0.5, "int2": 0.25}  # packed quantized caches, scales not counted


def kv_width(kv_dtype: DType | float) -> float:
    """Bytes per cached number: what `kvlib.memory.dtype_bytes` takes (``None``, a ``torch.dtype``,
    a name, a byte count), ``"int4"``/``"int2"``, or a positive number."""
    if isinstance(kv_dtype, str) and kv_dtype in KV_SUB_BYTE:
        return KV_SUB_BYTE[kv_dtype]
    if isinstance(kv_dtype, float) and kv_dtype > 0:
        return kv_dtype
    return memory.dtype_bytes(kv_dtype)


def step_bytes(config: ModelConfig, batch: int, context: int, new_tokens: int = 1,
               dtype: DType = None, kv_dtype: DType | float = None) -> dict[str, int]:
    """Bytes one forward step moves: ``batch`` sequences, each with ``context`` tokens
    cached, each adding ``new_tokens`` (1 for a decode step; a prefill is ``context=0,
    new_tokens=T``).

    ``weights`` is read once per step whatever the batch (`decode_bytes_per_token`'s
    weight terms); ``kv_read`` is every cached key and value, ``kv_write`` the new ones,
    both per sequence. A decode step's total equals ``decode_bytes_per_token``.
    """
    _check_step(config, batch, context, new_tokens)
    width = memory.dtype_bytes(dtype)
    weights = memory.matrix_params(config) + (2 * config.n_layer + 1) * config.d_model
    rows = 0 if config.tie_embeddings else batch * new_tokens * config.d_model  # embedding lookups
    kv = kv_width(dtype if kv_dtype is None else kv_dtype)
    out = {
        "weights": (weights + rows) * width,
        "kv_read": round(memory.kv_cache_bytes(config, context, batch, 1) * kv),  # numbers x bytes each
        "kv_write": round(memory.kv_cache_bytes(config, new_tokens, batch, 1) * kv),
    }
    out["total"] = sum(out.values())
    return out


def step_flops(config: ModelConfig, batch: int, context: int, new_tokens: int = 1) -> dict[str, int]:
    """FLOPs of the same step, split as the roofline needs them.

    ``matmul``: every new token through every block's matrices (``batch * new_tokens``
    rows), and the lm_head for the last token of each sequence only (``batch`` rows,
    as `kvlib.generate` computes). ``attention``: scores and the weighted sum, new token
    ``i`` seeing ``context + i + 1`` keys. Their sum equals `cached_flops` and
    `flops_per_token` where those count the same positions.

    Example

    >>> cfg = kvlib.PRESETS["tiny"]
    >>> kvlib.cost.step_flops(cfg, batch=1, context=10)  # one decode token after 10 cached
    {'matmul': 163840, 'attention': 5632, 'total': 169472}
    >>> f = kvlib.cost.step_flops(cfg, batch=1, context=0, new_tokens=10)  # a 10-token prefill
    >>> f["total"] == kvlib.cost.cached_flops(cfg, prompt_len=10, new_tokens=1)  # its first token
    True
    """
    _check_step(config, batch, context, new_tokens)
    body = 2 * memory.matrix_params(config, lm_head=False)
    head = 2 * config.d_model * config.vocab_size
    keys = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # sum_{i<T} (context + i + 1)
    out = {
        "matmul": batch * (new_tokens * body + head),
        "attention": batch * 2 * 2 * config.n_layer * config.n_head * config.head_dim * keys,
    }
    out["total"] = out["matmul"] + out["attention"]
    return out


def intensity(config: ModelConfig, batch: int, context: int, new_tokens: int = 1,
              dtype: DType = None, kv_dtype: DType | float = None) -> dict[str, float]:
    """Arithmetic intensity (FLOPs per byte moved) of the whole step, its matmuls
    (against the weights) and its attention (against the cache).

    The matmuls do ``2 * batch * new_tokens`` FLOPs per weight they read, so batching
    raises their intensity; attention does about ``2 * n_head / n_kv_head`` FLOPs per
    cached element whatever the batch, because every sequence reads its own cache.
    """
    b = step_bytes(config, batch, context, new_tokens, dtype, kv_dtype)
    f = step_flops(config, batch, context, new_tokens)
    return {
        "step": f["total"] / b["total"],
        "matmul": f["matmul"] / b["weights"],
        "attention": f["attention"] / (b["kv_read"] + b["kv_write"]),
    }


def crossover_context(config: ModelConfig, batch: int = 1, dtype: DType = None,
                      kv_dtype: DType | float = None) -> float:
    """The context at which a decode step reads as many cache bytes as weight bytes.

    ``weights / (batch * kv_bytes_per_token)``: the weights are read once per step,
    the cache once per sequence, so batching pulls the crossover in by ``batch``.
    """
    int_at_least("batch", batch, 1)
    weights = step_bytes(config, 1, 0, 1, dtype)["weights"]
    per_token = memory.kv_cache_bytes(config, 1, 1, 1) * kv_width(dtype if kv_dtype is None else kv_dtype)
    return weights / (batch * per_token)
