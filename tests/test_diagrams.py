"""The diagrams draw what their docstrings say: counted cells, not pixels.

Each diagram tags its cells with a ``gid`` ("computed", "cached", "new", "free", ...). The
expected counts come from the idea drawn (a causal triangle has T(T+1)/2 cells; a sequence of n
tokens fills ceil(n / block_size) blocks), not from running the code.
"""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from kvbook import diagrams  # noqa: E402

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


def cells(fig: Figure, gid: str, ax: int | None = None) -> int:
    axes = fig.axes if ax is None else [fig.axes[ax]]
    return sum(isinstance(p, Rectangle) and p.get_gid() == gid for a in axes for p in a.patches)


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for a in fig.axes for t in a.texts)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("T", [1, 4, 9])
def test_attention_rows_draws_a_causal_triangle_and_one_decode_row(T):
    fig = diagrams.attention_rows(prompt_len=T)
    assert cells(fig, "computed", 0) == T * (T + 1) // 2
    assert cells(fig, "masked", 0) == T * (T - 1) // 2
    assert cells(fig, "cached", 1) == T  # the prompt's keys, read back
    assert cells(fig, "new", 1) == 1  # the one new key
    assert cells(fig, "recomputed", 1) == T * (T + 1) // 2  # what a no-cache step would redo


def test_attention_wiring_names_the_calls_a_layer_makes():
    text = texts(diagrams.attention_wiring())
    for call in ("cache.update(k, v, layer_idx)", "cache.mask(tokens)", "cache.get_seq_length()",
                 "past, past+1", "(B, H_kv, S, D)"):
        assert call in text


@pytest.mark.parametrize("layers,heads,seq,filled", [(3, 2, 8, 5), (1, 4, 6, 0), (2, 1, 3, 2)])
def test_cache_layout_fills_past_positions_and_writes_one_per_head_per_layer(layers, heads, seq, filled):
    fig = diagrams.cache_layout(layers=layers, heads=heads, seq=seq, filled=filled)
    tensors = 2 * layers  # K and V per layer
    assert cells(fig, "cached") == tensors * heads * filled
    assert cells(fig, "new") == tensors * heads
    assert cells(fig, "free") == tensors * heads * (seq - filled - 1)
    assert f"{layers} calls per step" in texts(fig)


@pytest.mark.parametrize("lengths,block_size,pool", [((10, 6), 4, 8), ((1,), 16, 2), ((5, 5, 5), 2, 9)])
def test_block_table_fills_ceil_n_over_b_blocks_and_leaves_the_rest_free(lengths, block_size, pool):
    fig = diagrams.block_table(lengths=lengths, block_size=block_size, pool_blocks=pool)
    used = sum(math.ceil(n / block_size) for n in lengths)
    # each token is drawn twice, once in its sequence's logical block and once in the pool
    assert cells(fig, "filled") == 2 * sum(lengths)
    assert cells(fig, "table") == used
    assert texts(fig).count("(free)") == pool - used


def test_block_table_follows_a_given_table():
    fig = diagrams.block_table(lengths=(6,), block_size=4, pool_blocks=3, tables=[[2, 0]])
    assert "block 1 (free)" in texts(fig)


def test_paged_loop_draws_one_step_per_table_entry():
    fig = diagrams.paged_loop(table=(5, 1, 7, 2), block_size=8)
    text = texts(fig)
    assert [f"step {i}: block {b}" in text for i, b in enumerate((5, 1, 7, 2), 1)] == [True] * 4
    assert "pool[7]" in text and "out = acc / l" in text
    assert cells(fig, "cached") == 4 and cells(fig, "free") == 8 - 4  # pool blocks 0..7


@pytest.mark.parametrize("call,error", [
    (lambda: diagrams.attention_rows(0), ValueError),
    (lambda: diagrams.attention_rows(30), ValueError),
    (lambda: diagrams.attention_rows(2.5), TypeError),
    (lambda: diagrams.cache_layout(seq=4, filled=4), ValueError),
    (lambda: diagrams.cache_layout(layers=0), ValueError),
    (lambda: diagrams.block_table(lengths=()), ValueError),
    (lambda: diagrams.block_table(lengths=(40,), block_size=4, pool_blocks=8), ValueError),
    (lambda: diagrams.block_table(lengths=(6,), block_size=4, pool_blocks=4, tables=[[1]]), ValueError),
    (lambda: diagrams.block_table(lengths=(6, 3), block_size=4, pool_blocks=4, tables=[[1, 2], [2]]),
     ValueError),
    (lambda: diagrams.paged_loop(table=()), ValueError),
    (lambda: diagrams.paged_loop(table=(1, 1)), ValueError),
])
def test_bad_sizes_are_refused_with_a_message(call, error):
    with pytest.raises(error, match=r"\S"):
        call()
