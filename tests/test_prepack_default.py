"""bf16 packed by default: load_smollm2's rule (`kvlib.prepack.use_prepack`), and a packed model
downstream (copies, state_dict, .to(), quantizing, unpacking, first_layers, the Engine)."""

import copy
import warnings

import pytest
import torch

import kvlib
from kvlib import ModelConfig, Transformer, prepack
from kvlib.model import Linear
from kvlib.prepack import PackedLinear, SlowBF16Warning, is_packed, prepack_weights, unpack_weights, use_prepack
from kvlib.wquant import Int8Linear, quantize_weights, stored_bytes

pytestmark = pytest.mark.cpu_only("oneDNN's packed bf16 layout exists on the CPU only; SmolLM2's GGUF")

BF16 = torch.bfloat16
needs_packing = pytest.mark.skipif(not prepack.available(), reason="no bf16 path to pack for here")


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(prepack.ENV, raising=False)


def tiny(tie: bool = True) -> Transformer:
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=96,
                      max_seq_len=64, tie_embeddings=tie)
    m = Transformer(cfg)
    m.reset_parameters(seed=0, std=0.2)
    return m.to(BF16).eval()


@pytest.mark.parametrize("bf16_path", [True, False])
def test_the_rule_packs_bf16_on_the_cpu_where_oneDNN_can(no_env, monkeypatch, bf16_path):
    monkeypatch.setattr(prepack, "available", lambda dtype=BF16: bf16_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowBF16Warning)
        assert use_prepack(None, BF16, None) is bf16_path
        assert use_prepack(None, BF16, "cpu") is bf16_path
        assert use_prepack(False, BF16, "cpu") is False
    for dtype, device in ((torch.float32, "cpu"), (torch.float16, "cpu"), (BF16, "meta")):
        assert use_prepack(None, dtype, device) is False  # only bf16 on the CPU is packed
    monkeypatch.setenv(prepack.ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowBF16Warning)
        assert use_prepack(None, BF16, "cpu") is False  # KVLIB_PREPACK=0: the plain layout
        monkeypatch.setenv(prepack.ENV, "1")
        assert use_prepack(None, BF16, "cpu") is bf16_path


def test_bf16_without_a_bf16_path_warns_that_fp32_is_faster(no_env, monkeypatch):
    monkeypatch.setattr(prepack, "available", lambda dtype=BF16: False)
    with pytest.warns(SlowBF16Warning, match="several times slower than fp32") as record:
        assert use_prepack(None, BF16, "cpu") is False
    assert issubclass(SlowBF16Warning, UserWarning) and "dtype=torch.float32" in str(record[0].message)
    with pytest.warns(SlowBF16Warning):
        use_prepack(False, BF16, "cpu")  # the plain layout is just as slow there
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bf16 was not asked for, or where it is fast
        use_prepack(None, torch.float32, "cpu")
        monkeypatch.setattr(prepack, "available", lambda dtype=BF16: True)
        use_prepack(None, BF16, "cpu")


def test_what_the_rule_refuses(no_env, monkeypatch):
    monkeypatch.setattr(prepack, "available", lambda dtype=BF16: True)
    with pytest.raises(ValueError, match="prepack=True cannot be honoured: it packs bf16 or fp32 models on the "
                                         "CPU, got torch.float16"):
        use_prepack(True, torch.float16, "cpu")
    assert use_prepack(True, torch.float32, "cpu") and not use_prepack(None, torch.float32, "cpu")  # asked only
    with pytest.raises(TypeError, match="prepack must be True, False or None, got 'yes'"):
        use_prepack("yes", BF16, "cpu")
    monkeypatch.setenv(prepack.ENV, "off")
    with pytest.raises(ValueError, match="KVLIB_PREPACK must be 0 .* or 1 .*, got 'off'"):
        use_prepack(None, BF16, "cpu")
    monkeypatch.delenv(prepack.ENV)
    monkeypatch.setattr(prepack, "available", lambda dtype=BF16: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowBF16Warning)
        with pytest.raises(ValueError, match="no bf16 path to pack for"):
            use_prepack(True, BF16, "cpu")


