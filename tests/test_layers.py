"""kvlib.layers: the layer kinds, a model's pattern, tokens held and the mask each kind implies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PRESETS
from kvlib import layers as L

pytestmark = pytest.mark.cpu_only("pure Python: formulas, tables and simulations with no tensors on a device")


def brute_visible(kind, q, k):
    """The mask written from the definitions, one pair at a time."""
    if k > q:
        return False
    if kind.kind == "window":
        return q - k < kind.size or k < kind.sinks
    if kind.kind == "chunked":
        return k // kind.size == q // kind.size
    return True


KINDS = st.one_of(
    st.just(L.full()),
    st.builds(L.window, st.integers(1, 9), st.integers(0, 3)),
    st.builds(L.chunked, st.integers(1, 9)),
)


@settings(max_examples=60, deadline=None)
@given(kind=KINDS, past=st.integers(0, 30), T=st.integers(1, 12))
def test_visible_matches_the_definition_pair_by_pair(kind, past, T):
    q = torch.arange(past, past + T)
    k = torch.arange(past + T)
    got = L.visible(kind, q, k)
    want = torch.tensor([[brute_visible(kind, int(a), int(b)) for b in k] for a in q])
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(kind=KINDS, n=st.integers(0, 40))
def test_tokens_held_is_what_the_last_query_of_the_text_sees(kind, n):
    """After n tokens a layer holds the keys the last query (position n - 1) attended to, its own
    included: for a window and a chunk that is tokens_held, counted here pair by pair."""
    seen = [k for k in range(n) if brute_visible(kind, n - 1, k)]
    assert L.tokens_held(kind, n) == len(seen)


def test_special_kinds_hold_what_they_say():
    assert L.tokens_held(L.shared(0), 100) == 0
    assert L.tokens_held(L.latent(576), 100) == 100
    assert L.tokens_held(L.window(8, sinks=4), 10) == 10
    assert L.tokens_held(L.window(8, sinks=4), 100) == 12


def test_repeat_builds_a_gemma_style_pattern():
    pattern = L.repeat([L.window(512)] * 5 + [L.full()], 26)
    assert len(pattern) == 26
    assert [i for i, k in enumerate(pattern) if k.kind == "full"] == [5, 11, 17, 23]
    assert str(pattern[0]) == "window(512)" and str(L.window(8, 4)) == "window(8, sinks=4)"


def test_a_config_carries_its_pattern_and_cuts_it_with_n_layer():
    tiny = PRESETS["tiny"]
    assert tiny.layers is None and not tiny.hybrid and [k.kind for k in tiny.layer_kinds()] == ["full"] * 2
    cfg = tiny.replace(layers=[L.window(4), L.shared(0)])
    assert cfg.hybrid and isinstance(cfg.layers, tuple)
    assert cfg.replace(n_layer=1).layers == (L.window(4),)
    assert cfg.to_dict()["layers"] == ["window(4)", "shared(0)"]


@pytest.mark.parametrize("bad, err, words", [
    (lambda: L.window(0), ValueError, "size"),
    (lambda: L.window(4, sinks=-1), ValueError, "sinks"),
    (lambda: L.LayerKind("ring"), ValueError, "kind"),
    (lambda: L.LayerKind("full", sinks=2), ValueError, "sinks"),
    (lambda: L.LayerKind("window", 4.0), TypeError, "size"),
    (lambda: L.shared(-1), ValueError, "source"),
    (lambda: L.repeat([], 4), ValueError, "at least one"),
    (lambda: PRESETS["tiny"].replace(layers=[L.full()]), ValueError, "1 layers for a model of 2"),
    (lambda: PRESETS["tiny"].replace(layers=[L.shared(1), L.full()]), ValueError, "earlier layer"),
    (lambda: PRESETS["tiny"].replace(n_layer=3, layers=[L.full(), L.shared(0), L.shared(1)]),
     ValueError, "itself shared"),
    (lambda: PRESETS["tiny"].replace(layers=["full", "full"]), TypeError, "LayerKind"),
    (lambda: L.visible(L.shared(0), torch.arange(2), torch.arange(2)), ValueError, "source"),
])
def test_bad_input_is_named(bad, err, words):
    with pytest.raises(err, match=words):
        bad()
