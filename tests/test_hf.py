"""kvlib against an outside implementation: Hugging Face transformers, same weights."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvlib
from kvlib.hf import config_from_hf, from_hf, hf_cache_bytes, hf_generate_batch, to_hf

pytestmark = pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")

# fp32, same weights, different kernels and summation orders (fused vs separate matmuls,
# (in, out) vs (out, in) layout): logits agree to about 1e-5 of their scale.
TOL = dict(rtol=1e-4, atol=1e-4)


def random_hf_llama(n_layer, n_head, n_kv_head, head_dim, tied, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=101, hidden_size=n_head * head_dim, intermediate_size=48, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_kv_head, max_position_embeddings=64,
        rope_theta=500.0 + seed, rms_norm_eps=1e-6, tie_word_embeddings=tied, attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms at 1; randomise them so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@given(n_layer=st.integers(1, 3), n_kv_head=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]),
       tied=st.booleans(), seed=st.integers(0, 1000), batch=st.integers(1, 2), T=st.integers(1, 12))
def test_random_llama_logits_match_hf(n_layer, n_kv_head, group, tied, seed, batch, T):
    hf = random_hf_llama(n_layer, n_kv_head * group, n_kv_head, 8, tied, seed)
    ours = from_hf(hf)
    assert ours.config.n_kv_head == n_kv_head and ours.config.tie_embeddings == tied
    ids = torch.randint(0, 101, (batch, T), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        ref = hf(ids).logits
        torch.testing.assert_close(ours(ids), ref, **TOL)
        # and the cached path, token by token, against HF's full forward
        cache = kvlib.DynamicCache(n_layer)
        steps = torch.cat([ours(ids[:, t:t + 1], cache) for t in range(T)], dim=1)
        torch.testing.assert_close(steps, ref, **TOL)


def test_random_llama_greedy_tokens_match_hf_generate():
    hf = random_hf_llama(2, 4, 2, 16, False, seed=11)
    ours = from_hf(hf)
    ids = torch.tensor([[5, 17, 42, 8]])
    ref = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(kvlib.generate(ours, ids, 20), ref)


@given(tied=st.booleans(), n_kv_head=st.sampled_from([1, 2]), seed=st.integers(0, 100))
def test_to_hf_gives_back_the_hf_weights_and_function(tied, n_kv_head, seed):
    """HF -> kvlib -> HF: every HF tensor comes back bit for bit, and HF's forward on the
    converted model equals the original's."""
    hf = random_hf_llama(2, 2 * n_kv_head, n_kv_head, 8, tied, seed)
    back = to_hf(from_hf(hf), attn_implementation="eager")
    want = hf.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        assert torch.equal(back(ids).logits, hf(ids).logits)  # same weights, same code: same bits


def test_hf_cache_bytes_counts_what_hf_stores():
    """A DynamicCache after 7 tokens of a 2-layer model: 2 layers x (K, V) x (1, 2, 7, 8) fp32."""
    from transformers import DynamicCache

    hf = random_hf_llama(2, 4, 2, 8, False, seed=1)
    cache = DynamicCache(config=hf.config)
    hf(torch.arange(7)[None], past_key_values=cache, use_cache=True)
    assert hf_cache_bytes(cache) == 2 * 2 * (1 * 2 * 7 * 8) * 4
    with pytest.raises(TypeError, match="needs a transformers Cache"):
        hf_cache_bytes(kvlib.DynamicCache(2))


def test_to_hf_refuses_what_it_cannot_convert():
    with pytest.raises(TypeError, match="converts a kvlib Transformer"):
        to_hf(random_hf_llama(1, 2, 1, 8, False, seed=0))
    from kvlib.wquant import quantize_weights

    tiny = kvlib.Transformer(kvlib.ModelConfig(n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                                               vocab_size=40, max_seq_len=32))
    with pytest.raises(KeyError, match="only a plain"):
        to_hf(quantize_weights(tiny, "int8"))


def test_config_from_hf_reads_rope_and_heads():
    hf = random_hf_llama(2, 6, 2, 8, True, seed=3)
    c = config_from_hf(hf.config)
    assert (c.n_layer, c.n_head, c.n_kv_head, c.head_dim, c.rope_base, c.tie_embeddings) == (2, 6, 2, 8, 503.0, True)


