"""kvlib.prepack: bf16 weights reordered once into oneDNN's layout, and the models built from them."""

import copy

import pytest
import torch

from kvlib import ModelConfig, Transformer
from kvlib.model import Linear
from kvlib.prepack import PackedLinear, available, onednn_trace, prepack_weights
from kvlib.wquant import stored_bytes

pytestmark = [pytest.mark.cpu_only("about the CPU: threads, AMX, oneDNN"),
              pytest.mark.skipif(not available(), reason="bf16 weights cannot be packed here (kvlib.prepack.available())")]

BF16 = torch.bfloat16
# One bf16 product against the fp32 product of the same bf16 numbers: the output is rounded
# to bf16 (relative 2^-8) and the kernel sums in its own order, in fp32.
PRODUCT_TOL = dict(rtol=2 ** -7, atol=1e-3)


def tiny(tie: bool) -> Transformer:
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=96,
                      max_seq_len=64, tie_embeddings=tie)
    m = Transformer(cfg)
    m.reset_parameters(seed=0, std=0.2)
    return m.to(BF16).eval()


@pytest.mark.parametrize("rows", [(1,), (3,), (8,), (64,), (2, 5)])
@pytest.mark.parametrize("K, N", [(64, 96), (576, 960), (200, 33)])
def test_packed_linear_multiplies_like_x_at_w(rows, K, N):
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(K, N, generator=g).to(BF16)  # kvlib's (in, out)
    x = torch.randn(*rows, K, generator=g).to(BF16)
    y = PackedLinear(w)(x)
    assert y.shape == (*rows, N) and y.dtype == BF16
    torch.testing.assert_close(y.float(), x.float() @ w.float(), **PRODUCT_TOL)


def test_packing_permutes_the_bytes_it_does_not_add_any():
    w = torch.randn(576, 960).to(BF16)
    layer = PackedLinear(w)
    assert layer.packed.numel() * layer.packed.element_size() == w.numel() * w.element_size()
    assert layer.rows is None
    with pytest.raises(RuntimeError):  # an opaque oneDNN tensor: its bytes cannot be read as a matrix
        layer.packed.data_ptr()


@pytest.mark.parametrize("tie", [True, False])
def test_packed_model_computes_what_the_plain_bf16_model_does(tie):
    model = tiny(tie)
    packed = prepack_weights(copy.deepcopy(model))
    assert not any(isinstance(m, Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 2 * 4 + 1
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = model(tokens).float(), packed(tokens).float()
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.02 * scale)  # bf16, layers of rounding
    assert torch.equal(packed.embed(tokens), model.embed(tokens))  # the embedding's rows, unchanged


def test_a_tied_lm_head_keeps_its_rows_and_the_bytes_say_so():
    model = tiny(True)
    head = model.lm_head.weight.numel() * 2
    packed = prepack_weights(copy.deepcopy(model))
    assert packed.lm_head.rows is not None
    assert stored_bytes(packed) == stored_bytes(model) + head  # the vocabulary matrix, twice
    untied = tiny(False)
    assert stored_bytes(prepack_weights(copy.deepcopy(untied))) == stored_bytes(untied)


def test_greedy_generation_runs_on_a_packed_smollm2_like_model():
    import kvlib

    model = prepack_weights(tiny(True))
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    out = kvlib.generate(model, prompt, 8)
    naive = kvlib.generate_naive(model, prompt, 8)
    assert out.shape == (1, 14) and torch.equal(out[:, :6], prompt)
    assert (out == naive).float().mean() > 0.5  # bf16: a near tie may part them, not every token


def test_what_prepack_refuses():
    with pytest.raises(TypeError, match="kvlib Transformer"):
        prepack_weights(torch.nn.Linear(4, 4))
    fp16 = tiny(True).half()
    with pytest.raises(ValueError, match="bf16 or fp32 models on the CPU, got torch.float16"):
        prepack_weights(fp16)
    inv = tiny(True)
    inv.set_batch_invariant(True)
    with pytest.raises(ValueError, match="batch-invariant"):
        prepack_weights(inv)
    with pytest.raises(ValueError, match="bf16 or fp32 weights on the CPU, got torch.float16"):
        PackedLinear(torch.randn(8, 8).half())
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.randn(8).to(BF16))
    with pytest.raises(ValueError, match="multiplies torch.bfloat16 rows"):
        PackedLinear(torch.randn(8, 8).to(BF16))(torch.randn(1, 8))
    with pytest.raises(RuntimeError, match="keep_rows"):
        PackedLinear(torch.randn(8, 8).to(BF16)).embedding_rows(torch.tensor([0]))
    packed = prepack_weights(tiny(True))
    with pytest.raises(TypeError, match="set_batch_invariant needs plain kvlib Linear"):
        packed.set_batch_invariant(True)


def test_onednn_verbose_shows_the_weight_reordered_once_and_then_read_packed():
    """The claim of the module docstring, read from oneDNN's own log (`onednn_trace`)."""
    calls = onednn_trace(576, 1536, calls=3)
    if not any(c.who == "plain" for c in calls):
        pytest.skip("this CPU's bf16 x @ W does not run through oneDNN: nothing is repacked")
    pack = [c for c in calls if c.who == "pack"]
    assert [(c.primitive, c.weights) for c in pack] == [("reorder", "AB16b64a2b")]  # packing, once
    plain = [c for c in calls if c.who == "plain"]
    packed = [c for c in calls if c.who == "packed"]
    assert len(plain) == len(packed) == 3, calls  # one primitive per call, no reorder among them
    assert {c.weights for c in plain} <= {"ab", "ba"}  # the plain matrix, as x @ W hands it over
    assert {(c.primitive, c.weights) for c in packed} == {("inner_product", "AB16b64a2b")}


def test_onednn_trace_rejects_bad_sizes():
    with pytest.raises(ValueError, match="d_out must be a positive int, got 0"):
        onednn_trace(576, 0)
