"""kvlib.piecewise: the blocks compiled around their cache calls give the eager model's logits
(fp32, to rounding) and the Engine's tokens, through every kind of cache call; what it cannot
compile is refused before anything changes."""

import copy

import pytest
import torch

from kvlib import DynamicCache, Engine, ModelConfig, PagedCache, Transformer, generate
from kvlib.piecewise import after_attention, before_attention, compile_blocks, decompile_blocks, is_compiled

pytestmark = pytest.mark.cpu_only("torch.compile's C++ backend on the CPU (inductor); a GPU compiles with Triton")

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32: the fused loops may sum in another order


def served(model, prompts: list[list[int]], new: int, blocks: int) -> dict:
    """Every prompt's tokens from one `Engine` run (blocks of 4, 6 tokens a step)."""
    eng = Engine(model, PagedCache.for_model(model, num_blocks=blocks, block_size=4), token_budget=6)
    for p in prompts:
        eng.add(p, max_new_tokens=new)
    return eng.run()


@pytest.fixture(scope="module")
def pair():
    """A small model and its piecewise-compiled copy (compiled once for the module: about 10 s)."""
    cfg = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=97, max_seq_len=128)
    eager = Transformer(cfg)
    eager.reset_parameters(seed=0, std=0.2)
    eager.eval()
    return eager, compile_blocks(copy.deepcopy(eager))


@torch.inference_mode()
def test_prefill_and_decode_logits_equal_the_eager_model(pair):
    eager, comp = pair
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    caches = DynamicCache(3), DynamicCache(3)
    for step in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:11], tokens[:, 10:11]):  # T > 1 and T = 1 graphs
        a, b = eager(step, caches[0]), comp(step, caches[1])
        torch.testing.assert_close(b, a, **TOL)
    for layer in range(3):  # the cache call ran eager and got the same keys
        torch.testing.assert_close(caches[1].layer_kv(layer)[0], caches[0].layer_kv(layer)[0], **TOL)
    torch.testing.assert_close(comp(tokens), eager(tokens), **TOL)  # no cache: causal attention


def test_the_engine_gives_the_eager_tokens(pair):
    eager, comp = pair
    prompts = [[5, 9, 14], [3, 1, 4, 1, 5, 9, 2, 6], [7], [8, 8, 2, 40, 41]]
    outs = [served(model, prompts, new=6, blocks=32) for model in pair]
    assert outs[0] == outs[1]
    assert generate(comp, torch.tensor([prompts[1]]), 5).tolist() == generate(eager, torch.tensor([prompts[1]]), 5).tolist()


def test_the_pieces_are_the_blocks_arithmetic():
    """The two pieces, uncompiled, against the eager block: a mutant that drops a residual fails here."""
    cfg = ModelConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=32)
    m = Transformer(cfg)
    m.reset_parameters(seed=2, std=0.2)
    block, x = m.layers[0], torch.randn(1, 5, 32)
    from kvlib.rope import rope_cos_sin
    cos, sin = rope_cos_sin(torch.arange(5)[None], cfg.head_dim, cfg.rope_base, dtype=torch.float32)
    cos, sin = cos[:, :, None], sin[:, :, None]
    q, k, v = before_attention(x, block.attn_norm.weight, block.attn.wqkv.weight, cos, sin, eps=cfg.norm_eps,
                               heads=(4, 2, 8))
    from kvlib.attention import attend
    y = after_attention(x, attend(q, k, v, None, "sdpa"), block.attn.wo.weight, block.mlp_norm.weight,
                        block.mlp.w_gate_up.weight, block.mlp.w_down.weight, eps=cfg.norm_eps)
    torch.testing.assert_close(y, block(x, cos, sin, None, None), rtol=0, atol=1e-6)


def test_state_copies_and_undo():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=32)
    m = Transformer(cfg)
    keys = list(m.state_dict())
    assert compile_blocks(m) is m and is_compiled(m)
    assert list(m.state_dict()) == keys  # the weights are where they were
    assert is_compiled(copy.deepcopy(m))
    assert decompile_blocks(m) is m and not is_compiled(m)


def test_what_cannot_be_compiled_is_refused_unchanged():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=32)
    m = Transformer(cfg)
    m.set_batch_invariant(True)
    with pytest.raises(ValueError, match="set_batch_invariant"):
        compile_blocks(m)
    assert not is_compiled(m)
    m.set_batch_invariant(False)
    from kvlib.wquant import quantize_weights
    quantize_weights(m, "int8")
    with pytest.raises(ValueError, match="layers.0.attn.wqkv is a Int8Linear"):
        compile_blocks(m)
    assert not is_compiled(m)
    with pytest.raises(TypeError, match="kvlib Transformer"):
        compile_blocks(torch.nn.Linear(2, 2))


@torch.inference_mode()
def test_a_prepacked_model_compiles_around_its_onednn_products():
    """fp32 weights packed for oneDNN: each packed product is one opaque call in the graph (the
    custom operator), four a block a forward, and the logits and Engine tokens are the packed
    eager model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvlib.prepack import available, prepack_weights
    if not available(torch.float32):
        pytest.skip("this PyTorch build has no oneDNN packed-linear ops")
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=97, max_seq_len=64)
    eager = Transformer(cfg)
    eager.reset_parameters(seed=3, std=0.2)
    eager = prepack_weights(eager.eval())
    comp = compile_blocks(copy.deepcopy(eager))

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func in (torch.ops.kvlib.packed_linear.default, torch.ops.mkldnn._linear_pointwise.default)
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    caches = DynamicCache(2), DynamicCache(2)
    for step in (tokens[:, :6], tokens[:, 6:7], tokens[:, 7:9]):
        torch.testing.assert_close(comp(step, caches[1]), eager(step, caches[0]), **TOL)
    with Count():
        comp(tokens[:, 8:9], caches[1])
    assert Count.n == 4 * 2 + 1  # wqkv, wo, w_gate_up, w_down in each block, and the tied head
    prompts = [[5, 9, 14], [3, 1, 4, 1, 5, 9, 2, 6], [7]]
    assert served(comp, prompts, new=5, blocks=16) == served(eager, prompts, new=5, blocks=16)
