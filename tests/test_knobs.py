"""The knobs (kvbook.knobs): each panel's controls driven in code, through the widgets' own values,
and what it shows checked against kvlib; with no widget front end a panel's text is its view."""

import re

import pytest
import torch

import kvlib
from kvlib import PRESETS, cost, memory
from kvlib import layers as L
from kvlib.evict import SinkCache, WindowCache
from kvlib.hardware import HARDWARE, step_time
from kvlib.quant import quantize, quantized_nbytes
from kvlib.speculative import expected_tokens_per_forward

pytest.importorskip("ipywidgets")

from kvbook.knobs import masks, quant, speculative, step  # noqa: E402

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


def evicting_kept(kind: L.LayerKind, n: int) -> list[int]:
    """The positions kvlib.evict's cache for a window kind keeps after n tokens, one at a time."""
    cache = WindowCache(1, kind.size) if not kind.sinks else SinkCache(1, kind.sinks, kind.size, 10_000.0)
    for _ in range(n):
        z = torch.zeros(1, 1, 1, 2)
        cache.update(z, z, 0)
    return sorted(cache.kept_positions(0)[0, 0].tolist())


# -- masks ------------------------------------------------------------------------------------------------------
def test_masks_panel_follows_its_controls():
    panel = masks.explorer(kind="window", window=4, sinks=2, n=12)
    c = panel.controls
    assert panel.report["kept"] == [0, 1, 8, 9, 10, 11]  # chapter 7.2's ring: two sinks and the last four
    assert not c["sinks"].disabled and c["chunk"].disabled
    for kind, window, sinks, chunk, n in [("window", 3, 0, 4, 9), ("window", 5, 3, 4, 20), ("chunked", 4, 0, 5, 13),
                                          ("full", 4, 0, 4, 7), ("chunked", 4, 0, 1, 3), ("window", 16, 4, 4, 32)]:
        c["kind"].value, c["window"].value, c["sinks"].value = kind, window, sinks
        c["chunk"].value, c["n"].value = chunk, n
        layer = masks.layer_kind(kind, window, sinks, chunk)
        pos = torch.arange(n)
        want = L.visible(layer, pos, pos)
        r = panel.report
        assert torch.equal(torch.tensor(r["grid"]), want), (kind, n)
        assert r["tokens_held"] == L.tokens_held(layer, n) == len(r["kept"])
        assert r["kept"] == want[-1].nonzero()[:, 0].tolist()  # the last query's keys
        if kind == "window":  # the evicting caches of chapter 10 keep the same tokens
            assert r["kept"] == evicting_kept(layer, n)
        svg = panel.output.value
        assert svg.count('class="kv-seen"') == int(want.sum()) and svg.count('class="kv-kept"') == len(r["kept"])
        assert (c["sinks"].disabled, c["chunk"].disabled) == (kind != "window", kind != "chunked")
    assert "chunked" not in str(panel) and "window(16, sinks=4)" in str(panel)


def test_masks_text_is_the_default_view():
    panel = masks.explorer(kind="window", window=4, sinks=2, n=12)
    bundle = panel._repr_mimebundle_()
    assert bundle["text/plain"] == repr(panel) == masks.mask_text(panel.report)
    lines = bundle["text/plain"].splitlines()
    assert lines[-2] == "kept ■ ■ · · · · · · ■ ■ ■ ■" and lines[-1] == "the cache holds 6 tokens: 0, 1, 8–11"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kind": "sliding"}, ValueError, "kind must be one of"),
    ({"n": 0}, ValueError, r"n must be an int in \[1, 32\], got 0"),
    ({"window": 17}, ValueError, r"window must be an int in \[1, 16\]"),
    ({"sinks": 1.5}, TypeError, "sinks must be an int"),
])
def test_masks_refuses_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        masks.explorer(**kwargs)


# -- quant ------------------------------------------------------------------------------------------------------
def kv_pair():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, 64, 64, generator=g), torch.randn(1, 3, 64, 64, generator=g)
    k[..., 7] *= 20  # an outlier channel, as SmolLM2's keys have
    return k, v


