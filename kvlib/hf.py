"""Moving weights between Hugging Face Llama checkpoints and kvlib, and running HF's quantized
cache under a kvlib model (`HFQuantizedCache`, chapter 8).

Two differences, neither of which changes the function computed:

* kvlib fuses q/k/v into one ``wqkv`` matrix and gate/up into ``w_gate_up``
  (one matmul each instead of three and two);
* kvlib stores matrices ``(in, out)`` where ``nn.Linear`` stores ``(out, in)``
  (see `kvlib.model.Linear`), so every matrix is transposed on the way in.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .cache import Cache
from .config import ModelConfig
from .model import Transformer


def config_from_hf(hf_config) -> ModelConfig:
    """A `ModelConfig` from a transformers ``LlamaConfig`` (or anything with its fields)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"kvlib implements plain RoPE only, this config uses rope_type={rope.get('rope_type')!r}")
    n_head = hf_config.num_attention_heads
    return ModelConfig(
        n_layer=hf_config.num_hidden_layers,
        n_head=n_head,
        n_kv_head=getattr(hf_config, "num_key_value_heads", None) or n_head,
        d_model=hf_config.hidden_size,
        d_ff=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_seq_len=hf_config.max_position_embeddings,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head,
        rope_base=float(base),
        norm_eps=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        name=getattr(hf_config, "name_or_path", "") or "",
    )


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) Hugging Face Llama weights into kvlib's names."""
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise KeyError(f"weight {name!r} is missing from the Hugging Face state dict")
        return sd[name]

    def t(name: str) -> torch.Tensor:  # (out, in) -> (in, out)
        return get(name).t().contiguous()

    out = {"norm.weight": get("model.norm.weight")}
    if config.tie_embeddings:
        out["lm_head.weight"] = t("model.embed_tokens.weight")  # (d_model, vocab), shared with the embedding
    else:
        out["tok_emb.weight"] = get("model.embed_tokens.weight")  # (vocab, d_model), a lookup table
        out["lm_head.weight"] = t("lm_head.weight")
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm.weight"] = get(p + "input_layernorm.weight")
        out[f"layers.{i}.mlp_norm.weight"] = get(p + "post_attention_layernorm.weight")
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
            [t(p + "self_attn.q_proj.weight"), t(p + "self_attn.k_proj.weight"), t(p + "self_attn.v_proj.weight")], dim=1
        )  # (d_model, (H + 2 H_kv) D): columns [q | k | v]
        out[f"layers.{i}.attn.wo.weight"] = t(p + "self_attn.o_proj.weight")
        out[f"layers.{i}.mlp.w_gate_up.weight"] = torch.cat(
            [t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")], dim=1
        )  # (d_model, 2 d_ff): columns [gate | up]
        out[f"layers.{i}.mlp.w_down.weight"] = t(p + "mlp.down_proj.weight")
    return out


def from_state_dict(
    config: ModelConfig,
    sd: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Transformer:
    """Build a `Transformer` around kvlib-named weights without a random init first."""
    model = Transformer(config, device="meta")
    model.load_state_dict(dict(sd), strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def from_hf(hf_model, *, dtype: torch.dtype | None = None) -> Transformer:
    """A kvlib copy of a transformers ``LlamaForCausalLM`` (same weights, same device)."""
    config = config_from_hf(hf_model.config)
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}  # share no storage with HF
    device = next(hf_model.parameters()).device
    return from_state_dict(config, state_dict_from_hf(sd, config), dtype=dtype, device=device)


# -- Hugging Face's quantized cache, driven by a kvlib model ---------------------------------------
def _tensor_bytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (a tensor, a tensor subclass made of inner tensors, or containers)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):  # e.g. quanto's packed tensors
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n)) for n in names)
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


class HFQuantizedCache(Cache):
    """Hugging Face's ``transformers.QuantizedCache`` behind kvlib's protocol, so a kvlib model runs on it.

    ``HFQuantizedCache(n_layer, "fp8")`` (the backend that needs no extra package;
    ``"quanto"`` and ``"hqq"`` need ``optimum-quanto`` or ``hqq``). Both protocols share
    ``update(k, v, layer_idx)``; this adds what kvlib asks of a cache. ``nbytes``
    counts every tensor HF's layers hold; ``layer_kv`` is what the last update returned.
    """

    def __init__(self, n_layer: int, backend: str = "fp8", **kwargs) -> None:
        super().__init__(n_layer)
        from transformers import LlamaConfig, QuantizedCache  # imported here: kvlib does not need transformers

        self.backend, self.kwargs = backend, kwargs
        self.hf = QuantizedCache(backend, LlamaConfig(num_hidden_layers=n_layer), **kwargs)  # reads the layer count
        self.reset()

    def reset(self) -> None:
        self.hf.reset()
        self.last: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.n_layer
        self.spec = None

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        self.last[layer_idx] = self.hf.update(key_states, value_states, layer_idx)
        return self.last[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.last[layer_idx] is None else self.hf.get_seq_length(layer_idx)

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(list(vars(layer).values())) for layer in self.hf.layers)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(f"Hugging Face's quantized cache ({self.backend!r}) cannot be cropped")

    def layer_kv(self, layer_idx):
        return self.last[layer_idx]
