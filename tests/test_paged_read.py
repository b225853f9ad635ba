"""kvbench.paged_read: each way of reading paged keys equals attention over each sequence's own
contiguous keys, and the bytes each copies, counted here independently of the bench's own count."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.paged_read import (ATOL, CANDIDATES, batched_loop_path, decode_rows, flex_path, gather_path,
                                loop_path, paged_read_candidates)
from kvlib.config import ModelConfig

pytestmark = pytest.mark.cpu_only("kvbench's CPU bench section: its candidates build CPU tensors")

# 4 query heads sharing 2 KV heads (GQA, as SmolLM2's 9 and 3), head_dim 16
CFG = ModelConfig(vocab_size=64, d_model=64, n_layer=1, n_head=4, n_kv_head=2, d_ff=128, max_seq_len=128)
EAGER = {"gather": gather_path, "loop": loop_path, "batched loop": batched_loop_path}


def contiguous_reference(rows: dict) -> torch.Tensor:
    """``(B, H, D)``: each sequence's blocks concatenated in table order, cut to its length, then SDPA."""
    out = []
    for q, table, n in zip(rows["q"], rows["tables"], rows["lengths"]):
        k = torch.cat([rows["k_pool"][b] for b in table])[:n].transpose(0, 1)[None]  # (1, H_kv, n, D)
        v = torch.cat([rows["v_pool"][b] for b in table])[:n].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def run(path, rows: dict) -> torch.Tensor:
    setup, attn, _ = path(rows)
    return attn(setup())


class CopyCounter(TorchDispatchMode):
    """Bytes written by copying ops (index_select, index, clone, cat, ...) that read the pools' storage."""

    COPIES = {"index_select", "index", "clone", "cat", "stack", "gather", "_to_copy", "copy_", "contiguous"}

    def __init__(self, *pools):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in pools}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        reads_pool = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages
                         for a in (args[0] if name in ("cat", "stack") else args[:1]))
        if name in self.COPIES and reads_pool:
            self.bytes += out.nbytes
        return out


lengths_st = st.lists(st.integers(1, 70), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, block_size=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**16))
def test_eager_candidates_equal_attention_over_contiguous_keys(lengths, block_size, seed):
    rows = decode_rows(CFG, lengths, block_size, seed)
    ref = contiguous_reference(rows)
    for name, path in EAGER.items():
        torch.testing.assert_close(run(path, rows), ref, rtol=0, atol=ATOL, msg=name)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, block_size=st.sampled_from([1, 2, 4, 8, 16]))
def test_bytes_copied_recounted(lengths, block_size):
    """The bench's count against a formula and against every copy the candidate makes of pool data."""
    rows = decode_rows(CFG, lengths, block_size)
    per_token = 2 * CFG.n_kv_head * CFG.head_dim * 4  # K and V of one token in fp32
    B, longest = len(lengths), max(lengths)
    formula = {"gather": B * longest * per_token,  # every sequence padded to the longest (new key included)
               "loop": 0, "batched loop": B * math.ceil(longest / block_size) * block_size * per_token}
    for name, path in EAGER.items():
        setup, attn, nbytes = path(rows)
        s = setup()
        with CopyCounter(rows["k_pool"], rows["v_pool"]) as counter:
            attn(s)
        assert nbytes(s) == formula[name] == counter.bytes, name


def test_an_off_by_one_page_table_is_caught():
    """The mutant: every table entry one block later. Each candidate then reads the wrong keys, and
    the comparison against the contiguous reference fails for every one of them."""
    rows = decode_rows(CFG, [20, 33, 7], 4, seed=1)
    ref = contiguous_reference(rows)
    n_blocks = rows["k_pool"].shape[0]
    mutant = {**rows, "tables": [[(b + 1) % n_blocks for b in t] for t in rows["tables"]]}
    for name, path in EAGER.items():
        assert (run(path, mutant) - ref).abs().max() > 100 * ATOL, name


def test_bench_rows_at_quick_size():
    r = paged_read_candidates(CFG, batch=3, lengths=[5, 40, 17], block_size=8, repeats=2, flex=False)
    assert set(r["candidates"]) == set(CANDIDATES) - {"flex (compiled)"}
    for name, c in r["candidates"].items():
        assert c["ok"] and c["max_abs_err"] <= ATOL and c["ms_per_layer"] > 0, name
    assert r["candidates"]["gather (kvlib varlen)"]["bytes_copied"] == 3 * 40 * 2 * 2 * 16 * 4
    assert r["candidates"]["block loop (per sequence)"]["bytes_copied"] == 0


def test_flex_reads_through_the_page_table_and_does_not_recompile_next_step():
    """One compiled case (a few seconds): equal to the reference now and one token later, no recompile."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    r = paged_read_candidates(CFG, batch=3, lengths=[15, 16, 31], block_size=16, repeats=1)
    flex = r["candidates"]["flex (compiled)"]
    assert flex["ok"] and flex["next_step_max_abs_err"] <= ATOL, flex  # 16 -> 17 and 31 -> 32 take a new block
    assert flex["recompiles_on_next_step"] == 0 and flex["bytes_copied"] == 0
    rows = decode_rows(CFG, [15, 16, 31], 16)
    torch.testing.assert_close(run(flex_path, rows), contiguous_reference(rows), rtol=0, atol=ATOL)
