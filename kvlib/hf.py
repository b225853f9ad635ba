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
from .validate import positive_int, token_ids


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


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """kvlib's weights under Hugging Face Llama names: `state_dict_from_hf` undone (split, transposed)."""
    missing = [k for k in ("norm.weight", "lm_head.weight", "layers.0.attn.wqkv.weight") if k not in sd]
    if missing:
        raise KeyError(f"weights {missing} are missing: only a plain (unquantized) kvlib Transformer converts")

    def t(x: torch.Tensor) -> torch.Tensor:  # (in, out) -> (out, in)
        return x.t().contiguous()

    H, H_kv, D, F = config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    out = {"model.norm.weight": sd["norm.weight"], "lm_head.weight": t(sd["lm_head.weight"])}
    out["model.embed_tokens.weight"] = out["lm_head.weight"] if config.tie_embeddings else sd["tok_emb.weight"]
    for i in range(config.n_layer):
        p, k = f"model.layers.{i}.", f"layers.{i}."
        q, k_, v = sd[k + "attn.wqkv.weight"].split([H * D, H_kv * D, H_kv * D], dim=1)  # columns [q | k | v]
        gate, up = sd[k + "mlp.w_gate_up.weight"].split([F, F], dim=1)  # columns [gate | up]
        out.update({
            p + "input_layernorm.weight": sd[k + "attn_norm.weight"],
            p + "post_attention_layernorm.weight": sd[k + "mlp_norm.weight"],
            p + "self_attn.q_proj.weight": t(q), p + "self_attn.k_proj.weight": t(k_),
            p + "self_attn.v_proj.weight": t(v), p + "self_attn.o_proj.weight": t(sd[k + "attn.wo.weight"]),
            p + "mlp.gate_proj.weight": t(gate), p + "mlp.up_proj.weight": t(up),
            p + "mlp.down_proj.weight": t(sd[k + "mlp.w_down.weight"]),
        })
    return out