def test_quant_panel_follows_its_controls():
    k, v = kv_pair()
    cfg = PRESETS["smollm2-135m"]
    panel = quant.explorer(k, v, cfg, bits=4, group_size=64)
    c = panel.controls
    for bits, group, axis in [(2, 8, "per token"), (8, 32, "per channel"), (4, 16, "per channel"), (4, 64, "per token")]:
        c["bits"].value, c["group"].value, c["axis"].value = bits, group, axis
        chosen, dim = panel.report["chosen"], quant.AXES[axis]
        for name, t in (("keys", k), ("values", v)):
            q = quantize(t, bits, dim=dim, group_size=group)
            want = ((q.dequantize() - t).norm() / t.norm()).item()
            assert chosen[name] == pytest.approx(want, rel=1e-6), (bits, group, axis, name)
        per_number = quantized_nbytes(k.numel(), bits, group) / k.numel()  # the formula the site uses
        assert chosen["bytes_per_number"] == per_number
        assert panel.report["token_bytes"] == pytest.approx(per_number * memory.kv_bytes_per_token(cfg, 1))
        assert f"<b>{per_number:.4f}</b> bytes a number" in panel.output.value
    # 4 bits per 64 numbers: 0.5625 bytes a number, 28% of fp16's 2 (worked by hand: 0.5 + 4/64)
    c["group"].value = 64
    assert panel.report["chosen"]["bytes_per_number"] == 0.5625
    assert panel.report["token_bytes"] / panel.report["fp16_token_bytes"] == pytest.approx(0.28125)
    # per channel the outlier gets a scale of its own: the keys' error falls, as chapter 8 measures
    per_token = quant.quant_report(k, v, cfg, 4, 64, "per token")["chosen"]["keys"]
    assert quant.quant_report(k, v, cfg, 4, 64, "per channel")["chosen"]["keys"] < 0.6 * per_token


def test_quant_text_marks_the_chosen_setting():
    k, v = kv_pair()
    panel = quant.explorer(k, v, PRESETS["smollm2-135m"], bits=8, group_size=16)
    text = panel._repr_mimebundle_()["text/plain"]
    marked = [line for line in text.splitlines() if line.startswith("→")]
    assert marked == [next(line for line in text.splitlines() if "8 bits, 16:" in line)]
    assert len(text.splitlines()) == 1 + 12 + 1  # a header, 3 widths x 4 groups, the token's bytes


def test_quant_refuses_bad_settings():
    k, v = kv_pair()
    with pytest.raises(ValueError, match="group_size one of"):
        quant.explorer(k, v, PRESETS["tiny"], group_size=12)
    with pytest.raises(ValueError, match="axis must be one of"):
        quant.explorer(k, v, PRESETS["tiny"], axis="per head")
    with pytest.raises(TypeError, match=r"keys must be a \(B, H_kv, S, D\) tensor"):
        quant.explorer(k[0], v, PRESETS["tiny"])


# -- speculative ------------------------------------------------------------------------------------------------
def test_speculative_panel_follows_its_controls():
    panel = speculative.explorer(k=4, a=0.75)
    c = panel.controls
    for k, a in [(1, 0.5), (8, 0.9), (3, 0.0), (5, 1.0), (4, 0.3)]:
        c["k"].value, c["a"].value = k, a
        chosen = panel.report["chosen"]
        assert chosen["k"] == k and chosen["formula"] == expected_tokens_per_forward(k, a)
        stats = speculative.simulate(k, a)
        assert chosen["simulated"] == stats.tokens_per_forward and chosen["acceptance_rate"] == stats.acceptance_rate
        # 2,000 seeded steps: within 4 standard errors of the formula (each step makes 1 ... k + 1 tokens)
        made = torch.tensor([x + 1.0 for x in stats.accepted_per_step])
        assert abs(chosen["simulated"] - chosen["formula"]) <= 4 * made.std() / len(made) ** 0.5 + 1e-12
        assert f"<b>{chosen['formula']:.3f}</b> tokens per verify forward" in panel.output.value
    c["a"].value = 1.0  # every guess right: k + 1 tokens, and SpecStats' rate is 1
    assert [p["simulated"] for p in panel.report["curve"]] == [k + 1.0 for k in range(1, 9)]
    c["a"].value = 0.0  # none right: the target's one token
    assert all(p["simulated"] == p["formula"] == 1.0 for p in panel.report["curve"])


