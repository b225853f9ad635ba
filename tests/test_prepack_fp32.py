"""kvlib.prepack in fp32: the weights reordered once for oneDNN's fp32 kernel, as vLLM's CPU backend
runs its fp32 projections. Close to the plain model (another kernel, another order of sums), the
same greedy tokens where logits are sharp, and everything a packed model keeps (copies, state)."""

import copy

import pytest
import torch

import kvlib
from kvlib import Engine, ModelConfig, PagedCache, Transformer
from kvlib.model import Linear
from kvlib.prepack import PackedLinear, available, is_packed, prepack_weights, unpack_weights, use_prepack

pytestmark = [pytest.mark.cpu_only("oneDNN's packed layout exists on the CPU only"),
              pytest.mark.skipif(not available(torch.float32), reason="no oneDNN packed-linear ops in this build")]

FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # one fp32 product, summed in another order


def tiny() -> Transformer:
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=96, max_seq_len=64)
    m = Transformer(cfg)
    m.reset_parameters(seed=0, std=0.2)  # sharp logits: no greedy ties for rounding to tip
    return m.eval()


@pytest.mark.parametrize("rows", [(1,), (16,), (2, 5), (300,)])
@pytest.mark.parametrize("K, N", [(64, 96), (576, 960), (200, 33)])
def test_an_fp32_packed_linear_multiplies_like_x_at_w(rows, K, N):
    g = torch.Generator().manual_seed(K + N)
    w, x = torch.randn(K, N, generator=g), torch.randn(*rows, K, generator=g)
    layer = PackedLinear(w)
    y = layer(x)
    assert y.shape == (*rows, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w, rtol=1e-5, atol=1e-4 * K ** 0.5)
    assert torch.equal(layer.plain_weight(), w)  # the reorder is a permutation: exactly back


def test_a_packed_fp32_model_gives_the_plain_logits_and_tokens():
    model = tiny()
    packed = prepack_weights(copy.deepcopy(model))
    assert is_packed(packed) and not any(type(m) is Linear for m in packed.modules())
    assert "packed float32" in repr(packed.lm_head)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(tokens), model(tokens), rtol=1e-4, atol=1e-4)
    prompts = [[5, 9, 14], [3, 1, 4, 1, 5, 9, 2, 6], [7]]
    outs = []
    for m in (model, packed):
        eng = Engine(m, PagedCache.for_model(m, num_blocks=16, block_size=4), token_budget=6)
        for p in prompts:
            eng.add(p, max_new_tokens=5)
        outs.append(eng.run())
    assert outs[0] == outs[1]


def test_a_packed_fp32_model_keeps_its_weights_through_copies_and_state():
    model = tiny()
    packed = prepack_weights(copy.deepcopy(model))
    state = packed.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # plain (in, out) weights
    again = copy.deepcopy(packed)
    assert is_packed(again) and again.lm_head.dtype == torch.float32
    fresh = prepack_weights(tiny().float())
    fresh.load_state_dict(state)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(fresh(tokens), packed(tokens))
    assert packed.to(torch.float32) is packed  # keeps fp32 on the CPU: a no-op
    with pytest.raises(ValueError, match="float32 matrices are prepacked .* cannot move to torch.bfloat16"):
        packed.to(torch.bfloat16)
    unpack_weights(packed)
    assert not is_packed(packed) and all(torch.equal(packed.state_dict()[k], v) for k, v in state.items())


def test_fp32_is_packed_only_when_asked(monkeypatch):
    monkeypatch.delenv("KVLIB_PREPACK", raising=False)
    assert not use_prepack(None, torch.float32, "cpu")
    assert use_prepack(True, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiplies torch.float32 rows"):
        PackedLinear(torch.randn(8, 8))(torch.randn(1, 8).to(torch.bfloat16))