# -- the real model ------------------------------------------------------------------------------
PROMPTS = [
    "The history of the Roman Empire began when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A key-value cache speeds up transformer inference because",
]


@pytest.mark.smollm2
def test_smollm2_weights_equal_hf_gguf_loader(smollm2, hf_smollm2):
    """Our GGUF reader (dequantize + undo llama.cpp's q/k permutation) vs transformers' loader."""
    ours, _ = smollm2
    hf, _ = hf_smollm2
    reference = from_hf(hf)
    for (name, a), (name_b, b) in zip(ours.state_dict().items(), reference.state_dict().items()):
        assert name == name_b
        assert torch.equal(a, b), name


@pytest.mark.smollm2
def test_smollm2_to_hf_equals_hf_gguf_loader(smollm2, hf_smollm2):
    """kvlib's weights handed to transformers equal what transformers' own GGUF loader reads."""
    mine, want = to_hf(smollm2[0]).state_dict(), hf_smollm2[0].state_dict()
    assert set(mine) == set(want)
    for name, w in want.items():
        assert torch.equal(mine[name], w), name


@pytest.mark.smollm2
@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_64_tokens_identical_to_hf(smollm2, hf_smollm2, prompt):
    ours, tok = smollm2
    hf, _ = hf_smollm2
    ids = torch.tensor([tok.encode(prompt)])
    ref = hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    out = kvlib.generate(ours, ids, 64)
    assert out.shape == ref.shape == (1, ids.shape[1] + 64)
    assert torch.equal(out, ref), f"first difference at new token {int((out != ref).nonzero()[0, 1]) - ids.shape[1]}"
    with torch.inference_mode():  # last-position logits of the full sequence, both models
        torch.testing.assert_close(ours(out, last_only=True)[:, -1], hf(out).logits[:, -1], rtol=1e-4, atol=2e-4)


@pytest.mark.smollm2
def test_smollm2_batched_logits_match_hf(smollm2, hf_smollm2):
    ours, tok = smollm2
    hf, _ = hf_smollm2
    ids = torch.tensor([tok.encode(p)[:8] for p in PROMPTS])
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=2e-4)


