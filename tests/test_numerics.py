"""kvlib.numerics: the five ways of running a sequence, and the drift between two of them."""

import pytest
import torch

import kvlib
from kvlib import numerics

pytestmark = pytest.mark.cpu_only("needs SmolLM2's weights (the GGUF), which the GPU machine lacks")

CFG = kvlib.ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    m = kvlib.Transformer(CFG)
    m.reset_parameters(seed=0, std=0.2)
    return m.eval()


def test_every_way_computes_the_recomputed_logits_to_rounding(model):
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    others = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = numerics.recomputed(model, ids, 5)
    assert ref.shape == (15, 50)
    for got in (numerics.cached(model, ids, 5), numerics.chunked(model, ids, 6, 5),
                numerics.batched(model, ids, others, 5), numerics.paged(model, ids, 5, block_size=4)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # fp32: a few ulps of the logits
        # and they are not wrong: a token shifted by one position would be far off
        assert not torch.allclose(got[1:], ref[:-1], atol=1e-2)


def test_drift_counts_what_it_says_on_hand_made_logits():
    ref = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.99, 0.0], [0.0, 5.0, 4.5]])
    other = ref.clone()
    other[1, 1] += 0.02  # 2.01 > 2.0: position 1's argmax flips
    d = numerics.drift(ref, other)
    assert d.positions == 3 and d.max_diff == pytest.approx(0.02)
    assert d.min_margin == pytest.approx(0.01)
    assert d.near_ties == 1  # only position 1's margin (0.01) is below 0.02
    assert d.flips == 1 and d.first_flip == 1 and not d.identical
    assert numerics.drift(ref, ref).identical and numerics.drift(ref, ref).first_flip is None
    torch.testing.assert_close(numerics.margins(ref), torch.tensor([2.0, 0.01, 0.5]))


def test_first_difference():
    assert numerics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert numerics.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert numerics.first_difference(torch.tensor([[1, 2]]), [1, 2, 9]) == 2  # a longer one parts at the end


def test_bad_input_is_named(model):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="one sequence"):
        numerics.cached(model, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="start"):
        numerics.recomputed(model, ids, 4)
    with pytest.raises(ValueError, match="others"):
        numerics.batched(model, ids, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk"):
        numerics.chunked(model, ids, 0)
    with pytest.raises(ValueError, match="one shape"):
        numerics.drift(torch.zeros(2, 3), torch.zeros(3, 3))


def test_the_bf16_record_reads_back_whole():
    r = numerics.load_bf16_record()
    assert r["inputs"] == numerics.STUDY
    assert set(r["table"]) == {"cached", "chunked", "batched", "paged"}
    for d in r["table"].values():
        assert 0 <= d.near_ties <= d.positions and 0 <= d.flips <= d.positions and d.max_diff > 0
    div = r["divergence"]
    assert len(div.cached) == len(div.naive) == numerics.STUDY["n_new"]
    assert div.first == numerics.first_difference(div.cached, div.naive)
    if div.first is not None:  # each loop's own logits chose its own token
        assert div.logits["cached"][0] > div.logits["cached"][1] and div.logits["naive"][1] > div.logits["naive"][0]


@pytest.mark.smollm2
def test_the_bf16_record_is_what_this_machine_computes():
    """The stored run is not stale: on the machine kind that made it, a fresh run gives its table and its
    cached loop's tokens exactly (the naive loop, the slow half, is left to the chapter's build)."""
    from kvlib.native import fast_dtype

    if fast_dtype() != torch.bfloat16:
        pytest.skip("this CPU has no bf16 matrix instructions: the bf16 study would take most of an hour")
    model, tok = kvlib.load_smollm2(dtype=torch.bfloat16, prepack=False)  # as numerics._record loads it
    ids, others, prompt = numerics.study_inputs(tok, model.config.vocab_size)
    st, stored = numerics.STUDY, numerics.load_bf16_record()
    table = numerics.drift_table(model, ids, st["start"], st["chunk"], others)
    tokens = kvlib.generate(model, prompt, st["n_new"])[0, len(prompt):].tolist()
    if stored["machine"] == numerics.machine():  # the same CPU, torch and thread count: the same bits
        assert table == stored["table"] and tokens == stored["divergence"].cached
    else:  # another CPU or thread count rounds bf16 its own way: the same story, other digits
        for way, d in stored["table"].items():
            if table[way].max_diff == 0:  # exact here: only if this CPU's bf16 matmul gives a row the same bits
                assert _rows_keep_their_bits(model), (way, table[way])  # whatever rows share it (an AVX-512
                continue  # EPYC at 1 thread does, so a chunked prefill is exact there; a Xeon's was not)
            assert 0.25 < table[way].max_diff / d.max_diff < 4


def _rows_keep_their_bits(model) -> bool:
    """Whether this CPU's bf16 matmul computes a row alike alone, in a chunk and among all: batch invariance."""
    w = next(p for name, p in model.named_parameters() if p.dim() == 2 and ".0." in name)  # (out, d_model)
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)  # (64, d_model)
    whole = torch.nn.functional.linear(x, w)
    return all(torch.equal(torch.nn.functional.linear(x[:k], w), whole[:k]) for k in (1, 7, 16))
