"""A KV-cache calculator you can turn the knobs of.

``cache_report`` does the arithmetic of `kvlib.memory` for one setting and
says whether weights plus cache fit in a GPU. The cache is summed per layer, so a model whose
layers keep different things (a sliding window, a chunk, an MLA latent: `kvlib.layers`)
shows one term of the formula per kind of layer (`cache_terms`). ``bar_svg`` draws the two as
bars against that GPU's memory, as plain SVG, so the picture survives on a
static web page. ``explorer()`` wires both to ipywidgets::

    from kvbook.explorer import explorer
    explorer()            # in Jupyter or Colab: drag the sliders

Only the arithmetic lives here; nothing is allocated.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from kvlib.config import PRESETS, ModelConfig
from kvlib.layers import tokens_held
from kvlib.memory import DTYPE_BYTES, GiB, dtype_bytes, kv_cache_bytes, numbers_per_token, weight_bytes
from kvlib.validate import positive_int

if TYPE_CHECKING:
    import ipywidgets

# The cache explorer's presets: Llama-family models (weights counted) and, after them, models
# kvlib keeps the cache shapes of only (family "shapes": their weights are not counted).
MODELS = ["smollm2-135m", "llama-2-7b", "llama-3-8b", "llama-3.1-8b", "mistral-7b", "llama-3-70b",
          "gemma-3-1b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout", "deepseek-v3"]
CONTEXTS = [2**k for k in range(7, 18)]  # 128 ... 131072 tokens
GPUS_GIB = [16, 24, 40, 80, 141]  # common accelerator memory sizes


def kv_head_choices(config: ModelConfig) -> list[int]:
    """KV-head counts that divide the query heads evenly: 1 (MQA) ... n_head (MHA)."""
    return [h for h in range(1, config.n_head + 1) if config.n_head % h == 0]


def kv_heads_apply(config: ModelConfig) -> bool:
    """Whether the number of KV heads changes a model's cache: whether some layer stores keys and
    values per head. Not for MLA (DeepSeek-V3), whose every layer caches one latent per token."""
    return any(k.kind not in ("latent", "shared") for k in config.layer_kinds())


def cache_terms(config: ModelConfig, seq_len: int, batch: int = 1, dtype: str | int = "fp16") -> list[dict]:
    """The cache formula as one term per kind of layer, in the order the kinds first appear:
    ``kind`` (``"full"``, ``"window(1024)"``, ...), ``layers`` (how many), ``tokens`` (held by
    each, `kvlib.layers.tokens_held`), ``numbers`` (per token per layer,
    `kvlib.memory.numbers_per_token`) and ``bytes``. The terms' bytes sum to `kv_cache_bytes`."""
    terms: dict[str, dict] = {}
    width = dtype_bytes(dtype)
    for i, kind in enumerate(config.layer_kinds()):
        t = terms.setdefault(str(kind), {"kind": str(kind), "layers": 0, "tokens": tokens_held(kind, seq_len),
                                         "numbers": numbers_per_token(config, i), "bytes": 0})
        t["layers"] += 1
        t["bytes"] += batch * t["numbers"] * t["tokens"] * width
    return list(terms.values())


def cache_report(
    config: ModelConfig | str,
    batch: int,
    seq_len: int,
    dtype: str | int = "fp16",
    n_kv_head: int | None = None,
    gpu_gib: float = 80,
    weight_dtype: str | int = "fp16",
) -> dict:
    """Weights and cache for one setting, in bytes, and whether both fit in ``gpu_gib``.

    ``n_kv_head`` overrides the model's KV heads (the K and V projections shrink
    or grow with it, so the weights change too). The cache is stored at
    ``dtype``, the weights at ``weight_dtype``. A ``family="shapes"`` preset's weights are
    not counted (`kvlib.memory.param_count` refuses them): ``weight_bytes`` and
    ``cache_over_weights`` are None, and ``fits`` is whether the cache alone fits.
    """
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown preset {config!r}; choose from {sorted(PRESETS)}")
        config = PRESETS[config]
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a preset name, got {type(config).__name__}")
    positive_int("batch", batch)
    positive_int("seq_len", seq_len)
    if n_kv_head is not None and n_kv_head != config.n_kv_head:
        if n_kv_head not in kv_head_choices(config):
            raise ValueError(
                f"n_kv_head={n_kv_head!r} must divide n_head={config.n_head}; choose from {kv_head_choices(config)}"
            )
        config = config.replace(n_kv_head=n_kv_head)
    if not gpu_gib > 0:
        raise ValueError(f"gpu_gib must be positive, got {gpu_gib!r}")
    weights = None if config.family == "shapes" else weight_bytes(config, weight_dtype)
    cache = kv_cache_bytes(config, seq_len, batch, dtype)
    gpu = int(gpu_gib * GiB)
    return {
        "model": config.name,
        "n_layer": config.n_layer, "n_kv_head": config.n_kv_head, "head_dim": config.head_dim,
        "kv_heads_apply": kv_heads_apply(config), "max_seq_len": config.max_seq_len,
        "batch": batch, "seq_len": seq_len, "dtype_bytes": dtype_bytes(dtype),
        "terms": cache_terms(config, seq_len, batch, dtype),
        "weight_bytes": weights, "cache_bytes": cache, "gpu_bytes": gpu,
        "fits": (weights or 0) + cache <= gpu,
        "cache_over_weights": None if weights is None else cache / weights,
    }