@pytest.mark.smollm2
def test_tokenizer_matches_hf(smollm2, hf_smollm2):
    _, tok = smollm2
    _, hf_tok = hf_smollm2
    texts = PROMPTS + ["Ünïcödé, emoji 🤖 and  double  spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert tok.apply_chat_template(messages) == list(ref)
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    ref = hf_tok.apply_chat_template(with_system, add_generation_prompt=False, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == list(ref)
    hf_special = (hf_tok.bos_token_id, hf_tok.eos_token_id)
    if hf_special == (1, 1):  # transformers 4.56's GGUF loader (the floors): eos is <|im_start|>, wrongly
        assert (tok.bos_id, tok.eos_id) == (1, 2)  # kvlib reads the file's own (test_pretrained checks them)
    else:
        assert (tok.bos_id, tok.eos_id) == hf_special


@pytest.mark.smollm2
def test_smollm2_ragged_batch_equals_each_prompt_alone(smollm2):
    """Left padding + padding mask + per-row positions: batching changes no token."""
    model, tok = smollm2
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # really different lengths
    out = kvlib.generate(model, prompts, 24, pad_id=tok.eos_id)
    T = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        alone = kvlib.generate(model, p, 24)[0]
        assert out[i, T - len(p):].tolist() == alone.tolist(), f"prompt {i} changed when batched"


# -- Hugging Face's continuous-batching engine on the same requests ---------------------------------
try:  # the main job's transformers (requirements.txt) has it; the dependency-floors job's 4.56 does not
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    HAS_GENERATE_BATCH = True
except ImportError:
    HAS_GENERATE_BATCH = False
needs_generate_batch = pytest.mark.skipif(not HAS_GENERATE_BATCH, reason="generate_batch's config is transformers 5")


@needs_generate_batch
def test_hf_generate_batch_equals_kvlib_engine_on_a_random_model(tiny_model):
    """HF's generate_batch (paged cache, continuous batching) and kvlib's Engine, greedy, on
    prompts of different lengths: the same tokens."""
    hf = to_hf(tiny_model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]
    eng = kvlib.Engine(tiny_model, kvlib.PagedCache.for_model(tiny_model.config, num_blocks=32, block_size=4))
    for p in prompts:
        eng.add(p, 9)
    want = [v[0] for v in eng.run().values()]
    assert hf_generate_batch(hf, prompts, 9, num_blocks=32, block_size=4) == want


@needs_generate_batch
def test_hf_generate_batch_refuses_bad_input(tiny_model):
    hf = to_hf(tiny_model)
    with pytest.raises(ValueError, match="non-empty prompts"):
        hf_generate_batch(hf, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        hf_generate_batch(hf, [[1, 2]], 0)
    with pytest.raises(IndexError, match=r"prompt 1: token ids must lie in \[0, 50\)"):
        hf_generate_batch(hf, [[1, 2], [3, 50]], 4)
    with pytest.raises(ValueError, match="a request of 12 tokens does not fit 2 blocks of 4"):
        hf_generate_batch(hf, [[1, 2]], 10, num_blocks=2, block_size=4)
    with pytest.raises(TypeError, match="needs a transformers model"):
        hf_generate_batch(tiny_model, [[1, 2]], 4)


@pytest.mark.smollm2
@needs_generate_batch
def test_hf_generate_batch_equals_kvlib_engine_on_smollm2(smollm2):
    """The request set of the serving chapter (ch12), with more new tokens than it runs."""
    model, tok = smollm2
    prompts = [tok.encode(t) for t in (
        "The history of the Roman Empire began when", "def fibonacci(n):",
        "A key-value cache speeds up transformer inference because",
        "Once upon a time, in a small village by the sea, there lived")]
    eng = kvlib.Engine(model, kvlib.PagedCache.for_model(model.config, num_blocks=32, block_size=16))
    for p in prompts:
        eng.add(p, 16)
    want = [v[0] for v in eng.run().values()]
    assert hf_generate_batch(to_hf(model), prompts, 16) == want


# -- HFQuantizedCache.reset, on every transformers version pyproject allows ---------------------------------
def _fp8_layer_class():
    """transformers' fp8 cache layer class, or None where this version has no 'fp8' backend (4.x)."""
    import transformers.cache_utils as cu

    return getattr(cu, "Fp8QuantizedLayer", None)


def _fill(cache, T, seed):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(1, 2, T, 8, generator=g) for _ in range(2)]
    for layer in range(cache.n_layer):
        cache.update(kv[0], kv[1], layer)
    return kv


@pytest.mark.parametrize("hf_reset", ["this version's", "an older 5.x's, which keeps the quantized state"])
def test_a_reset_hf_quantized_cache_forgets_the_last_text(hf_reset, monkeypatch):
    """kvlib 0.2 called HF's own reset, right only where HF drops its quantized state; under the older reset
    a reused cache returned the first text's keys in front of the second's. At the floors (transformers 4.56)
    there is no 'fp8' backend at all, and the cache says so by name instead of failing later."""
    from kvlib.hf import HFQuantizedCache

    layer_class = _fp8_layer_class()
    if layer_class is None:
        with pytest.raises(ValueError, match=r"has no 'fp8' QuantizedCache backend"):
            HFQuantizedCache(2)
        return
    if hf_reset != "this version's":
        def older_reset(self):  # the states zeroed in place, _quantized_keys kept, still "initialized"
            if self.is_initialized:
                self.keys.zero_()
                self.values.zero_()
            self.cumulative_length = 0

        monkeypatch.setattr(layer_class, "reset", older_reset)
    reused, fresh = HFQuantizedCache(2), HFQuantizedCache(2)
    _fill(reused, 5, seed=0)
    reused.reset()
    assert reused.seq_len == 0 and reused.layer_kv(0) is None and reused.nbytes == 0
    _fill(reused, 3, seed=1)
    _fill(fresh, 3, seed=1)
    assert reused.seq_len == fresh.seq_len == 3
    for layer in range(2):
        for got, want in zip(reused.layer_kv(layer), fresh.layer_kv(layer)):
            assert torch.equal(got, want)
