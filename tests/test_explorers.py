"""The website's live explorers (js/explorers.js) against kvlib itself, in headless Chromium.

Each explorer is set to a grid of settings through its labelled controls, and what it
displays must equal kvlib's own result: bytes exactly (`cache_report`, `kvlib.memory`),
times to 3 significant figures (`step_time`), waste to the display's 0.1 percentage point
(`simulate`). The paging explorer opens on chapter 9's own trace and shows its numbers.
Every explorer fits a 390-pixel phone, and its text and axes keep a WCAG contrast of at
least 4.5 against the page in dark mode as in light. The network is blocked: nothing may
be fetched from outside the site. Build the site first (``make book``).
"""

import ast
import json
import math
import random
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from test_site import SHOTS, browser, server  # noqa: F401  (fixtures)

from kvlib import cost, memory
from kvlib.book import web
from kvlib.config import PRESETS
from kvlib.book.explorer import CONTEXTS, GPUS_GIB, MODELS, cache_report, formula_text, kv_head_choices
from kvlib.hardware import HARDWARE, step_time
from kvlib.memory import DTYPE_BYTES
from kvlib.simulate import POLICIES, request_trace, simulate

ROOT = Path(__file__).resolve().parents[1]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
STEP_MODELS = [m for m in MODELS if PRESETS[m].family == "llama"]  # weights counted: a step can be timed
PAGES = {"cache": "book/ch04_how_big", "step": "book/ch05_step_time", "paging": "book/ch09_paging"}
# The labels of each explorer's controls: every number comes with its unit.
LABELS = {
    "cache": ["model", "cache dtype", "batch (sequences)", "context (tokens per sequence)",
              "KV heads per layer", "GPU memory (GiB)"],
    "step": ["hardware", "model", "dtype (weights and cache)", "batch (sequences)",
             "context (tokens per sequence)"],
    "paging": ["requests (median prompt + output, tokens)", "context limit (tokens)",
               "block size (tokens)"],
}


def open_explorer(browser, server, doc, kind, width=1280, theme=None):  # noqa: F811
    """The page with the network cut off; returns (page, explorer box, external requests, errors).

    ``theme`` ("light" or "dark") is stored where the site's theme switch stores it, and the
    browser prefers it too, before the page loads."""
    context = browser.new_context(viewport={"width": width, "height": 900},
                                  color_scheme=theme or "light")
    if theme:
        context.add_init_script(f"localStorage.setItem('theme', '{theme}');"
                                f"localStorage.setItem('mode', '{theme}');")
    page = context.new_page()
    external, errors = [], []

    def route(r):
        if urlparse(r.request.url).hostname in ("127.0.0.1", None):
            r.continue_()
        else:
            external.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}"))
    page.goto(f"{server}/{doc}.html", wait_until="load")
    box = page.locator(f'div.kv-explorer[data-explorer="{kind}"]')
    box.and_(page.locator('[data-ready="true"]')).wait_for(timeout=30_000)
    if theme:
        assert page.evaluate("document.documentElement.dataset.theme") == theme
    return page, box, external, errors


def value(box, name: str) -> str:
    return box.locator(f'output[data-name="{name}"]').get_attribute("data-value")


def text(box, name: str) -> str:
    return box.locator(f'output[data-name="{name}"]').inner_text()


def number(s: str) -> float:
    """The first number of a displayed text, thousands separators and all: '34,900 ms' -> 34900."""
    return float(re.match(r"[\d,.]+", s).group().replace(",", ""))


def gb(n: float) -> str:  # the step explorer's decimal gigabytes
    x = n / 1e9
    return f"{x:,.{2 if x < 10 else 1 if x < 100 else 0}f} GB"


def pick(box, label: str, v) -> None:
    box.get_by_label(label, exact=True).select_option(str(v))


def clean(external, errors):
    assert external == [], f"requests outside the site: {external}"
    assert errors == []


def close(page):
    page.context.close()


