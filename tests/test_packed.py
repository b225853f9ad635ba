"""kvlib.packed: packed (varlen) batches against per-sequence attention and per-sequence generation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.packed import (PackedBatch, cu_seqlens, pack, packed_attention, packed_mask,
                          packed_positions, segment_lengths)

pytestmark = pytest.mark.device

TOL = dict(rtol=1e-5, atol=1e-5)


def one_sequence(q, k, v):
    """Textbook attention of one sequence, (T, H, D) layout, KV heads repeated by hand.

    The queries are the last ``Tq`` of the ``Tk`` tokens: query j sits at position Tk - Tq + j.
    """
    Tq, H, D = q.shape
    Tk, H_kv, _ = k.shape
    k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # (H, Tq, Tk)
    future = torch.arange(Tk, device=q.device)[None, :] > torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
    s = s.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)  # (Tq, H, D)


segments = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(seg=segments, H_kv=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]), seed=st.integers(0, 999),
       impl=st.sampled_from(["sdpa", "reference"]))
def test_packed_attention_equals_each_sequence_alone(seg, H_kv, G, seed, impl, device):
    """seg: (queries, cached keys before them) per sequence; prefill when every cached count is 0."""
    g = torch.Generator().manual_seed(seed)
    lq = [a for a, _ in seg]
    lk = [a + b for a, b in seg]
    D, H = 8, H_kv * G
    q = torch.randn(sum(lq), H, D, generator=g).to(device)
    k, v = torch.randn(sum(lk), H_kv, D, generator=g).to(device), torch.randn(sum(lk), H_kv, D, generator=g).to(device)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    got = packed_attention(q, k, v, cq, ck, impl=impl)
    for i in range(len(seg)):
        want = one_sequence(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]])
        torch.testing.assert_close(got[cq[i]:cq[i + 1]], want, **TOL)
    # the same result from dense attention over the whole row with the block-diagonal mask
    dense = kvlib.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            packed_mask(cq, ck)[None, None])[0].transpose(0, 1)  # (N_q, H, D)
    torch.testing.assert_close(got, dense, **TOL)


@settings(max_examples=40, deadline=None)
@given(seg=segments)
def test_packed_mask_is_block_diagonal_and_causal(seg):
    lq, lk = [a for a, _ in seg], [a + b for a, b in seg]
    mask = packed_mask(cu_seqlens(lq), cu_seqlens(lk))
    owner_q = [i for i, n in enumerate(lq) for _ in range(n)]  # the sequence of every query slot
    owner_k = [i for i, n in enumerate(lk) for _ in range(n)]
    pos_q = [lk[i] - lq[i] + j for i, n in enumerate(lq) for j in range(n)]  # position in its sequence
    pos_k = [j for n in lk for j in range(n)]
    for a in range(sum(lq)):
        for b in range(sum(lk)):
            assert bool(mask[a, b]) == (owner_q[a] == owner_k[b] and pos_k[b] <= pos_q[a])


def test_cu_seqlens_pack_and_positions():
    assert cu_seqlens([3, 5, 2]).tolist() == [0, 3, 8, 10]
    assert cu_seqlens([3, 5, 2]).dtype == torch.int32  # FlashAttention's dtype
    rows = [[7, 8, 9], [1, 2, 3, 4, 5], [6, 6]]
    ids, cu = pack(rows)
    assert [ids[cu[i]:cu[i + 1]].tolist() for i in range(3)] == rows
    assert packed_positions(cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert packed_positions(cu_seqlens([1, 1]), start=[4, 9]).tolist() == [4, 9]
    assert segment_lengths(cu, total=10) == [3, 5, 2]


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([1, 3, 5]), "must start at 0"),
    (torch.tensor([0]), "at least one segment"),
    (torch.tensor([0, 4, 4, 6]), "strictly increase"),
    (torch.tensor([0, 5, 3]), "strictly increase"),
    (torch.tensor([0, 2, 7]), "cu_seqlens_q ends at 7 .* q has 6 tokens"),
])
def test_bad_cu_seqlens_are_value_errors(cu, match, device):
    q = torch.randn(6, 2, 4, device=device)
    with pytest.raises(ValueError, match=match):
        packed_attention(q, q, q, cu)


def test_other_bad_input(device):
    q = torch.randn(6, 2, 4, device=device)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        packed_attention(q, q, q, torch.tensor([0.0, 6.0], device=device))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        packed_mask([0, 6])
    with pytest.raises(ValueError, match=r"sequences \[1\] have more queries than keys"):
        packed_mask(cu_seqlens([2, 3]), cu_seqlens([2, 2]))
    with pytest.raises(ValueError, match="2 sequences but cu_seqlens_k has 1"):
        packed_mask(cu_seqlens([2, 3]), cu_seqlens([5]))
    with pytest.raises(ValueError, match="q has 6 tokens"):
        packed_attention(q, q, q, cu_seqlens([2, 3]))
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        packed_attention(q[None], q[None], q[None], cu_seqlens([6]))
    with pytest.raises(ValueError, match="at least one token"):
        cu_seqlens([3, 0])
    with pytest.raises(TypeError, match="non-empty list"):
        pack([])


def tiny_model(device="cpu"):
    cfg = kvlib.ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50,
                            max_seq_len=64)
    model = kvlib.Transformer(cfg, device=device)
    model.reset_parameters(seed=0, std=0.3)  # sharp logits: a leak between sequences would show
    return model.eval()


@pytest.mark.parametrize("kernel", ["dense mask", "varlen"])
def test_a_packed_batch_generates_what_each_prompt_generates_alone(kernel, device):
    model = tiny_model(device)
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]
    n_new = 5
    with torch.inference_mode():
        alone = [kvlib.generate(model, r, n_new)[0, len(r):] for r in rows]
        alone_logits = [model(torch.tensor([r], device=device))[0] for r in rows]  # (T, vocab) each
    ids, cu = pack(rows)
    batch = PackedBatch(2, [len(r) for r in rows])
    if kernel == "varlen":  # the model's hook sees (1, H, N, D); the varlen layout is (N, H, D)
        def varlen(q, k, v, mask):
            out = packed_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                   batch.cu_seqlens_q, batch.cu_seqlens_k)
            return out.transpose(0, 1)[None]
        model.set_attention_impl(varlen)
    with torch.inference_mode():
        logits = model(ids[None], batch)  # (1, N, vocab)
        for i, r in enumerate(rows):  # every token's logits, not only the last
            torch.testing.assert_close(logits[0, cu[i]:cu[i + 1]], alone_logits[i], **TOL)
        nxt = logits[0, cu[1:] - 1].argmax(-1)  # (B,): each sequence's last token
        new = [nxt]
        for _ in range(n_new - 1):
            nxt = model(nxt[None], batch)[0].argmax(-1)  # one token per sequence
            new.append(nxt)
    out = torch.stack(new, dim=1)
    for i in range(len(rows)):
        assert torch.equal(out[i], alone[i]), f"row {i}"
    held = sum(len(r) for r in rows) + len(rows) * (n_new - 1)  # no pad anywhere
    assert batch.seq_len == held and batch.lengths == [len(r) + n_new - 1 for r in rows]
    cfg = model.config
    assert batch.nbytes == 2 * cfg.n_layer * cfg.n_kv_head * held * cfg.head_dim * 4


def test_a_packed_batch_rejects_a_step_of_the_wrong_size(device):
    model = tiny_model(device)
    batch = PackedBatch(2, [3, 2])
    with pytest.raises(ValueError, match=r"takes \(1, 5\) tokens \(\[3, 2\] per sequence\)"):
        model(torch.tensor([[1, 2, 3, 4]], device=device), batch)
    model(torch.tensor([[1, 2, 3, 4, 5]], device=device), batch)
    with pytest.raises(ValueError, match=r"takes \(1, 2\) tokens \(\[1, 1\] per sequence\)"):
        model(torch.tensor([[1, 2, 3]], device=device), batch)
    with pytest.raises(NotImplementedError, match="one length per sequence"):
        batch.crop(2)
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch(2, [3, 0])
