"""How big the KV cache gets, and what fits in a given memory.

Every layer stores a key and a value vector per KV head per token::

    cache bytes = 2 (K and V) * n_layer * batch * n_kv_head * seq_len * head_dim * dtype_bytes

The weights, by contrast, do not grow with batch or context. This module puts
the two side by side for real models (`kvlib.PRESETS`) and answers "how many
sequences of this length fit on this GPU?".
"""

from __future__ import annotations

from .config import PRESETS, ModelConfig
from .cost import kv_bytes, param_count

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def _bytes_of(dtype: str | int) -> int:
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} or a positive byte count, got {dtype!r}")


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype: str | int = "fp16") -> int:
    """``2 * n_layer * batch * n_kv_head * seq_len * head_dim * bytes``."""
    return kv_bytes(config, seq_len, _bytes_of(dtype), batch)


def kv_bytes_per_token(config: ModelConfig, dtype: str | int = "fp16") -> int:
    """Cache bytes one more token adds to one sequence."""
    return kv_cache_bytes(config, 1, 1, dtype)


def weight_bytes(config: ModelConfig, dtype: str | int = "fp16") -> int:
    """Bytes of all parameters stored at ``dtype``."""
    return param_count(config) * _bytes_of(dtype)


def max_tokens(config: ModelConfig, memory_bytes: int, dtype: str | int = "fp16", *, weights: bool = True) -> int:
    """How many cached tokens (summed over the batch) fit in ``memory_bytes``,
    after the weights if ``weights=True``. Activations and fragmentation are ignored."""
    free = memory_bytes - (weight_bytes(config, dtype) if weights else 0)
    if free < 0:
        raise ValueError(
            f"{config.name or 'the model'}'s weights ({weight_bytes(config, dtype) / GiB:.1f} GiB at {dtype}) "
            f"do not fit in {memory_bytes / GiB:.1f} GiB"
        )
    return free // kv_bytes_per_token(config, dtype)


def max_batch(config: ModelConfig, memory_bytes: int, seq_len: int, dtype: str | int = "fp16") -> int:
    """The largest batch of ``seq_len``-token sequences whose cache fits beside the weights."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return max_tokens(config, memory_bytes, dtype) // seq_len


def table(names: list[str] | None = None, seq_len: int = 4096, batch: int = 1, dtype: str | int = "fp16") -> list[dict]:
    """One row per preset: parameters, weight GiB, cache KiB per token, cache GiB at ``batch x seq_len``."""
    rows = []
    for name in names or [n for n in PRESETS if n != "tiny"]:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        c = PRESETS[name]
        rows.append({
            "model": c.name or name,
            "params": param_count(c),
            "weights_gib": weight_bytes(c, dtype) / GiB,
            "kv_kib_per_token": kv_bytes_per_token(c, dtype) / 1024,
            "kv_gib": kv_cache_bytes(c, seq_len, batch, dtype) / GiB,
        })
    return rows