def to_hf(model: Transformer, *, attn_implementation: str = "sdpa"):
    """A transformers ``LlamaForCausalLM`` with ``model``'s weights (copied), dtype and device.

    The way to run Hugging Face's own code (its ``generate``, its caches, its
    continuous-batching ``generate_batch`` with ``attn_implementation="paged|sdpa"``)
    on exactly the weights a kvlib chapter uses, without loading the checkpoint again.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"to_hf converts a kvlib Transformer, got {type(model).__name__}")
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: kvlib does not need transformers

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # transformers 4

    c = model.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
        rope_theta=c.rope_base, hidden_act="silu",  # transformers 5 moves it into rope_parameters itself
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation=attn_implementation,
    )
    sd = state_dict_to_hf(model.state_dict(), c)  # load_state_dict copies: nothing is shared
    with no_init_weights():  # every weight is overwritten below: skip the random init
        hf = LlamaForCausalLM(hf_config).to(dtype=model.dtype)
    hf.load_state_dict(sd, strict=True)
    return hf.to(model.device).eval()


def hf_generate_batch(
    hf_model, prompts: list[list[int]], max_new_tokens: int, *, num_blocks: int = 64, block_size: int = 16,
    token_budget: int = 256,
) -> list[list[int]]:
    """Greedy continuous batching by Hugging Face's own engine: ``generate_batch`` over its
    paged cache. Returns each prompt's new tokens.

    The pool is sized as kvlib's `Engine` would be: ``num_blocks`` blocks of
    ``block_size`` tokens (HF's ``page_size``), at most ``token_budget`` tokens a step
    (HF's ``max_batch_tokens``). Left to size itself, HF reserves a share of free
    memory, which on a CPU costs seconds. No stop token: every prompt gets
    ``max_new_tokens``. (transformers 5.24 pages its "sdpa" attention itself; older
    versions wanted ``attn_implementation="paged|sdpa"``.)
    """
    import transformers

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        raise ImportError(f"hf_generate_batch needs transformers 5 (its ContinuousBatchingConfig); "
                          f"this is {transformers.__version__}") from e

    if not callable(getattr(hf_model, "generate_batch", None)):
        raise TypeError(f"hf_generate_batch needs a transformers model, got {type(hf_model).__name__}")
    prompts = [list(p) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError(f"hf_generate_batch needs non-empty prompts, got lengths {[len(p) for p in prompts]}")
    prompts = [token_ids(f"prompt {i}", p, hf_model.config.vocab_size) for i, p in enumerate(prompts)]
    for name, value in (("max_new_tokens", max_new_tokens), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("token_budget", token_budget)):
        positive_int(name, value)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > num_blocks * block_size:
        raise ValueError(f"a request of {longest} tokens does not fit {num_blocks} blocks of {block_size}")
    generation = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=block_size, max_batch_tokens=token_budget)
    out = hf_model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=batching,
                                  progress_bar=False, warmup=False)
    try:
        results = sorted(out.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[1]))  # "req_0", "req_1", ...
    except ValueError:
        results = None
    if results is None or [list(r.prompt_ids) for r in results] != prompts:
        raise RuntimeError("generate_batch returned its requests in an order this wrapper does not recognise")
    return [list(r.generated_tokens) for r in results]


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
def _tensors(obj) -> list[torch.Tensor]:
    """The plain tensors in ``obj``: a tensor, a tensor subclass made of inner tensors (quanto's
    packed tensors), or tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return [t for n in names for t in _tensors(getattr(obj, n))]
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def hf_cache_bytes(cache) -> int:
    """Bytes of every tensor that a transformers ``Cache``'s layers hold (what it stores, as
    `kvlib.Cache.nbytes` counts for kvlib's caches)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"hf_cache_bytes needs a transformers Cache with .layers, got {type(cache).__name__}")
    return sum(t.nbytes for layer in layers for t in _tensors(vars(layer)))


class HFQuantizedCache(Cache):
    """Hugging Face's ``transformers.QuantizedCache`` behind kvlib's protocol, so a kvlib model runs on it.

    ``HFQuantizedCache(n_layer, "fp8")`` (the backend that needs no extra package;
    ``"quanto"`` and ``"hqq"`` need ``optimum-quanto`` or ``hqq``). Both protocols share
    ``update(k, v, layer_idx)``; this adds what kvlib asks of a cache. ``nbytes``
    counts every tensor HF's layers hold, and ``bytes_written`` the tensors an update
    made there. ``reset`` builds a new HF cache rather than trusting HF's ``reset``:
    transformers versions differ in what their reset clears (some keep the quantized
    state), and a reused cache must never return an earlier text's keys.
    ``layer_kv`` dequantizes what HF's layer holds (its ``_quantized_keys`` and residual
    ``keys``, transformers 5's layout); nothing dequantized is kept between calls, so the
    memory held is HF's quantized storage alone.
    """

    def __init__(self, n_layer: int, backend: str = "fp8", **kwargs) -> None:
        super().__init__(n_layer)
        self.backend, self.kwargs = backend, kwargs
        self.hf = self._new_hf()
        self.reset()

    def _new_hf(self):
        import transformers  # imported here: kvlib does not need transformers
        from transformers import LlamaConfig, QuantizedCache

        try:
            return QuantizedCache(self.backend, LlamaConfig(num_hidden_layers=self.n_layer), **self.kwargs)
        except ValueError as e:
            if "backend" in str(e).lower():
                raise ValueError(
                    f"transformers {transformers.__version__} has no {self.backend!r} QuantizedCache backend "
                    f"({e}); 'fp8' needs transformers 5.21 or later (Fp8QuantizedLayer first appears in 5.21.0)"
                ) from e
            raise

    def reset(self) -> None:
        self.hf = self._new_hf()  # a fresh HF cache: no quantized state survives, on any version

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        layer = self.hf.layers[layer_idx]
        before = {t.untyped_storage().data_ptr() for t in _tensors(vars(layer))}
        out = self.hf.update(key_states, value_states, layer_idx)
        self.count_written(*[t for t in _tensors(vars(layer)) if t.untyped_storage().data_ptr() not in before])
        return out  # on a first update HF returns the caller's own tensors; it stores them quantized

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.hf.layers[self.check_layer(layer_idx)]
        return self.hf.get_seq_length(layer_idx) if getattr(layer, "is_initialized", False) else 0

    @property
    def nbytes(self) -> int:
        return hf_cache_bytes(self.hf)

    def crop(self, max_length: int) -> None:
        if self.crop_length(max_length) == 0:
            return self.reset()  # crop(0) empties it, as every cache's does
        raise NotImplementedError(f"Hugging Face's quantized cache ({self.backend!r}) cannot be cropped, except "
                                  f"to 0 (reset)")

    def layer_kv(self, layer_idx):
        layer = self.hf.layers[self.check_layer(layer_idx)]
        if self.get_seq_length(layer_idx) == 0:
            return None
        out = []
        for quantized, residual in ((layer._quantized_keys, layer.keys), (layer._quantized_values, layer.values)):
            parts = [layer._dequantize(quantized)]  # (B, H, S_q, D)
            if residual.dim() == 4 and residual.shape[-2]:
                parts.append(residual)  # the full-precision window of the integer backends
            out.append(torch.cat(parts, dim=-2))
        return out[0], out[1]
