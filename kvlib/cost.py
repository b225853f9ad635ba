"""Back-of-the-envelope costs: bytes moved and FLOPs done per token.

A decode step does little arithmetic per byte it reads, so on a CPU (and on
most GPUs at batch 1) its speed is set by memory bandwidth::

    seconds per token  >=  decode_bytes_per_token(...) / bandwidth

The FLOP counts explain the other half of the story: without a cache every
step recomputes every earlier position, so the work grows with the square of
the length; with a cache each step costs one position.

Conventions: ``dtype_bytes`` is the width of one stored number (4 for fp32,
2 for fp16/bf16) and applies to weights and cache alike. A multiply-add counts
as 2 FLOPs. Norms, RoPE, softmax and the SwiGLU product are left out of the
FLOP counts: they are O(d_model) per token against O(d_model²) for the matmuls.
"""

from __future__ import annotations

from .config import ModelConfig


def _check_config(config: ModelConfig) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def layer_matrix_params(config: ModelConfig) -> int:
    """Weights in one block's four matrices (kvlib fuses q/k/v and gate/up)::

        wqkv       d_model * (H + 2 H_kv) * D
        wo         H * D * d_model
        w_gate_up  d_model * 2 d_ff
        w_down     d_ff * d_model

    Llama-family shapes only (a GPT-2 MLP has no gate, and biases besides).
    """
    _check_config(config)
    if config.family != "llama":
        raise ValueError(f"weight counts assume a Llama-family block; {config.name or config.family} is {config.family!r}")
    d, H, H_kv, D, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    return d * (H + 2 * H_kv) * D + H * D * d + d * 2 * ff + ff * d


def matrix_params(config: ModelConfig, lm_head: bool = True) -> int:
    """Weights that one token is multiplied by: every block's matrices, plus
    the ``d_model * vocab`` lm_head unless ``lm_head=False``.

    The embedding lookup is a read, not a matmul, so it is not counted here.
    """
    head = config.d_model * config.vocab_size if lm_head else 0
    return config.n_layer * layer_matrix_params(config) + head


def param_count(config: ModelConfig) -> int:
    """All parameters as kvlib stores them: matrices, 2 norms per block, the
    final norm, and an embedding table only when it is not tied to the lm_head.

    Equals ``sum(p.numel() for p in Transformer(config).parameters())``.
    For ``family="gpt2"`` it counts GPT-2's own layout instead: LayerNorms
    with biases, biased projections, a 4x GELU MLP, learned positions, and a
    head tied to the token embedding.
    """
    _check_config(config)
    if config.family == "gpt2":
        d, ff = config.d_model, config.d_ff
        per_layer = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
        return config.n_layer * per_layer + 2 * d + (config.vocab_size + config.max_seq_len) * d
    norms = (2 * config.n_layer + 1) * config.d_model
    embedding = 0 if config.tie_embeddings else config.vocab_size * config.d_model
    return matrix_params(config) + norms + embedding


def kv_bytes(config: ModelConfig, tokens: int, dtype_bytes: int = 4, batch: int = 1) -> int:
    """Bytes of keys and values for ``tokens`` positions:
    ``2 * n_layer * batch * n_kv_head * tokens * head_dim * dtype_bytes``."""
    _check_config(config)
    _check_int("tokens", tokens, 0)
    _check_int("dtype_bytes", dtype_bytes, 1)
    _check_int("batch", batch, 1)
    return 2 * config.n_layer * batch * config.n_kv_head * tokens * config.head_dim * dtype_bytes


def decode_bytes_per_token(config: ModelConfig, context: int, dtype_bytes: int = 4, batch: int = 1) -> int:
    """Bytes one decode step must move to or from memory, ``context`` tokens already cached.

    ===================  ==================================================================
    every block          ``layer_matrix_params`` + 2 RMSNorm vectors of ``d_model``, read once
    final norm           ``d_model``
    lm_head              ``d_model * vocab``. With tied embeddings it *is* the embedding
                         table, so the lookup reads nothing new and it is counted once.
    embedding rows       ``batch * d_model`` when untied: one row per new token (tiny)
    KV cache read        ``kv_bytes(context)``: every cached key and value, per sequence
    new K/V written      ``kv_bytes(1)``: the step appends one position per sequence
    ===================  ==================================================================

    Weights are shared by the batch and read once per step; the cache is
    per sequence, so its terms scale with ``batch``. Activations and the
    ``batch * vocab`` logits are left out: they are small and mostly stay in
    cache. The matrices dominate until the KV term catches up at long context.
    """
    _check_config(config)
    _check_int("context", context, 0)
    _check_int("dtype_bytes", dtype_bytes, 1)
    _check_int("batch", batch, 1)
    weights = matrix_params(config) + (2 * config.n_layer + 1) * config.d_model
    rows = 0 if config.tie_embeddings else batch * config.d_model
    return (weights + rows) * dtype_bytes + kv_bytes(config, context + 1, dtype_bytes, batch)


def flops_per_token(config: ModelConfig, context: int, lm_head: bool = True) -> int:
    """Forward FLOPs for one token that attends over ``context`` keys (itself included)::

        2 * matrix_params                       every weight, one multiply-add
        + 2 * 2 * n_layer * n_head * head_dim * context     q·k scores, then p·v

    ``lm_head=False`` drops the ``2 * d_model * vocab`` of the output layer, for
    positions whose logits are never computed.
    """
    _check_config(config)
    _check_int("context", context, 1)
    attn = 2 * 2 * config.n_layer * config.n_head * config.head_dim * context
    return 2 * matrix_params(config, lm_head=lm_head) + attn


def _positions_flops(config: ModelConfig, start: int, stop: int) -> int:
    """Body FLOPs (no lm_head) of the positions ``start .. stop-1``; position p sees p+1 keys.

    Summed in closed form: ``sum_{c=start+1}^{stop} c = (stop(stop+1) - start(start+1)) / 2``.
    """
    body = 2 * matrix_params(config, lm_head=False)
    attn = 2 * 2 * config.n_layer * config.n_head * config.head_dim
    keys = (stop * (stop + 1) - start * (start + 1)) // 2
    return (stop - start) * body + attn * keys


def naive_flops(config: ModelConfig, prompt_len: int, new_tokens: int) -> int:
    """Total FLOPs of `kvlib.generate_naive`: step t = 0..n-1 runs all ``T_t = P + t``
    positions (causal, so position p attends over p+1 keys) and the lm_head on
    the last one only (``last_only=True``)::

        sum_t [ sum_{p<T_t} flops_per_token(p+1, lm_head=False) + 2 d_model vocab ]
    """
    _check_config(config)
    _check_int("prompt_len", prompt_len, 1)
    _check_int("new_tokens", new_tokens, 0)
    head = 2 * config.d_model * config.vocab_size
    return sum(_positions_flops(config, 0, prompt_len + t) + head for t in range(new_tokens))


def cached_flops(config: ModelConfig, prompt_len: int, new_tokens: int) -> int:
    """Total FLOPs of `kvlib.generate`: a prefill over the P prompt positions, then
    n-1 decode steps (the prefill already yields the first token). Each of the
    ``P + n - 1`` positions is computed exactly once, and the lm_head runs n times::

        sum_{p < P+n-1} flops_per_token(p+1, lm_head=False) + n * 2 d_model vocab
    """
    _check_config(config)
    _check_int("prompt_len", prompt_len, 1)
    _check_int("new_tokens", new_tokens, 0)
    if new_tokens == 0:
        return 0
    head = 2 * config.d_model * config.vocab_size
    return _positions_flops(config, 0, prompt_len + new_tokens - 1) + new_tokens * head
