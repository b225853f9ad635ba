"""kvlib: the small library behind the KV-cache book.

Layout everywhere: ``(batch, heads, seq, head_dim)``.
"""

from .attention import attention, attention_mask, causal_mask, grouped_attention, repeat_kv, softmax
from .cache import Cache, DynamicCache, StaticCache
from .config import PRESETS, ModelConfig
from .generate import decode_step, generate, generate_naive, prefill, sample, stream
from .hf import from_hf
from . import check, cost, data, evaluate, gqa, memory, padding, paged, quant
from .model import Transformer
from .pretrained import Tokenizer, load_smollm2

__all__ = [
    "Cache", "DynamicCache", "ModelConfig", "PRESETS", "StaticCache", "Tokenizer", "Transformer",
    "attention", "attention_mask", "causal_mask", "grouped_attention", "decode_step", "from_hf", "generate", "generate_naive",
    "load_smollm2", "prefill", "repeat_kv", "sample", "softmax", "stream",
]
__version__ = "0.1.0"
