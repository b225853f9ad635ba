"""kvlib: the small library behind the KV-cache book.

Layout everywhere: ``(batch, heads, seq, head_dim)``.

The top level holds what a chapter or an exercise reaches for first:

* the model: `Transformer`, `ModelConfig`, `PRESETS`, `load_smollm2`, `Tokenizer`, `from_hf`;
* caches: `Cache` (the protocol, an ``abc.ABC``), `CacheSpec`, `DynamicCache`,
  `StaticCache`, `PaddedBatch`, and the paged ones, `PagedCache` and `Engine`;
* attention: `attention`, `grouped_attention`, `decode_attention`, `attention_mask`, `causal_mask`,
  `repeat_kv`, `softmax`;
* generation: `SamplingParams`, `sample`, `prefill`, `decode_step`, `generate`,
  `generate_naive`, `stream`.

Everything else lives in its module, one idea each (`kvlib.paged` and `kvlib.cache` are
packages of such modules), and is imported the first time it is used (PEP 562): after
``import kvlib``, ``kvlib.memory`` or ``kvlib.paged`` loads on first access. So the first
import stays light: the model, the caches, attention and generation, and nothing of the
simulator, the roofline profiler, Hugging Face or matplotlib.

The book's tooling lives beside kvlib, not in it (it imports kvlib, never the reverse):
`kvbook` (figures, glue, tables, reader editions, the site), `kvbench` (``python -m kvbench``),
`vllmcheck` and `kvpresscheck` (kvlib beside vLLM and beside kvpress). Their old names
(``kvlib.book``, ``kvlib.bench``, ``kvlib.crosscheck``, ``kvlib.presscheck``) still work in
0.5, with a DeprecationWarning, and go in 0.6 (`kvlib._moved`).
"""

from __future__ import annotations

import importlib

from . import _moved
from .attention import attention, attention_mask, causal_mask, decode_attention, grouped_attention, repeat_kv, softmax
from .cache import Cache, CacheSpec, DynamicCache, StaticCache
from .config import PRESETS, ModelConfig
from .generate import decode_step, generate, generate_naive, prefill, stream
from .model import Transformer
from .padding import PaddedBatch
from .sampling import SamplingParams, sample

# Loaded on first use: a top-level name -> the module that defines it.
_LAZY_NAMES = {
    "Engine": "engine", "PagedCache": "paged", "from_hf": "hf", "Tokenizer": "pretrained", "load_smollm2": "pretrained",
}
# The submodules a chapter reaches as kvlib.<name> (the core ones above are loaded already).
_SUBMODULES = (
    "chat", "check", "cost", "data", "distributed", "engine", "evaluate", "evict", "gqa",
    "hardware", "hf", "invariant", "kernels", "layers", "memory", "mla", "needle", "numerics", "packed", "paged",
    "fp8", "press", "pretrained", "quant", "radix",
    "scheduler",
    "simulate", "speculative", "timing", "validate", "wquant", "grade",
)

_moved.install()  # the tooling's old names (kvlib.book, ...) for one version: kvlib 0.6 drops them


def __getattr__(name: str):
    if f"kvlib.{name}" in _moved.MOVED:  # kvlib.book after `import kvlib`: warns, gives kvbook (not in dir())
        return importlib.import_module(f"kvlib.{name}")
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'kvlib' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_SUBMODULES))


__all__ = [
    # the model
    "ModelConfig", "PRESETS", "Tokenizer", "Transformer", "from_hf", "load_smollm2",
    # caches
    "Cache", "CacheSpec", "DynamicCache", "Engine", "PaddedBatch", "PagedCache", "StaticCache",
    # attention
    "attention", "attention_mask", "causal_mask", "decode_attention", "grouped_attention", "repeat_kv", "softmax",
    # generation
    "SamplingParams", "decode_step", "generate", "generate_naive", "prefill", "sample", "stream",
]
__version__ = "0.6.0"
