import pytest
import torch

import kvlib
from kvlib import DynamicCache, ModelConfig, StaticCache, Transformer
from kvlib.sampling import sample

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def model(device):
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=64)
    m = Transformer(cfg, device=device)
    m.reset_parameters(seed=0, std=0.2)  # sharp logits: no argmax ties
    return m.eval()


# -- sampling -------------------------------------------------------------------------------
def test_greedy_is_argmax(device):
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]], device=device)
    assert sample(logits).tolist() == [1, 0]


def test_top_k_never_leaves_the_top_k(device):
    logits = torch.arange(10.0, device=device).expand(4, 10)
    g = torch.Generator(device).manual_seed(0)
    draws = torch.stack([sample(logits, temperature=5.0, top_k=3, generator=g) for _ in range(300)])
    assert set(draws.unique().tolist()) == {7, 8, 9}  # all three reachable, nothing else


def test_top_p_keeps_the_smallest_nucleus(device):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], device=device)
    logits = probs.log()
    g = torch.Generator(device).manual_seed(0)
    draws = torch.stack([sample(logits, temperature=1.0, top_p=0.8, generator=g) for _ in range(400)])
    # 0.5 < 0.8, 0.5 + 0.3 reaches 0.8: the nucleus is {0, 1}
    assert set(draws.unique().tolist()) == {0, 1}
    draws = torch.stack([sample(logits, temperature=1.0, top_p=0.81, generator=g) for _ in range(400)])
    assert set(draws.unique().tolist()) == {0, 1, 2}


def test_sampling_frequencies_follow_the_softmax(device):
    logits = torch.tensor([[0.0, 1.0, 2.0]], device=device)
    g = torch.Generator(device).manual_seed(1)
    n = 20_000
    draws = sample(logits.expand(n, 3), temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=3).float() / n
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.015, rtol=0)  # ~4 std devs


def test_sampled_generation_is_reproducible_and_seed_dependent(model, device):
    ids = [1, 2, 3]
    run = lambda seed: kvlib.generate(model, ids, 12, temperature=1.5, top_k=20, top_p=0.9,
                                      generator=torch.Generator(device).manual_seed(seed))
    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def test_sampled_cached_equals_sampled_naive(model, device):
    kw = dict(temperature=1.0, top_k=10, top_p=0.95)
    a = kvlib.generate(model, [4, 5], 10, generator=torch.Generator(device).manual_seed(3), **kw)
    b = kvlib.generate_naive(model, [4, 5], 10, generator=torch.Generator(device).manual_seed(3), **kw)
    assert torch.equal(a, b)


# -- the public entry points ----------------------------------------------------------------
def test_generate_returns_prompt_plus_new_tokens(model, device):
    out = kvlib.generate(model, [1, 2, 3], 5)
    assert out.shape == (1, 8) and out.dtype == torch.long
    assert out[0, :3].tolist() == [1, 2, 3]
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]], device=device)
    out = kvlib.generate(model, batch, 4)
    assert out.shape == (2, 7) and torch.equal(out[:, :3], batch)


def test_batched_rows_equal_rows_alone(model, device):
    batch = torch.tensor([[1, 2, 3], [7, 8, 9]], device=device)
    both = kvlib.generate(model, batch, 6)
    for i in range(2):
        assert torch.equal(both[i], kvlib.generate(model, batch[i].tolist(), 6)[0])


def test_stream_yields_the_same_tokens_as_generate(model, device):
    out = kvlib.generate(model, [3, 1], 7)
    streamed = list(kvlib.stream(model, [3, 1], 7))
    assert all(isinstance(t, int) for t in streamed)
    assert streamed == out[0, 2:].tolist()
    rows = list(kvlib.stream(model, torch.tensor([[3, 1]], device=device), 7))
    assert all(t.shape == (1,) for t in rows)