def test_cache_explorer_equals_cache_report(browser, server):  # noqa: F811
    page, box, external, errors = open_explorer(browser, server, PAGES["cache"], "cache")
    rng = random.Random(0)
    grid = [(m, d, rng.choice(BATCHES), rng.choice(CONTEXTS), rng.choice(kv_head_choices(PRESETS[m])),
             rng.choice(GPUS_GIB)) for m in MODELS for d in DTYPE_BYTES for _ in range(2)]
    grid.append(("llama-2-7b", "fp8", 1, 4096, 1, 80))  # one of everything: singular words
    for model, dtype, batch, ctx, heads, gpu in grid:
        pick(box, "model", model)
        pick(box, "cache dtype", dtype)
        pick(box, "batch (sequences)", batch)
        pick(box, "context (tokens per sequence)", ctx)
        pick(box, "KV heads per layer", heads)
        pick(box, "GPU memory (GiB)", gpu)
        want = cache_report(model, batch, ctx, dtype, heads, gpu)
        setting = (model, dtype, batch, ctx, heads, gpu)
        assert int(value(box, "cache_bytes")) == want["cache_bytes"], setting
        if want["weight_bytes"] is None:  # a "shapes" preset: weights not counted
            assert value(box, "weight_bytes") == "" and "not counted" in text(box, "weight_bytes"), setting
        else:
            assert int(value(box, "weight_bytes")) == want["weight_bytes"], setting
        assert value(box, "fits") == str(want["fits"]).lower(), setting
        formula = box.locator('[data-name="formula"]').inner_text()
        assert formula == formula_text(want), setting  # the same terms, one per kind of layer
        for t in want["terms"]:  # each kind's tokens held: min(n, W) for a window, n for a full layer
            assert f" × {t['tokens']:,} token{'s' if t['tokens'] != 1 else ''} × " in formula, (setting, formula)
        width = DTYPE_BYTES[dtype]
        assert formula.endswith(f" × {width} byte{'s' if width > 1 else ''}"), (setting, formula)
    assert formula.startswith("2 (K and V) × 32 layers × 1 sequence × 1 KV head × 4,096 tokens")
    assert box.get_by_role("img").get_attribute("aria-label").startswith("weights ")
    # every preset whose layers differ, at every context: the JavaScript's per-layer sum is kvlib's
    pick(box, "batch (sequences)", 1)
    pick(box, "cache dtype", "bf16")
    for model in [m for m in MODELS if PRESETS[m].hybrid]:
        pick(box, "model", model)
        for ctx in CONTEXTS:
            pick(box, "context (tokens per sequence)", ctx)
            want = memory.kv_cache_bytes(PRESETS[model], ctx, 1, "bf16")
            assert int(value(box, "cache_bytes")) == want, (model, ctx)
    assert box.locator('[data-name="formula"]').inner_text() == (
        "61 latent(576) layers × 1 sequence × 131,072 tokens × 576 numbers × 2 bytes")  # DeepSeek-V3
    assert box.get_by_role("img").get_attribute("aria-label").startswith("KV cache ")  # no weights bar
    assert page.locator(".widget-dropdown").count() == 0  # no frozen ipywidgets panel beside it
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-cache.png"))
    clean(external, errors)
    close(page)


def test_step_explorer_equals_step_time(browser, server):  # noqa: F811
    page, box, external, errors = open_explorer(browser, server, PAGES["step"], "step")
    rng = random.Random(1)
    for hw_name, hw in HARDWARE.items():
        dtypes = [d for d in web.STEP_DTYPES if d in hw.peak_flops]
        for _ in range(4):
            model, dtype = rng.choice(STEP_MODELS), rng.choice(dtypes)
            batch, ctx = rng.choice(BATCHES), rng.choice(CONTEXTS)
            pick(box, "hardware", hw_name)
            pick(box, "model", model)
            pick(box, "dtype (weights and cache)", dtype)
            pick(box, "batch (sequences)", batch)
            pick(box, "context (tokens per sequence)", ctx)
            c = PRESETS[model]
            t = step_time(c, hw, batch, ctx, dtype=dtype)
            setting = (hw_name, model, dtype, batch, ctx)
            shown = number(text(box, "step_seconds"))
            assert shown == float(f"{1e3 * t.total:.3g}"), setting  # 3 significant figures, in ms
            assert float(value(box, "step_seconds")) == pytest.approx(t.total, rel=1e-12), setting
            assert value(box, "bound") == ("memory" if t.memory_bound else "compute"), setting
            assert float(value(box, "tokens_per_s")) == pytest.approx(batch / t.total, rel=1e-12)
            kv = t.bytes - cost.step_bytes(c, batch, ctx, dtype=dtype)["weights"]
            assert float(value(box, "kv_share")) == pytest.approx(kv / t.bytes, rel=1e-12), setting
            # what must fit: kvlib.memory's weights and cache, both at the chosen dtype
            need = memory.weight_bytes(c, dtype) + memory.kv_cache_bytes(c, ctx, batch, dtype)
            fits = box.locator('output[data-name="fits"]')
            assert int(fits.get_attribute("data-bytes")) == need, setting
            assert value(box, "fits") == str(need <= hw.memory).lower(), setting
            verdict = "fits" if need <= hw.memory else "does not fit"
            assert text(box, "fits").startswith(verdict + ": needs "), setting
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-step.png"))
    clean(external, errors)
    close(page)


