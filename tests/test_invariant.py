"""Batch-invariant mode: a sequence's logits are the same bits however it is run.

The reference is the sequence alone, recomputed in one forward. Hypothesis draws the
rest: how many other sequences run beside it and how long they are, whether they pad
it (left padding) or share a packed row with it (a paged step), and how its tokens are
split into prefill chunks and decode steps. Every way must give ``torch.equal`` logits.
(Shown failing: with the mode off, or with `invariant.attention` summing the keys with
``torch.sum``, or `invariant.linear` as one ``x @ weight``, these tests fail.)
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib import invariant, numerics
from kvlib.padding import pad, position_ids

pytestmark = pytest.mark.device

VOCAB = 61
CFG = kvlib.ModelConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96, max_seq_len=128)


@pytest.fixture(scope="module")
def model(device):
    m = kvlib.Transformer(CFG, device=device)
    m.reset_parameters(seed=3, std=0.2)
    m.eval().set_batch_invariant(True)
    return m


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def split(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    """``[0, n)`` cut at the sorted distinct ``cuts`` (each in 1..n-1): the chunks a sequence is fed in."""
    edges = [0] + sorted({c for c in cuts if 0 < c < n}) + [n]
    return list(zip(edges, edges[1:]))


seq_len = st.integers(1, 20)
others = st.lists(st.integers(1, 20), max_size=3)
cuts = st.lists(st.integers(1, 19), max_size=6)


@torch.inference_mode()
@given(n=seq_len, other_lens=others, seed=st.integers(0, 10**6))
def test_alone_or_left_padded_in_a_batch_the_same_bits(model, n, other_lens, seed, device):
    ids = tokens(seed, n)
    alone = model(torch.tensor([ids], device=device))[0]  # (n, vocab)
    rows = [tokens(seed + 1 + i, m) for i, m in enumerate(other_lens)]
    at = len(rows) // 2  # somewhere in the middle of the batch
    batch, valid = pad(rows[:at] + [ids] + rows[at:])
    out = model(batch, positions=position_ids(valid), key_valid=valid)  # (B, T, vocab)
    assert torch.equal(out[at, batch.shape[1] - n:], alone)


@torch.inference_mode()
@given(n=seq_len, chunk_cuts=cuts, seed=st.integers(0, 10**6))
def test_cached_in_any_chunks_the_same_bits_as_recomputed(model, n, chunk_cuts, seed, device):
    ids = torch.tensor([tokens(seed, n)], device=device)
    alone = model(ids)[0]
    cache = kvlib.DynamicCache(CFG.n_layer)
    fed = torch.cat([model(ids[:, lo:hi], cache)[0] for lo, hi in split(n, chunk_cuts)])
    assert torch.equal(fed, alone)


@torch.inference_mode()
@given(n=seq_len, chunk_cuts=cuts, other_lens=others, seed=st.integers(0, 10**6))
def test_in_packed_paged_steps_beside_others_the_same_bits(model, n, chunk_cuts, other_lens, seed, device):
    """The serving engine's step: the sequence's chunks share one packed row with other sequences' chunks."""
    ids = tokens(seed, n)
    alone = model(torch.tensor([ids], device=device))[0]
    rows = [tokens(seed + 1 + i, m) for i, m in enumerate(other_lens)]
    cache = kvlib.PagedCache.for_model(CFG, num_blocks=64, block_size=4, device=device)
    sids = [cache.add()[0] for _ in range(len(rows) + 1)]  # sids[0]: ours
    plans = [split(n, chunk_cuts)] + [split(len(r), [c + i for c in chunk_cuts]) for i, r in enumerate(rows, 1)]
    texts = [ids] + rows
    got = []
    for step in range(max(len(p) for p in plans)):
        live = [i for i, p in enumerate(plans) if step < len(p)]
        chunks = [texts[i][slice(*plans[i][step])] for i in live]
        with cache.step([sids[i] for i in live], chunks, packed=True) as batch:
            logits = model(torch.tensor([sum(chunks, [])], device=device), batch)[0]  # (N, vocab)
        if live[0] == 0:
            got.append(logits[: len(chunks[0])])  # ours come first in the row
    assert torch.equal(torch.cat(got), alone)


@torch.inference_mode()
def test_the_numerics_ways_agree_bit_for_bit_in_the_mode_and_not_only_by_luck(model, device):
    ids = torch.tensor([tokens(7, 24)], device=device)
    others = torch.tensor([tokens(8, 24), tokens(9, 24)], device=device)
    ref = numerics.recomputed(model, ids, 4)
    for got in (numerics.cached(model, ids, 4), numerics.chunked(model, ids, 5, 4),
                numerics.batched(model, ids, others, 4), numerics.paged(model, ids, 4, block_size=8)):
        assert numerics.drift(ref, got).identical
        assert torch.equal(ref, got)


