"""SamplingParams: one validated object behind generate, stream, generate_naive and the engine."""

import pytest
import torch

import kvlib
from kvlib import SamplingParams
from kvlib.sampling import probabilities, sampling_params

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-1), ValueError, "temperature must be a number >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a number >= 0"),
    (dict(temperature="hot"), ValueError, "temperature must be a number"),
    (dict(top_k=0), ValueError, "top_k must be a positive int"),
    (dict(top_k=2.5), ValueError, "top_k must be a positive int"),
    (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must lie in \(0, 1\]"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0, got -1"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int, got bool"),
    (dict(stop=[1, "eos"]), TypeError, "stop must be an int or an iterable of ints"),
    (dict(seed=1, generator=torch.Generator()), ValueError, "either seed or generator"),
    (dict(seed="1"), TypeError, "seed must be an int"),
    (dict(generator=42), TypeError, "generator must be a torch.Generator"),
])
def test_bad_sampling_params_are_refused_once_with_a_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple_and_params_are_frozen():
    assert SamplingParams(stop=7).stop == (7,)
    assert SamplingParams(stop=[3, 4]).stop == (3, 4)
    assert SamplingParams().stop == ()
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 1.0


def test_keywords_and_the_object_are_two_doors_to_one_thing(model):
    p = SamplingParams(max_new_tokens=6, temperature=1.2, top_k=10, top_p=0.9, seed=3)
    a = kvlib.generate(model, [1, 2, 3], sampling=p)
    b = kvlib.generate(model, [1, 2, 3], 6, temperature=1.2, top_k=10, top_p=0.9, seed=3)
    c = kvlib.generate_naive(model, [1, 2, 3], sampling=p)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert list(kvlib.stream(model, [1, 2, 3], sampling=p)) == a[0, 3:].tolist()
    # max_new_tokens given beside the object overrides it
    assert kvlib.generate(model, [1, 2, 3], 2, sampling=p).shape == (1, 5)
    with pytest.raises(ValueError, match="either sampling=SamplingParams"):
        kvlib.generate(model, [1, 2, 3], sampling=p, temperature=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        kvlib.generate(model, [1, 2, 3], 4, temprature=0.5)
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        kvlib.generate(model, [1, 2, 3])
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        sampling_params({"temperature": 1.0})


def test_the_engine_takes_the_same_params(model, device):
    prompt = [5, 6, 7, 8]
    p = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11)
    want = kvlib.generate(model, prompt, sampling=p)[0, 4:].tolist()
    eng = kvlib.Engine(model, kvlib.PagedCache.for_model(model, num_blocks=16, block_size=4, device=device))
    eng.add(prompt, sampling=p)
    assert eng.run()[0] == [want]  # the same seeded draws, through the paged engine


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.5),
])
def test_probabilities_is_the_distribution_sample_draws_from(params, device):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(device) * 3  # (B, vocab), no ties
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (6, 50)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, device=device))
    torch.testing.assert_close(probs, torch.stack([_by_hand(row, params) for row in logits]))
    for seed in range(5):  # the same draws, bit for bit, as sample's
        want = kvlib.sample(logits, params, generator=torch.Generator(device).manual_seed(seed))
        got = torch.multinomial(probs, 1, generator=torch.Generator(device).manual_seed(seed)).squeeze(-1)
        assert torch.equal(got, want)


def _by_hand(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's distribution, the slow way: the top_k most likely, then the shortest head reaching top_p."""
    z = row.double() / params.temperature
    order = sorted(range(len(row)), key=lambda i: -float(z[i]))[: params.top_k]
    mass = z[order].softmax(0).tolist()
    keep = [t for j, t in enumerate(order) if params.top_p is None or sum(mass[:j]) < params.top_p]
    out = torch.zeros(len(row), dtype=torch.float64, device=row.device)
    out[keep] = z[keep].softmax(0)
    return out.float()


def test_greedy_probabilities_are_the_one_hot_of_argmax(device):
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]], device=device)  # a tie: argmax takes the first
    probs = probabilities(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]], device=device))
    assert torch.equal(kvlib.sample(logits), logits.argmax(-1)) and torch.equal(probs.argmax(-1), logits.argmax(-1))
    # temperature 0 is the limit: at 0.05 the second row's margin of 5 becomes 100, and exp(-100) ~ 4e-44
    cold = probabilities(logits[1:], SamplingParams(temperature=0.05))
    torch.testing.assert_close(cold, probs[1:], rtol=0, atol=1e-40)
    assert probabilities(logits[0], SamplingParams(temperature=1.0)).shape == (4,)  # (vocab,) works too


def test_probabilities_refuses_bad_input(device):
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        probabilities(torch.tensor([1, 2, 3], device=device), SamplingParams())
    with pytest.raises(ValueError, match=r"logits must be \(\.\.\., vocab\) with vocab >= 1, got shape \(\)"):
        probabilities(torch.tensor(1.0, device=device), SamplingParams())
    with pytest.raises(TypeError, match="params must be a SamplingParams, got float"):
        probabilities(torch.zeros(2, 3, device=device), 1.0)