def test_step_explorer_says_when_it_does_not_fit(browser, server):  # noqa: F811
    """Llama-3-70B on a T4 at batch 256 and 131,072 tokens: no time without the verdict."""
    page, box, external, errors = open_explorer(browser, server, PAGES["step"], "step")
    for label, v in (("hardware", "t4"), ("model", "llama-3-70b"), ("dtype (weights and cache)", "fp16"),
                     ("batch (sequences)", 256), ("context (tokens per sequence)", 131072)):
        pick(box, label, v)
    c, t4 = PRESETS["llama-3-70b"], HARDWARE["t4"]
    weights, cache = memory.weight_bytes(c, "fp16"), memory.kv_cache_bytes(c, 131072, 256, "fp16")
    assert weights + cache > t4.memory
    assert value(box, "fits") == "false"
    assert text(box, "fits") == (f"does not fit: needs {gb(weights + cache)} (weights {gb(weights)}"
                                 f" + KV cache {gb(cache)}), the GPU has 16 GB")
    assert "do not fit" in text(box, "step_seconds")
    pick(box, "batch (sequences)", 1)  # one sequence of 4,096 tokens of Llama-3-8B fits an H200
    pick(box, "context (tokens per sequence)", 4096)
    pick(box, "hardware", "h200")
    pick(box, "model", "llama-3-8b")
    assert value(box, "fits") == "true" and text(box, "fits").startswith("fits: needs")
    assert "do not fit" not in text(box, "step_seconds")
    clean(external, errors)
    close(page)


def test_step_explorer_roofline_reads_alone(browser, server):  # noqa: F811
    """Tick values on both axes, the ridge marked where kvlib puts it, and a legend."""
    page, box, external, errors = open_explorer(browser, server, PAGES["step"], "step")
    roof = box.locator("svg", has=page.locator("polyline"))
    ticks = roof.locator("text").all_text_contents()
    for tick in ("0.1", "1", "10", "100", "1,000", "10,000"):  # FLOPs per byte, and TFLOP/s
        assert tick in ticks, ticks
    ridge = HARDWARE["h100"].ridge("bf16")
    assert f"ridge {ridge:.3g}" in ticks, ticks
    x = float(roof.locator("line.kv-ridge").get_attribute("x1"))
    x_of = {t.text_content(): float(t.get_attribute("x")) for t in roof.locator("text.kv-xtick").all()}
    x100, x1000 = x_of["100"], x_of["1,000"]  # the ridge sits where its intensity is on the axis
    assert x == pytest.approx(x100 + (x1000 - x100) * (math.log10(ridge) - 2), abs=0.2)
    legend = box.locator(".kv-legend").inner_text()
    assert "roof" in legend and "ridge" in legend and "this step" in legend
    for kind in ("step", "cache", "paging"):  # every picture has a title, every number a unit
        if kind != "step":
            close(page)
            page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind)
        titles = box.locator("figcaption").all_inner_texts()
        assert titles and all(t.strip() for t in titles), (kind, titles)
        labels = box.locator("label").all_inner_texts()
        assert labels == LABELS[kind], (kind, labels)
    clean(external, errors)
    close(page)


def test_paging_explorer_equals_simulate(browser, server):  # noqa: F811
    """The table was simulated at build time; here each cell is simulated again from scratch."""
    page, box, external, errors = open_explorer(browser, server, PAGES["paging"], "paging")
    rng = random.Random(2)
    for key, t in web.PAGING_TRACES.items():
        for max_len in web.PAGING_MAX_LENS:
            block = rng.choice(web.PAGING_BLOCKS)
            pick(box, "requests (median prompt + output, tokens)", key)
            pick(box, "context limit (tokens)", max_len)
            pick(box, "block size (tokens)", block)
            trace, pool = web.trace_for(key, max_len), t["pool"]
            runs = {p: simulate(trace, p, memory_slots=pool, max_len=max_len, block_size=block)
                    for p in POLICIES}
            mean = sum(r.total for r in trace) / len(trace)
            assert float(value(box, "mean_len")) == pytest.approx(mean, rel=1e-12)
            for p, r in runs.items():
                shown = float(text(box, f"waste_{p}").split("%")[0]) / 100
                assert abs(shown - r.waste) <= 0.0005 + 1e-12, (p, key, max_len, block)
            assert float(value(box, "batch")) == pytest.approx(runs["paged"].mean_batch, rel=1e-12)
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-paging.png"))
    clean(external, errors)
    close(page)


