"""kvlib.data and kvlib.evaluate: the held-out text and the scores computed on it."""

import math

import pytest
import torch

import kvlib
from kvlib import ModelConfig, Transformer
from kvlib.data import tiny_shakespeare
from kvlib.evaluate import agreement, score

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")


def test_tiny_shakespeare_splits():
    full = tiny_shakespeare("all")
    assert len(full) == 1_115_394  # the published size of tinyshakespeare/input.txt
    assert full.startswith("First Citizen:")
    train, val = tiny_shakespeare("train"), tiny_shakespeare("val")
    assert train + val == full and len(val) == len(full) - int(0.9 * len(full))
    with pytest.raises(ValueError, match="split must be"):
        tiny_shakespeare("test")


def tiny(seed=0):
    cfg = ModelConfig(n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32, vocab_size=50, max_seq_len=64)
    m = Transformer(cfg)
    m.reset_parameters(seed=seed, std=0.3)
    return m.eval()


def test_a_model_with_uniform_predictions_has_perplexity_equal_to_the_vocabulary():
    m = tiny()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # every logit 0: p = 1/vocab for every token
    ids = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    s = score(m, ids, chunk=20)
    assert s.nll.shape == (5 * 19,)  # 5 chunks, 19 predictions each
    assert s.perplexity == pytest.approx(50, rel=1e-5)
    torch.testing.assert_close(s.nll, torch.full_like(s.nll, math.log(50)))


def test_nll_is_the_cross_entropy_of_a_plain_forward():
    m = tiny()
    ids = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(1))
    s = score(m, ids, chunk=20)
    with torch.no_grad():
        logp = torch.log_softmax(m(ids[20:][None])[0], -1)  # second chunk from an empty context
    want = -logp[torch.arange(19), ids[21:]]
    torch.testing.assert_close(s.nll[19:], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(s.greedy[19:], logp.argmax(-1)[:19])


def test_agreement():
    ids = torch.randint(0, 50, (60,), generator=torch.Generator().manual_seed(2))
    a, b = score(tiny(0), ids, 20), score(tiny(1), ids, 20)
    assert agreement(a, a) == 1.0
    assert agreement(a, b) == (a.greedy == b.greedy).float().mean().item() < 1
    with pytest.raises(ValueError, match="different positions"):
        agreement(a, score(tiny(0), ids, 30))


def test_bad_input():
    with pytest.raises(ValueError, match="chunk must be"):
        score(tiny(), [1, 2, 3], chunk=1)
    with pytest.raises(ValueError, match="at least one chunk"):
        score(tiny(), [1, 2, 3], chunk=8)