def _size(n: float) -> str:
    """Bytes in the binary unit that reads best: 512.0 KiB, 1.00 GiB, 2.50 TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def bar_svg(report: dict, width: int = 560) -> str:
    """Two horizontal bars (weights, cache) on one scale, with the GPU's memory as a dashed line.

    Text and lines are drawn in ``currentColor``, so the picture follows a dark theme."""
    w, c, g = report["weight_bytes"], report["cache_bytes"], report["gpu_bytes"]
    left, right, row = 90, 20, 34
    scale = (width - left - right) / max(w or 0, c, g)
    bars = ([] if w is None else [("weights", w, "#0072B2")]) + [("KV cache", c, "#D55E00")]
    height = row * len(bars) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="kv-bars" width="{width}" height="{height}" '
             f'role="img" aria-label="{"" if w is None else f"weights {_size(w)}, "}KV cache {_size(c)}, GPU {_size(g)}">']
    for i, (label, n, color) in enumerate(bars):
        y = 8 + i * row
        parts.append(f'<text x="{left - 8}" y="{y + 16}" text-anchor="end" font-size="13" '
                     f'fill="currentColor">{label}</text>')
        parts.append(f'<rect class="kv-bar" data-bytes="{n}" x="{left}" y="{y}" width="{n * scale:.1f}" '
                     f'height="22" fill="{color}"/>')
        parts.append(f'<text x="{left + min(n * scale, width - left - right - 70) + 6:.1f}" y="{y + 16}" '
                     f'font-size="12" fill="currentColor">{_size(n)}</text>')
    x = left + g * scale
    parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="2" y2="{height - 22}" stroke="currentColor" '
                 f'stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="end" font-size="12" '
                 f'fill="currentColor">GPU {_size(g)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _count(n: int, word: str) -> str:
    """``n`` with thousands separators and ``word``, plural unless n is 1: 4,096 tokens, 1 byte."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def formula_text(report: dict) -> str:
    """The cache formula with this setting's numbers in it, one term per kind of layer
    (`cache_terms`); a model whose layers are all full reads as the one product."""
    r, terms = report, report["terms"]
    hybrid = [t["kind"] for t in terms] != ["full"]
    parts, shared = [], 0
    for t in terms:
        label = f"{t['kind']} layer" if hybrid else "layer"
        if t["kind"].startswith("shared"):
            shared += t["layers"]
        elif t["kind"].startswith("latent"):
            parts.append(f'{_count(t["layers"], label)} × {_count(r["batch"], "sequence")} × '
                         f'{_count(t["tokens"], "token")} × {_count(t["numbers"], "number")} × '
                         f'{_count(r["dtype_bytes"], "byte")}')
        else:
            parts.append(f'2 (K and V) × {_count(t["layers"], label)} × {_count(r["batch"], "sequence")} × '
                         f'{_count(r["n_kv_head"], "KV head")} × {_count(t["tokens"], "token")} × '
                         f'{_count(r["head_dim"], "dim")} × {_count(r["dtype_bytes"], "byte")}')
    text = " + ".join(parts)
    return text + (f" (and 0 for {_count(shared, 'shared layer')})" if shared else "")


def limit_text(report: dict) -> str:
    """A plain warning when the context is past the model's limit (its ``max_seq_len``, the
    ``max_position_embeddings`` of its config), else ``""``. The website's explorer says the same."""
    r = report
    if r["seq_len"] <= r["max_seq_len"]:
        return ""
    return (f"{r['seq_len']:,} tokens is past {r['model']}'s context limit of {r['max_seq_len']:,} tokens "
            "(the longest it was trained for): the arithmetic holds, but the model is not made to serve it.")


