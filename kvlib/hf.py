"""Moving weights between Hugging Face Llama checkpoints and kvlib.

Two differences, neither of which changes the function computed:

* kvlib fuses q/k/v into one ``wqkv`` matrix and gate/up into ``w_gate_up``
  (one matmul each instead of three and two);
* kvlib stores matrices ``(in, out)`` where ``nn.Linear`` stores ``(out, in)``
  (see `kvlib.model.Linear`), so every matrix is transposed on the way in.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

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