def test_the_mode_changes_the_kernels_and_off_restores_them(device):
    m = kvlib.Transformer(CFG, device=device)
    m.reset_parameters(seed=3, std=0.2)
    ids = torch.tensor([tokens(1, 12)], device=device)
    with torch.inference_mode():
        fast = m(ids)
        m.set_batch_invariant(True)
        assert m.batch_invariant and m.first_layers(1).batch_invariant
        slow = m(ids)
        m.set_batch_invariant(False)
        assert not m.batch_invariant
        assert torch.equal(m(ids), fast)  # the default kernels again
    torch.testing.assert_close(slow, fast, rtol=1e-4, atol=1e-4)  # the same function, another order


def test_the_pieces_against_torch(device):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, 40, generator=g).to(device), torch.randn(40, 24, generator=g).to(device)
    torch.testing.assert_close(invariant.linear(x, w), x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invariant.fixed_sum(x, block=8), x.sum(-1), rtol=1e-5, atol=1e-5)
    # silu's scalar tail differs from its SIMD body on some CPUs (the build machine's, for this y at sizes 35+):
    # an element's bits must not depend on the size of the tensor it sits in
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(device)
    for fn in (torch.exp, torch.nn.functional.silu):
        whole = invariant.elementwise(fn, y)
        assert all(torch.equal(whole[:n], invariant.elementwise(fn, y[:n])) for n in range(1, 64))
        torch.testing.assert_close(invariant.elementwise(fn, y), fn(y), rtol=1e-6, atol=1e-6)
    q = torch.randn(2, 4, 6, 8, generator=g).to(device)
    k, v = torch.randn(2, 2, 9, 8, generator=g).to(device), torch.randn(2, 2, 9, 8, generator=g).to(device)
    mask = kvlib.causal_mask(6, 9)[None, None]
    torch.testing.assert_close(invariant.attention(q, k, v, mask), kvlib.attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_quantized_weights_are_refused(device):
    from kvlib.wquant import quantize_weights

    m = kvlib.Transformer(CFG, device=device)
    m.reset_parameters(seed=0, std=0.2)
    quantize_weights(m)
    with pytest.raises(TypeError, match="quantized"):
        m.set_batch_invariant(True)
    with pytest.raises(TypeError, match="bool"):
        kvlib.Transformer(CFG, device=device).set_batch_invariant("yes")


@torch.inference_mode()
def test_greedy_speculation_in_the_mode_is_generate_at_every_step(model):
    """A verify forward over k + 1 tokens gives the bits of k + 1 decode steps: no near tie can split them."""
    from kvlib.speculative import EarlyExitDraft, speculative_generate

    prompt = tokens(5, 9)
    want = kvlib.generate(model, prompt, 24)
    got, stats = speculative_generate(model, prompt, 24, EarlyExitDraft(model, 1), k=3)
    assert torch.equal(got, want) and stats.steps < 23  # some guesses were kept


# -- who owns the switch and RoPE's table (issue 45) ---------------------------------------------------
def _relative_imports(path) -> set[str]:
    """The kvlib modules a source file imports (type-checking-only imports included)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            found |= {node.module} if node.module else {a.name for a in node.names}
    return found


def test_the_model_owns_the_switch_and_rope_is_a_leaf():
    """0.4: kvlib.invariant.switch wrote the model's private `_rope_table`, and imported the model for a
    type hint (a cycle); first_layers, with_layers and the tensor-parallel shard wrote it too."""
    from pathlib import Path

    root = Path(kvlib.__file__).parent
    assert "model" not in _relative_imports(root / "invariant.py")  # no cycle: the kernels know no model
    assert _relative_imports(root / "rope.py") == set()  # a leaf: torch only
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "_rope_table =" in p.read_text(encoding="utf-8"))
    assert writers == ["model.py"], writers
    from kvlib.model import apply_rope, rope_cos_sin  # the old home still works

    assert apply_rope is kvlib.rope.apply_rope and rope_cos_sin is kvlib.rope.rope_cos_sin


def test_the_table_is_every_position_of_rope_cos_sin(device):
    m = kvlib.Transformer(CFG, device=device)
    m.set_batch_invariant(True)
    cos, sin = kvlib.rope.rope_table(CFG.max_seq_len, CFG.head_dim, CFG.rope_base)
    want = kvlib.rope.rope_cos_sin(torch.arange(CFG.max_seq_len, device=device)[None], CFG.head_dim, CFG.rope_base)
    assert torch.equal(cos, want[0][0]) and torch.equal(sin, want[1][0])
    small = m.first_layers(1)
    assert small.batch_invariant and small.with_layers(None).batch_invariant
    with pytest.raises(ValueError, match="RoPE tables differ"):
        kvlib.Transformer(CFG.replace(rope_base=500.0), device="meta").use_rope_table_of(m)
    with pytest.raises(ValueError, match="max_seq_len"):
        kvlib.rope.rope_table(0, 8, 10000.0)
