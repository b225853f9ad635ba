"""The cache explorer: its numbers come from kvlib.memory, and its widgets follow their controls."""

import re

import pytest

from kvlib import PRESETS, memory
from kvbook.explorer import CONTEXTS, MODELS, bar_svg, cache_report, explorer, kv_head_choices

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

GiB = 2**30


def test_report_is_the_formula():
    r = cache_report("llama-2-7b", batch=32, seq_len=4096, dtype="fp16", gpu_gib=80)
    # 2 * 32 layers * 32 seqs * 32 heads * 4096 tokens * 128 dims * 2 bytes, worked by hand: 64 GiB
    assert r["cache_bytes"] == 2 * 32 * 32 * 32 * 4096 * 128 * 2 == 64 * GiB
    assert r["weight_bytes"] == memory.weight_bytes(PRESETS["llama-2-7b"], "fp16")
    # 6,738,415,616 params (Meta's count) * 2 bytes = 12.55 GiB; + 64 GiB = 76.55 GiB: fits 80, not 72
    assert r["weight_bytes"] == 6_738_415_616 * 2
    assert r["fits"] is True
    assert cache_report("llama-2-7b", batch=32, seq_len=4096, gpu_gib=72)["fits"] is False


def test_kv_heads_override_changes_cache_and_weights():
    base = cache_report("llama-2-7b", 1, 2048)
    gqa = cache_report("llama-2-7b", 1, 2048, n_kv_head=8)
    assert base["cache_bytes"] == 4 * gqa["cache_bytes"] == GiB
    # K and V projections shrink from 4096x4096 to 4096x1024 in each of 32 layers, at 2 bytes
    assert base["weight_bytes"] - gqa["weight_bytes"] == 32 * 2 * 4096 * (4096 - 1024) * 2


def test_kv_head_choices_divide_the_query_heads():
    assert kv_head_choices(PRESETS["smollm2-135m"]) == [1, 3, 9]
    assert kv_head_choices(PRESETS["llama-3-70b"]) == [1, 2, 4, 8, 16, 32, 64]


def test_bars_scale_with_bytes():
    r = cache_report("llama-3-8b", 16, 8192, gpu_gib=80)
    svg = bar_svg(r)
    widths = [float(x) for x in re.findall(r'class="kv-bar" data-bytes="\d+" x="\d+" y="\d+" width="([\d.]+)"', svg)]
    assert len(widths) == 2
    assert widths[1] / widths[0] == pytest.approx(r["cache_bytes"] / r["weight_bytes"], rel=1e-3)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"config": "gpt-5"}, ValueError, "unknown preset"),
    ({"batch": 0}, ValueError, "batch must be a positive int"),
    ({"seq_len": 2.5}, TypeError, "seq_len must be an int, got float"),
    ({"n_kv_head": 5}, ValueError, "must divide n_head=32"),
    ({"dtype": "fp12"}, ValueError, "dtype must be one of"),
    ({"gpu_gib": 0}, ValueError, "gpu_gib must be positive"),
])
def test_bad_input(kwargs, error, match):
    args = {"config": "llama-2-7b", "batch": 1, "seq_len": 128} | kwargs
    with pytest.raises(error, match=match):
        cache_report(**args)


def test_bad_config_type():
    with pytest.raises(TypeError, match="ModelConfig or a preset name"):
        cache_report(42, 1, 1)


def test_widget_follows_its_controls():
    pytest.importorskip("ipywidgets")
    panel = explorer()
    c = panel.controls
    assert "16.00 GiB" in panel.output.value  # 8 x 4096 tokens of Llama-2-7B at 0.5 MiB each
    c["batch"].value = 32
    assert "64.00 GiB" in panel.output.value
    c["model"].value = "llama-3-70b"  # the KV-head slider refills with 70B's divisors and its own default
    assert list(c["n_kv_head"].options) == kv_head_choices(PRESETS["llama-3-70b"])
    assert c["n_kv_head"].value == 8
    assert "does <b>not</b> fit" in panel.output.value  # 131 GiB of weights alone exceed 80 GiB
    c["gpu_gib"].value = 141
    c["batch"].value = 1
    assert "which fits" in panel.output.value
    c["n_kv_head"].value = 64
    c["model"].value = "smollm2-135m"
    assert c["n_kv_head"].value == 3
    r = cache_report("smollm2-135m", 1, 4096, "fp16", 3, 141)
    assert f"× {r['n_kv_head']} KV heads" in panel.output.value


def test_widget_rejects_unknown_settings():
    pytest.importorskip("ipywidgets")
    with pytest.raises(ValueError, match="model must be one of"):
        explorer(model="gpt2")
    with pytest.raises(ValueError, match="seq_len must be one of"):
        explorer(seq_len=1000)
    assert set(MODELS) <= set(PRESETS) and CONTEXTS[0] == 128