def heads_text(report: dict) -> str:
    """Why the KV-heads control does nothing for an MLA model (else ``""``). The website says the same."""
    latent = [t for t in report["terms"] if t["kind"].startswith("latent")]
    if report["kv_heads_apply"] or not latent:
        return ""
    return (f"{report['model']} caches one latent of {latent[0]['numbers']:,} numbers per token in each "
            "layer (MLA), not keys and values per head: its number of KV heads does not change the cache.")


def report_html(report: dict) -> str:
    """The formula with this setting's numbers in it, the verdict, and the bar chart."""
    r = report
    verdict = ("fits" if r["fits"] else "does <b>not</b> fit") + f" in {_size(r['gpu_bytes'])}"
    if r["weight_bytes"] is None:
        ratio = ""
        total = (f"<p>{escape(r['model'])}: weights not counted (kvlib keeps only its cache's shapes); "
                 f"the cache alone {verdict}.</p>")
    else:
        ratio = f", {r['cache_over_weights']:.2f}× the weights"
        both = r["weight_bytes"] + r["cache_bytes"]
        total = (f"<p>{escape(r['model'])}: weights {_size(r['weight_bytes'])} + cache = {_size(both)}, "
                 f"which {verdict}.</p>")
    notes = "".join(f"<p><i>{escape(t, quote=False)}</i></p>" for t in (limit_text(r), heads_text(r)) if t)
    return (f'<div class="kv-report">{notes}<p>{formula_text(r)} = <b>{_size(r["cache_bytes"])}</b> of cache'
            f"{ratio}.</p>{total}{bar_svg(r)}</div>")


def explorer(
    model: str = "llama-2-7b", dtype: str = "fp16", batch: int = 8, seq_len: int = 4096, gpu_gib: int = 80
) -> ipywidgets.VBox:
    """An ipywidgets panel: model, cache dtype, batch, context, KV heads and GPU in; bytes and bars out."""
    import ipywidgets as w  # imported here so kvlib itself does not need ipywidgets

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if seq_len not in CONTEXTS:
        raise ValueError(f"seq_len must be one of {CONTEXTS}, got {seq_len!r}")
    if gpu_gib not in GPUS_GIB:
        raise ValueError(f"gpu_gib must be one of {GPUS_GIB}, got {gpu_gib!r}")
    style = {"description_width": "150px"}
    m = w.Dropdown(options=[(PRESETS[k].name, k) for k in MODELS], value=model, description="model", style=style)
    dt = w.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="cache dtype", style=style)
    b = w.IntSlider(value=batch, min=1, max=256, description="batch (sequences)", style=style)
    s = w.SelectionSlider(options=CONTEXTS, value=seq_len, description="context (tokens)", style=style)
    h = w.SelectionSlider(options=kv_head_choices(PRESETS[model]), value=PRESETS[model].n_kv_head,
                          description="KV heads per layer", style=style,
                          disabled=not kv_heads_apply(PRESETS[model]))  # MLA: the report says why
    g = w.Dropdown(options=[(f"{x} GiB", x) for x in GPUS_GIB], value=gpu_gib, description="GPU memory", style=style)
    out = w.HTML()
    switching = [False]  # True while the KV-head slider is re-filled for a new model

    def on_model(change) -> None:
        cfg = PRESETS[change["new"]]
        switching[0] = True
        try:
            h.options = kv_head_choices(cfg)  # resets h.value: the refresh it triggers is skipped
            h.value = cfg.n_kv_head
            h.disabled = not kv_heads_apply(cfg)  # MLA caches a latent, not heads
        finally:
            switching[0] = False
        refresh()

    def refresh(*_) -> None:
        if switching[0]:
            return
        out.value = report_html(cache_report(m.value, b.value, s.value, dt.value, h.value, g.value))

    m.observe(on_model, names="value")
    for control in (dt, b, s, h, g):
        control.observe(refresh, names="value")
    refresh()
    panel = w.VBox([w.HBox([w.VBox([m, dt, g]), w.VBox([b, s, h])]), out])
    panel.controls = {"model": m, "dtype": dt, "batch": b, "seq_len": s, "n_kv_head": h, "gpu_gib": g}
    panel.output = out
    return panel
