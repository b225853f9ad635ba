"""kvlib: the small library behind the KV-cache book.

Layout everywhere: ``(batch, heads, seq, head_dim)``.

The top level holds what a chapter or an exercise reaches for first:

* the model: `Transformer`, `ModelConfig`, `PRESETS`, `load_smollm2`, `Tokenizer`, `from_hf`;
* caches: `Cache` (the protocol, an ``abc.ABC``), `CacheSpec`, `DynamicCache`,
  `StaticCache`, `PaddedBatch`, and the paged ones, `PagedCache` and `Engine`;
* attention: `attention`, `grouped_attention`, `attention_mask`, `causal_mask`,
  `repeat_kv`, `softmax`;
* generation: `SamplingParams`, `sample`, `prefill`, `decode_step`, `generate`,
  `generate_naive`, `stream`.

Everything else lives in its module, one idea each: `kvlib.blocks`, `kvlib.paged`, `kvlib.evict`,
`kvlib.engine`, `kvlib.memory`, `kvlib.simulate`, `kvlib.cost`, `kvlib.hardware`, `kvlib.quant`,
`kvlib.gqa`, `kvlib.mla`, `kvlib.padding`, `kvlib.packed`, `kvlib.evaluate`, `kvlib.data`,
`kvlib.kernels`, `kvlib.wquant`, `kvlib.radix`, `kvlib.speculative`, `kvlib.chat`, `kvlib.timing`, `kvlib.check`, `kvlib.validate` (all importable
after ``import kvlib``), and `kvlib.book.plot`, `kvlib.book.diagrams`, `kvlib.book.explorer`, `kvlib.bench`
(with `kvlib.bench_fast`), which pull in plotting,
widgets or Hugging Face and are imported on their own.
"""

from . import (  # noqa: F401  (the modules, so that kvlib.memory etc. work after `import kvlib`)
    blocks, chat, check, cost, data, engine, evaluate, evict, gqa, hardware, kernels, memory, mla, packed, padding, paged, quant,
    radix, sampling, simulate, speculative, timing, validate, wquant,
)
from .attention import attention, attention_mask, causal_mask, grouped_attention, repeat_kv, softmax
from .cache import Cache, CacheSpec, DynamicCache, StaticCache
from .config import PRESETS, ModelConfig
from .engine import Engine
from .generate import decode_step, generate, generate_naive, prefill, stream
from .hf import from_hf
from .model import Transformer
from .padding import PaddedBatch
from .paged import PagedCache
from .pretrained import Tokenizer, load_smollm2
from .sampling import SamplingParams, sample

__all__ = [
    # the model
    "ModelConfig", "PRESETS", "Tokenizer", "Transformer", "from_hf", "load_smollm2",
    # caches
    "Cache", "CacheSpec", "DynamicCache", "Engine", "PaddedBatch", "PagedCache", "StaticCache",
    # attention
    "attention", "attention_mask", "causal_mask", "grouped_attention", "repeat_kv", "softmax",
    # generation
    "SamplingParams", "decode_step", "generate", "generate_naive", "prefill", "sample", "stream",
]
__version__ = "0.2.0"