def chapter9_setting() -> dict:
    """Chapter 9's chat-like trace, pool and block size, read from its own code cells."""
    nb = json.loads((ROOT / "book" / "ch09_paging.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.startswith(("%", "!"))))
    names, trace, blocks = {}, None, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            for target, v in zip(node.targets[0].elts, getattr(node.value, "elts", [])):
                if isinstance(target, ast.Name) and isinstance(v, ast.Constant):
                    names[target.id] = v.value
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "chat":
            trace = node.value
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "simulate"
                and getattr(node.args[0], "id", None) == "chat"):
            blocks += [(node.lineno, k.value.value) for k in node.keywords if k.arg == "block_size"]

    def resolve(v):
        return names[v.id] if isinstance(v, ast.Name) else ast.literal_eval(v)

    kw = {k.arg: resolve(k.value) for k in trace.keywords}
    block = min(blocks)[1]  # the first simulation of the chat-like trace: the chapter's table
    return {"n": resolve(trace.args[0]), "pool": names["POOL"], "block": block, **kw}


def test_paging_explorer_opens_on_chapter_9(browser, server):  # noqa: F811
    """The default view is chapter 9's trace, and shows chapter 9's numbers."""
    ch9 = chapter9_setting()
    assert ch9 == {"n": 400, "pool": 32768, "block": 16, "prompt_median": 160, "output_median": 200,
                   "sigma": 0.9, "max_len": 2048, "seed": 0}, ch9
    page, box, external, errors = open_explorer(browser, server, PAGES["paging"], "paging")
    trace = request_trace(ch9["n"], prompt_median=ch9["prompt_median"], output_median=ch9["output_median"],
                          sigma=ch9["sigma"], max_len=ch9["max_len"], seed=ch9["seed"])
    for p in POLICIES:  # the chapter runs every policy with these arguments (its cell 7)
        r = simulate(trace, p, memory_slots=ch9["pool"], max_len=ch9["max_len"], block_size=ch9["block"])
        shown = text(box, f"waste_{p}").split("%")[0]
        assert shown == f"{100 * r.waste:.1f}", (p, shown, r.waste)
    assert f"{ch9['n']} requests" in box.inner_text() and f"{ch9['pool']:,} token slots" in box.inner_text()
    assert float(value(box, "mean_len")) == pytest.approx(sum(r.total for r in trace) / len(trace))
    clean(external, errors)
    close(page)


@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_fits_a_phone(browser, server, kind):  # noqa: F811
    """At 390 px the page is no wider than the screen and everything in the box stays inside it."""
    page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind, width=390)
    page.wait_for_timeout(200)  # a redraw at the box's width, if any
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    inside = box.evaluate("""b => {
        const r = b.getBoundingClientRect(), out = [];
        if (r.left < 0 || r.right > innerWidth) out.push('box ' + r.left + '..' + r.right);
        if (b.scrollWidth > b.clientWidth) out.push('box scrolls: ' + b.scrollWidth + ' > ' + b.clientWidth);
        for (const e of b.querySelectorAll('*')) {
          const q = e.getBoundingClientRect();
          if (q.width && (q.left < r.left - 0.5 || q.right > r.right + 0.5))
            out.push(e.tagName + ' ' + Math.round(q.left) + '..' + Math.round(q.right));
        }
        return out; }""")
    assert inside == [], f"{kind}: sticks out of a {box.bounding_box()['width']:.0f} px box: {inside[:5]}"
    clean(external, errors)
    close(page)