@needs_packing
def test_a_packed_model_copies_saves_and_loads_as_the_plain_one():
    plain = tiny()
    packed = prepack_weights(copy.deepcopy(plain))
    x = torch.tensor([[1, 5, 9, 3]])
    twin = copy.deepcopy(packed)  # the opaque oneDNN tensors are repacked, not copied
    assert is_packed(twin) and torch.equal(twin(x), packed(x))
    sd, ref = packed.state_dict(), plain.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)  # the plain (in, out) weights
    doubled = {k: 2 * v if v.dim() == 2 else v for k, v in ref.items()}
    twin.load_state_dict(doubled)  # repacks what it loads
    plain2 = copy.deepcopy(plain)
    plain2.load_state_dict(doubled)
    assert torch.equal(twin(x), prepack_weights(plain2)(x))
    assert prepack_weights(packed) is packed and is_packed(packed)  # packing twice: a no-op
    back = unpack_weights(copy.deepcopy(packed))
    assert not is_packed(back) and torch.equal(back(x), plain(x))
    assert stored_bytes(back) == stored_bytes(plain)


@needs_packing
def test_a_packed_model_moves_only_where_it_stays_packed():
    packed = prepack_weights(tiny())
    x = torch.tensor([[1, 5, 9, 3]])
    before = packed(x)
    assert torch.equal(packed.to("cpu")(x), before) and torch.equal(packed.to(BF16)(x), before)
    with pytest.raises(ValueError, match="cannot move to torch.float32 on cpu; call kvlib.prepack.unpack_weights"):
        prepack_weights(tiny()).float()
    with pytest.raises(ValueError, match="cannot move to torch.float32"):
        packed.to(torch.float32)  # refused before any layer moved: the model is whole
    assert {t.dtype for t in packed.state_dict().values()} == {BF16} and torch.equal(packed(x), before)
    with pytest.raises(TypeError, match="this model has quantized or prepacked ones"):
        packed.set_batch_invariant(True)
    unpack_weights(packed).set_batch_invariant(True)  # the way back


@needs_packing
@pytest.mark.parametrize("tie", [True, False])
def test_quantizing_a_packed_model_quantizes_its_matrices(tie):
    plain = tiny(tie)
    q_packed = quantize_weights(prepack_weights(copy.deepcopy(plain)), "int8")
    q_plain = quantize_weights(copy.deepcopy(plain), "int8")
    assert not any(isinstance(m, (Linear, PackedLinear)) for m in q_packed.modules())
    assert sum(isinstance(m, Int8Linear) for m in q_packed.modules()) == 2 * 4 + 1
    x = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(q_packed(x), q_plain(x))  # the same codes: the packed bytes unpacked exactly
    assert stored_bytes(q_packed) == stored_bytes(q_plain)


@needs_packing
def test_first_layers_with_layers_generate_and_the_engine_run_packed():
    plain = tiny()
    packed = prepack_weights(copy.deepcopy(plain))
    x = torch.tensor([[1, 5, 9, 3]])
    for a, b in ((packed.first_layers(1), plain.first_layers(1)), (packed.with_layers(None), plain)):
        torch.testing.assert_close(a(x).float(), b(x).float(), rtol=0.05, atol=0.05)
    prompt = [3, 1, 4, 1, 5]
    out = kvlib.generate(packed, prompt, 6)
    engine = kvlib.Engine(packed, kvlib.PagedCache.for_model(packed, num_blocks=16, block_size=4))
    a = engine.add(prompt, max_new_tokens=6)
    assert engine.run()[a][0] == out[0, len(prompt):].tolist()  # as if it ran alone


@pytest.mark.smollm2
@needs_packing
def test_load_smollm2_packs_bf16_by_default_and_not_when_asked(no_env, monkeypatch):
    default = kvlib.load_smollm2(dtype=BF16)[0]
    plain = kvlib.load_smollm2(dtype=BF16, prepack=False)[0]
    assert is_packed(default) and not is_packed(plain) and not is_packed(kvlib.load_smollm2()[0])
    monkeypatch.setenv(prepack.ENV, "0")
    assert not is_packed(kvlib.load_smollm2(dtype=BF16)[0])
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 253, 6333]])  # (1, 7)
    with torch.no_grad():
        ref, out = plain(ids).float(), default(ids).float()
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.02 * scale)  # test_prepack's tolerance