def test_report_words_and_numbers():
    """Thousands separators as the chapters print them, singular units, and theme colours."""
    from kvbook.explorer import report_html

    html = report_html(cache_report("llama-2-7b", 1, 4096, "fp8", n_kv_head=1))
    assert "2 (K and V) × 32 layers × 1 sequence × 1 KV head × 4,096 tokens × 128 dims × 1 byte =" in html
    assert "× 2 bytes =" in report_html(cache_report("llama-2-7b", 8, 131072))
    assert "131,072 tokens" in report_html(cache_report("llama-2-7b", 8, 131072))
    svg = bar_svg(cache_report("llama-2-7b", 1, 4096))
    assert "#333" not in svg and svg.count('fill="currentColor"') == 5  # legible on a dark notebook


@pytest.mark.parametrize("name", MODELS)
def test_terms_sum_to_the_cache(name):
    from kvbook.explorer import cache_terms

    c = PRESETS[name]
    for seq_len in (1, 700, 4096, 131072):
        terms = cache_terms(c, seq_len, 3, "fp16")
        assert sum(t["bytes"] for t in terms) == memory.kv_cache_bytes(c, seq_len, 3, "fp16")
        assert sum(t["layers"] for t in terms) == c.n_layer


def test_hybrid_report_has_one_term_per_kind():
    from kvbook.explorer import report_html

    r = cache_report("gemma-3-27b", 1, 131072, "bf16", gpu_gib=24)
    assert [(t["kind"], t["layers"], t["tokens"]) for t in r["terms"]] == [
        ("window(1024)", 52, 1024), ("full", 10, 131072)]
    assert r["weight_bytes"] is None and r["cache_over_weights"] is None  # Gemma: weights not counted
    assert r["fits"] == (r["cache_bytes"] <= 24 * GiB)
    html = report_html(r)
    assert ("2 (K and V) × 52 window(1024) layers × 1 sequence × 16 KV heads × 1,024 tokens × 128 dims"
            " × 2 bytes + 2 (K and V) × 10 full layers × 1 sequence × 16 KV heads × 131,072 tokens") in html
    assert "weights not counted" in html and 'aria-label="KV cache' in html
    assert html.count('class="kv-bar"') == 1  # no weights bar
    v3 = report_html(cache_report("deepseek-v3", 2, 4096))
    assert "61 latent(576) layers × 2 sequences × 4,096 tokens × 576 numbers × 2 bytes =" in v3
    from kvlib import layers as L

    cfg = PRESETS["tiny"].replace(layers=[L.full(), L.shared(0)])
    assert report_html(cache_report(cfg, 1, 8)).count("(and 0 for 1 shared layer)") == 1


def test_report_says_when_a_context_is_past_the_model():
    """The widget says what the website's explorer says (tests/test_explorers.py checks they match)."""
    from kvbook.explorer import limit_text, report_html

    r = cache_report("llama-2-7b", 1, 8192)  # Llama-2-7B was trained for 4,096 tokens
    assert r["max_seq_len"] == PRESETS["llama-2-7b"].max_seq_len == 4096
    assert limit_text(r).startswith("8,192 tokens is past Llama-2-7B's context limit of 4,096 tokens")
    assert limit_text(r) in report_html(r)
    assert limit_text(cache_report("llama-2-7b", 1, 4096)) == ""  # at the limit: nothing to say
    assert limit_text(cache_report("llama-3.1-8b", 1, 131072)) == ""


def test_mla_has_no_heads_to_choose():
    """DeepSeek-V3 caches one latent per token: its KV heads change nothing, and the widget says so."""
    from kvbook.explorer import heads_text, kv_heads_apply, report_html

    assert [m for m in MODELS if not kv_heads_apply(PRESETS[m])] == ["deepseek-v3"]
    v3 = cache_report("deepseek-v3", 1, 4096)
    assert cache_report("deepseek-v3", 1, 4096, n_kv_head=1)["cache_bytes"] == v3["cache_bytes"]
    assert "one latent of 576 numbers" in heads_text(v3) and heads_text(v3) in report_html(v3)
    assert heads_text(cache_report("llama-2-7b", 1, 4096)) == ""
    pytest.importorskip("ipywidgets")
    panel = explorer()
    heads = panel.controls["n_kv_head"]
    assert not heads.disabled
    panel.controls["model"].value = "deepseek-v3"
    assert heads.disabled and "(MLA)" in panel.output.value
    panel.controls["model"].value = "llama-3-8b"
    assert not heads.disabled and heads.value == 8