def test_stream_yields_before_generation_finishes(model):
    it = kvlib.stream(model, [3, 1], 50)
    first = next(it)  # produced without running the remaining steps
    assert isinstance(first, int)
    assert not torch.is_inference_mode_enabled()  # the generator does not leak inference mode while suspended


def test_stop_token_ends_generation(model):
    full = kvlib.generate(model, [1, 2], 10)[0, 2:].tolist()
    stop_tok = full[3]
    first = full.index(stop_tok)
    out = kvlib.generate(model, [1, 2], 10, stop=stop_tok)
    assert out[0, 2:].tolist() == full[: first + 1]  # includes the stop token, then ends
    assert list(kvlib.stream(model, [1, 2], 10, stop=[999_999, stop_tok])) == full[: first + 1]


def test_finished_rows_are_padded_with_their_stop_token(model, device):
    batch = torch.tensor([[1, 2], [9, 9]], device=device)
    free = kvlib.generate(model, batch, 8)
    stop_tok = int(free[0, 3])  # row 0 hits it at step 1 (or earlier)
    out = kvlib.generate(model, batch, 8, stop=stop_tok)
    row0 = out[0, 2:].tolist()
    k = row0.index(stop_tok)
    assert all(t == stop_tok for t in row0[k:])
    assert row0[:k] == free[0, 2:2 + k].tolist()


def test_max_new_tokens_zero_returns_the_prompt(model):
    assert kvlib.generate(model, [1, 2], 0).tolist() == [[1, 2]]
    assert list(kvlib.stream(model, [1, 2], 0)) == []


def test_a_cache_passed_in_continues_a_conversation(model, device):
    cache = DynamicCache(model.config.n_layer)
    first = kvlib.generate(model, [1, 2, 3], 4, cache=cache)
    assert cache.seq_len == 3 + 4 - 1  # the last sampled token has not been fed yet
    last = first[:, -1:]
    second = kvlib.generate(model, torch.cat([last, torch.tensor([[5]], device=device)], 1), 3, cache=cache)
    whole = kvlib.generate_naive(model, torch.cat([first, torch.tensor([[5]], device=device)], 1), 3)
    assert torch.equal(second[:, 2:], whole[:, -3:])


# -- bad input: one test each ---------------------------------------------------------------
def test_empty_prompt(model):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        kvlib.generate(model, [], 3)


def test_prompt_token_outside_vocab(model):
    with pytest.raises(IndexError, match=r"prompt token id 50 is outside the vocabulary \[0, 50\)"):
        kvlib.generate(model, [1, 50], 3)


def test_negative_max_new_tokens(model):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        kvlib.generate(model, [1], -1)


def test_negative_temperature(model):
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        kvlib.generate(model, [1], 3, temperature=-0.5)


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_top_p_outside_unit_interval(model, top_p):
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        kvlib.generate(model, [1], 3, temperature=1.0, top_p=top_p)


def test_bad_top_k(model):
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        kvlib.generate(model, [1], 3, temperature=1.0, top_k=0)