def test_speculative_rate_is_not_a():
    """SpecStats.acceptance_rate counts accepted over proposed: below a, as chapter 12's exercise says."""
    r = speculative.spec_report(4, 0.75)
    assert r["chosen"]["acceptance_rate"] < 0.75 - 0.1
    text = speculative.explorer(k=2, a=0.5)._repr_mimebundle_()["text/plain"]
    assert re.search(r"^→ 2: 1\.750, ", text, re.M)  # 1 + 0.5 + 0.25, worked by hand


def test_speculative_refuses_bad_settings():
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 8\]"):
        speculative.explorer(k=9)
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\]"):
        speculative.explorer(a=1.2)


# -- step -------------------------------------------------------------------------------------------------------
def test_step_panel_follows_its_controls():
    panel = step.explorer()
    c = panel.controls
    for hw, model, dtype, batch, ctx in [("h100", "llama-3-8b", "bf16", 1, 4096), ("a100", "llama-2-7b", "fp16", 64, 2048),
                                         ("h200", "llama-3-70b", "fp8", 256, 131072), ("l4", "smollm2-135m", "fp32", 8, 128)]:
        c["hardware"].value, c["model"].value, c["dtype"].value = hw, model, dtype
        c["batch"].value, c["context"].value = batch, ctx
        cfg, h = PRESETS[model], HARDWARE[hw]
        t, r = step_time(cfg, h, batch, ctx, dtype=dtype), panel.report
        assert r["seconds"] == t.total and r["memory_bound"] == t.memory_bound
        weights = cost.step_bytes(cfg, batch, ctx, dtype=dtype)["weights"]
        assert r["kv_share"] == pytest.approx((t.bytes - weights) / t.bytes, rel=1e-12)
        need = memory.weight_bytes(cfg, dtype) + memory.kv_cache_bytes(cfg, ctx, batch, dtype)
        assert r["fits"] == (need <= h.memory)
    c["hardware"].value = "t4"  # the reader's fp32 is on a T4's sheet too: kept
    assert list(c["dtype"].options) == ["fp32", "fp16"] and c["dtype"].value == "fp32"
    c["hardware"].value, c["dtype"].value = "h100", "bf16"
    c["hardware"].value = "t4"  # no bf16 on a T4: the dtype falls back to fp16, and the report follows
    assert c["dtype"].value == "fp16"
    assert panel.report["seconds"] == step_time(PRESETS["smollm2-135m"], HARDWARE["t4"], 8, 128, dtype="fp16").total


def test_step_text_is_the_default_view():
    panel = step.explorer()
    text = panel._repr_mimebundle_()["text/plain"]
    t = step_time(PRESETS["llama-3-8b"], HARDWARE["h100"], 1, 4096, dtype="bf16")
    assert text.splitlines()[1].startswith(f"step: {1e3 * t.total:.3g} ms")  # 4.64 ms: reading the weights
    assert "memory-bound" in text


def test_a_panel_prints_without_a_front_end(capsys):
    """A plain terminal: building each panel and printing it shows its view and raises nothing."""
    k, v = kv_pair()
    for p in (masks.explorer(), quant.explorer(k, v, kvlib.PRESETS["tiny"]), speculative.explorer(), step.explorer()):
        print(p)
    out = capsys.readouterr().out
    assert "VBox(" not in out and "the cache holds" in out and "tokens per forward" in out
