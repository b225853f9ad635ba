"""kvlib.padding: padded batches, position ids and where each row's next token is read."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from devices import tol
import kvlib
from kvlib.padding import last_index, pad, position_ids

pytestmark = pytest.mark.device

rows_strategy = st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=7), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, side=st.sampled_from(["left", "right"]))
def test_pad_keeps_every_row_and_marks_the_pads(rows, side, device):
    ids, valid = pad(rows, pad_id=0, side=side, device=device)
    T = max(map(len, rows))
    assert ids.shape == valid.shape == (len(rows), T)
    for i, r in enumerate(rows):
        assert ids[i][valid[i]].tolist() == r  # the real tokens, in order
        assert (ids[i][~valid[i]] == 0).all()
        assert int(valid[i].sum()) == len(r)
        if side == "left":
            assert valid[i, T - len(r):].all()
        else:
            assert valid[i, : len(r)].all()


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, side=st.sampled_from(["left", "right"]))
def test_positions_count_real_tokens_and_last_index_finds_the_last_one(rows, side, device):
    _, valid = pad(rows, side=side, device=device)
    pos, last = position_ids(valid), last_index(valid)
    for i, r in enumerate(rows):
        assert pos[i][valid[i]].tolist() == list(range(len(r)))  # each prompt starts at position 0
        assert bool(valid[i, last[i]]) and not valid[i, last[i] + 1:].any()
        assert int(pos[i, last[i]]) == len(r) - 1


def test_no_padding_positions_are_arange_and_last_is_the_last_column(device):
    valid = torch.ones(3, 6, dtype=torch.bool, device=device)
    assert torch.equal(position_ids(valid), torch.arange(6, device=device).expand(3, 6))
    assert last_index(valid).tolist() == [5, 5, 5]


def test_left_and_right_padding_give_the_same_next_token_logits(device):
    """Side does not matter once masks, positions and the read-out column are right."""
    torch.manual_seed(0)
    cfg = kvlib.PRESETS["tiny"]
    model = kvlib.Transformer(cfg, device=device).eval()
    model.reset_parameters(seed=0, std=0.2)  # sharp logits: differences would show
    rows = [[5, 9, 2, 7, 1], [3, 8], [4, 4, 6]]
    out = {}
    for side in ("left", "right"):
        ids, valid = pad(rows, side=side, device=device)
        logits = model(ids, positions=position_ids(valid), key_valid=valid)  # (B, T, vocab)
        out[side] = logits[torch.arange(len(rows), device=device), last_index(valid)]
    alone = torch.cat([model(torch.tensor([r], device=device))[:, -1] for r in rows])
    torch.testing.assert_close(out["left"], alone, **tol(device, rtol=0, atol=1e-5))
    torch.testing.assert_close(out["right"], alone, **tol(device, rtol=0, atol=1e-5))


def test_bad_input(device):
    with pytest.raises(ValueError, match="side must be"):
        pad([[1]], side="middle")
    with pytest.raises(ValueError, match="row 1 is empty"):
        pad([[1], []])
    with pytest.raises(TypeError, match="non-empty list"):
        pad([])
    with pytest.raises(TypeError, match="only int"):
        pad([[1, 2.0]])
    with pytest.raises(TypeError, match="bool tensor"):
        position_ids(torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        last_index(torch.tensor([[True], [False]], device=device))


def test_a_padded_batch_supplies_positions_and_mask_so_the_model_needs_no_arguments(device):
    """model(ids, PaddedBatch(cache, valid)) and every later step give each row the logits it gets
    alone, T > 1 and T = 1, with no positions= or key_valid= passed."""
    cfg = kvlib.ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=64)
    model = kvlib.Transformer(cfg, device=device)
    model.reset_parameters(seed=0, std=0.2)
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    ids, valid = pad(rows, pad_id=0, side="left", device=device)
    batch = kvlib.PaddedBatch(kvlib.DynamicCache(2), valid)
    alone = [kvlib.DynamicCache(2) for _ in rows]
    with torch.inference_mode():
        got = model(ids, batch)[:, -1]
        for i, r in enumerate(rows):
            want = model(torch.tensor([r], device=device), alone[i])[0, -1]
            torch.testing.assert_close(got[i], want, **tol(device, rtol=1e-5, atol=1e-5))
        for new in ([[1], [2], [3]], [[4, 5], [6, 7], [8, 9]]):  # a decode step, then two tokens each
            new = torch.tensor(new, device=device)
            got = model(new, batch)
            for i in range(len(rows)):
                want = model(new[i:i + 1], alone[i])[0]
                torch.testing.assert_close(got[i], want, **tol(device, rtol=1e-5, atol=1e-5))
    assert batch.positions(torch.zeros(3, 1, dtype=torch.long, device=device)).tolist() == [[8], [5], [6]]


def test_bad_padded_batches(device):
    valid = torch.tensor([[False, True], [True, True]], device=device)
    with pytest.raises(TypeError, match="wraps a kvlib Cache"):
        kvlib.PaddedBatch(object(), valid)
    with pytest.raises(TypeError, match="valid must be a"):
        kvlib.PaddedBatch(kvlib.DynamicCache(1), valid.long())
    with pytest.raises(ValueError, match=r"rows \[0\] have no real token"):
        kvlib.PaddedBatch(kvlib.DynamicCache(1), torch.tensor([[False, False], [True, True]], device=device))
    full = kvlib.DynamicCache(1)
    full.update(torch.zeros(2, 1, 3, 4, device=device), torch.zeros(2, 1, 3, 4, device=device), 0)
    with pytest.raises(ValueError, match="need an empty cache; this one already holds 3"):
        kvlib.PaddedBatch(full, valid)


def test_a_padded_batch_refuses_to_crop_into_its_prompt(device):
    valid = torch.tensor([[False, True, True], [True, True, True]], device=device)
    inner = kvlib.DynamicCache(1)
    batch = kvlib.PaddedBatch(inner, valid)
    batch.update(torch.zeros(2, 1, 4, 2, device=device), torch.zeros(2, 1, 4, 2, device=device), 0)
    batch.crop(3)  # back to the prompt: fine
    assert inner.seq_len == 3
    with pytest.raises(ValueError, match="cannot crop into the padded prompt of 3 tokens"):
        batch.crop(2)