def test_errors_come_at_call_time_for_stream(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvlib.stream(model, [1], -2)  # not deferred to the first next()


def test_too_long_for_the_model(model):
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        kvlib.generate(model, [1] * 60, 5)


def test_prompt_of_wrong_type(model, device):
    with pytest.raises(TypeError, match="list\\[int\\], a list of lists, or a LongTensor"):
        kvlib.generate(model, "hello", 3)
    with pytest.raises(TypeError, match="integer token ids"):
        kvlib.generate(model, torch.tensor([[1.0, 2.0]], device=device), 3)


def test_too_small_cache(model, device):
    with pytest.raises(IndexError, match="StaticCache overflow"):
        kvlib.generate(model, [1, 2], 5, cache=StaticCache.for_model(model, 1, 4, device=device))


def test_naive_takes_no_cache(model):
    with pytest.raises(ValueError, match="uses no cache"):
        kvlib.generate_naive(model, [1], 2, cache=DynamicCache(2))


def test_prefill_and_decode_build_no_autograd_graph(model, device):
    """A hand-written loop without no_grad must not chain a graph through the cache."""
    assert any(p.requires_grad for p in model.parameters())
    cache = StaticCache.for_model(model, 1, 8, device=device)
    logits = kvlib.prefill(model, torch.tensor([[1, 2, 3]], device=device), cache)
    logits = kvlib.decode_step(model, logits.argmax(-1), cache)
    assert not logits.requires_grad and cache.keys[0].grad_fn is None


# -- batches of different lengths -----------------------------------------------------------
def test_ragged_batch_rows_equal_rows_alone(model):
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]
    out = kvlib.generate(model, prompts, 6, pad_id=0)
    assert out.shape == (3, 5 + 6)
    for i, p in enumerate(prompts):
        alone = kvlib.generate(model, p, 6)[0]
        assert out[i, 5 - len(p):].tolist() == alone.tolist()  # left-padded, new tokens line up
        assert out[i, : 5 - len(p)].tolist() == [0] * (5 - len(p))


def test_ragged_batch_naive_equals_cached(model):
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7]]
    assert torch.equal(kvlib.generate_naive(model, prompts, 5), kvlib.generate(model, prompts, 5))


def test_hf_style_attention_mask_is_accepted(model, device):
    ids = torch.tensor([[0, 0, 4, 5], [6, 7, 8, 9]], device=device)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], device=device)
    out = kvlib.generate(model, ids, 4, attention_mask=mask, pad_id=0)
    assert out[0, 2:].tolist() == kvlib.generate(model, [4, 5], 4)[0].tolist()
    assert out[1].tolist() == kvlib.generate(model, [6, 7, 8, 9], 4)[0].tolist()


def test_right_padding_is_rejected(model, device):
    with pytest.raises(ValueError, match="padding must be on the left"):
        kvlib.generate(model, torch.tensor([[4, 5, 0]], device=device), 2,
                       attention_mask=torch.tensor([[1, 1, 0]], device=device))


def test_empty_row_in_a_ragged_batch(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        kvlib.generate(model, [[1, 2], []], 2)


def test_padded_prompts_need_an_empty_cache(model, device):
    cache = DynamicCache(model.config.n_layer)
    kvlib.generate(model, torch.tensor([[1, 2], [3, 4]], device=device), 2, cache=cache)
    with pytest.raises(ValueError, match="padded prompts need an empty cache"):
        kvlib.generate(model, [[1, 2, 3], [4]], 2, cache=cache)


def test_a_callers_cache_ends_where_stopping_exactly_would_leave_it(model):
    """generate checks for "all stopped" only now and then when it owns the cache; with the
    caller's cache it stops exactly, so the conversation can continue from the right place."""
    free = kvlib.generate(model, [1, 2, 3, 4, 5], 20)[0, 5:].tolist()
    stop_tok = free[2]
    k = free.index(stop_tok)
    cache = DynamicCache(model.config.n_layer)
    out = kvlib.generate(model, [1, 2, 3, 4, 5], 20, stop=stop_tok, cache=cache)
    assert out[0, 5:].tolist() == free[: k + 1]
    assert cache.seq_len == 5 + k  # the stop token is returned, never fed back
    assert torch.equal(kvlib.generate(model, [1, 2, 3, 4, 5], 20, stop=stop_tok), out)  # own cache: same tokens


def test_sample_with_params_uses_their_seed(device):
    logits = torch.zeros(1, 1000, device=device)
    p = kvlib.SamplingParams(temperature=1.0, seed=7)
    assert len({int(sample(logits, p)) for _ in range(5)}) == 1  # the seed fixes the draw
    g = torch.Generator(device).manual_seed(7)
    assert int(sample(logits, p, generator=g)) == int(sample(logits, p))  # an explicit generator wins