CONTRAST = """box => {  // WCAG 2 contrast of every text and axis in the box against what lies behind it
  const rgb = s => { const m = s.match(/[\\d.]+/g).map(Number); return m.length > 3 ? m : m.concat([1]); };
  const lum = ([r, g, b]) => { const f = c => (c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
                               return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const behind = e => { for (let a = e; a; a = a.parentElement) {
      const c = rgb(getComputedStyle(a).backgroundColor); if (c[3] > 0) return c; }
    return [255, 255, 255, 1]; };
  const bad = [], page = rgb(getComputedStyle(document.body).backgroundColor);
  const check = (e, colour, what) => {
    if (!colour || colour === 'none') { bad.push(what + ': no colour'); return; }
    const r = ratio(rgb(colour), behind(e));
    if (r < 4.5) bad.push(what + ' ' + colour + ' on ' + behind(e) + ': ' + r.toFixed(2));
  };
  const texts = [...box.querySelectorAll('*')].filter(e => !(e instanceof SVGElement) &&
      [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()));
  texts.forEach(e => check(e, getComputedStyle(e).color, e.tagName + ' "' + e.textContent.slice(0, 20) + '"'));
  box.querySelectorAll('svg text').forEach(e => check(e, getComputedStyle(e).fill, 'svg text "' + e.textContent + '"'));
  box.querySelectorAll('svg path, svg line:not(.kv-grid)').forEach(e => {  // axes, ticks, the ridge
      if (!e.closest('.kv-legend')) check(e, getComputedStyle(e).stroke, 'svg ' + e.tagName); });
  return { bad: bad, n: texts.length + box.querySelectorAll('svg text').length, page: page };
}"""


@pytest.mark.parametrize("theme", ["dark", "light"])
@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_is_legible_in_both_themes(browser, server, kind, theme):  # noqa: F811
    """Text, tick labels and axes: contrast >= 4.5 (WCAG AA) against the page behind them."""
    page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind, theme=theme)
    result = box.evaluate(CONTRAST)
    assert result["n"] > 10, result
    assert result["bad"] == [], f"{kind} in {theme} mode: {result['bad'][:6]}"
    clean(external, errors)
    close(page)


@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_screenshots(browser, server, kind):  # noqa: F811
    """Phone and desktop, light and dark, for a person to look at (_build/screenshots)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    for theme in ("light", "dark"):
        for width in (390, 1280):
            page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind, width, theme)
            page.add_style_tag(content=".bd-header, .bd-header-article { position: static !important; }"
                                       ".skip-link { display: none !important; }")
            box.screenshot(path=str(SHOTS / f"explorer-{kind}-{width}-{theme}.png"))
            clean(external, errors)
            close(page)


def test_explorer_data_is_kvlib_presets():
    data = web.explorer_data(paging=False)
    for name in MODELS:
        c, m = PRESETS[name], data["models"][name]
        assert (m["n_layer"], m["n_kv_head"], m["head_dim"], m["d_ff"]) == (c.n_layer, c.n_kv_head, c.head_dim, c.d_ff)
        assert m["kv_heads"] == kv_head_choices(c)
        assert [(k["kind"], k["size"], k["sinks"], k["source"]) for k in m["layers"]] == [
            (k.kind, k.size, k.sinks, k.source) for k in c.layer_kinds()]
        if c.family == "shapes":
            assert m["param_count"] is None and name not in data["step_models"]
        else:
            assert m["param_count"] * 2 == memory.weight_bytes(c, "fp16") and name in data["step_models"]
    assert data["hardware"]["h100"]["mem_bandwidth"] == HARDWARE["h100"].mem_bandwidth
    assert data["hardware"]["t4"]["memory"] == HARDWARE["t4"].memory
    assert data["dtype_bytes"] == DTYPE_BYTES and data["contexts"] == CONTEXTS
    # the default view and the "chat-like" trace are chapter 9's
    ch9, d = chapter9_setting(), data["paging"]["default"]
    t = web.PAGING_TRACES[d["trace"]]
    assert (d["max_len"], d["block"], t["pool"], data["paging"]["requests"]) == (
        ch9["max_len"], ch9["block"], ch9["pool"], ch9["n"])
    assert {k: t[k] for k in ("prompt_median", "output_median", "sigma", "seed")} == {
        k: ch9[k] for k in ("prompt_median", "output_median", "sigma", "seed")}


def test_paging_table_is_simulate():
    traces = {"t": {"label": "t", "prompt_median": 64, "output_median": 64, "sigma": 0.9, "seed": 0,
                    "pool": 4096}}
    rows = web.paging_table(blocks=[16], max_lens=[1024], traces=traces, n=40)
    trace = request_trace(40, prompt_median=64, output_median=64, max_len=1024, seed=0)
    paged = simulate(trace, "paged", memory_slots=4096, max_len=1024, block_size=16)
    assert rows[0]["waste"]["paged"]["16"] == paged.waste
    assert rows[0]["batch"]["paged"]["16"] == paged.mean_batch
    assert rows[0]["waste"]["max"] == simulate(trace, "max", memory_slots=4096, max_len=1024).waste
    assert rows[0]["waste"]["oracle"] == simulate(trace, "oracle", memory_slots=4096, max_len=1024).waste
