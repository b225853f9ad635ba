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
from kvbook import web
from kvlib.config import PRESETS
from kvbook.explorer import CONTEXTS, GPUS_GIB, MODELS, cache_report, formula_text, kv_head_choices
from kvlib.hardware import HARDWARE, step_time
from kvlib.memory import DTYPE_BYTES
from kvlib.simulate import POLICIES, request_trace, simulate

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

ROOT = Path(__file__).resolve().parents[1]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
STEP_MODELS = [m for m in MODELS if PRESETS[m].family == "llama"]  # weights counted: a step can be timed
PAGES = {"cache": "book/ch04_how_big", "step": "book/ch05_step_time", "paging": "book/ch09_paging",
         "masks": "book/ch07b_layer_shapes", "quant": "book/ch08_quantization", "speculate": "book/ch12_serving"}
# The labels of each explorer's controls: every number comes with its unit.
LABELS = {
    "cache": ["model", "cache dtype", "batch (sequences)", "context (tokens per sequence)",
              "KV heads per layer", "GPU memory (GiB)"],
    "step": ["hardware", "model", "dtype (weights and cache)", "batch (sequences)",
             "context (tokens per sequence)"],
    "paging": ["requests (median prompt + output, tokens)", "context limit (tokens)",
               "block size (tokens)"],
    "masks": ["kind of layer", "window (tokens)", "sinks", "chunk (tokens)", "text (tokens)"],
    "quant": ["bits", "numbers per scale", "model"],
    "speculate": ["draft length k", "chance a guess is right"],
}


def open_explorer(browser, server, doc, kind, width=1280, theme=None, height=900):  # noqa: F811
    """The page with the network cut off; returns (page, explorer box, external requests, errors).

    ``theme`` ("light" or "dark") is stored where the site's theme switch stores it, and the
    browser prefers it too, before the page loads. ``server`` may be a ``file://`` URL of the
    built site: the page is then opened from disk, as a reader who opens index.html does."""
    context = browser.new_context(viewport={"width": width, "height": height},
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
    selector = f'div.kv-explorer[data-explorer="{kind}"]'
    box = page.locator(selector)
    page.wait_for_function("""s => { const b = document.querySelector(s);  // drawn, or given up
        return b && (b.dataset.ready === 'true' || b.textContent.includes('could not load')); }""",
                           arg=selector, timeout=30_000)
    assert box.get_attribute("data-ready") == "true", f"{doc}: {box.inner_text()}"
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
        if heads_change_the_cache(PRESETS[model]):
            pick(box, "KV heads per layer", heads)
        else:  # MLA: the control is disabled (test_cache_explorer_heads_control_only_where_it_counts)
            heads = None
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


# One change per explorer that must change what it shows: (control's label, a value not the default)
A_CHANGE = {"cache": ("batch (sequences)", 64), "step": ("batch (sequences)", 64),
            "paging": ("block size (tokens)", 256), "masks": ("text (tokens)", 20), "quant": ("bits", 2),
            "speculate": ("draft length k", 8)}


@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_works_from_disk(browser, kind):  # noqa: F811
    """The README says to open _build/html/index.html: from file://, with no server, every
    explorer loads its data and responds to its controls, and asks nothing of any host."""
    site = (ROOT / "_build" / "html").as_uri()
    page, box, external, errors = open_explorer(browser, site, PAGES[kind], kind)
    shown = lambda: (box.locator("output").all_inner_texts(), box.locator("svg").first.inner_html())  # noqa: E731
    before = shown()
    pick(box, *A_CHANGE[kind])
    after = shown()
    assert after[0] != before[0] and after[1] != before[1], f"{kind}: nothing changed from disk"
    requests = page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
    assert all(r.startswith("file://") for r in requests), [r for r in requests if not r.startswith("file:")]
    clean(external, errors)
    close(page)


def test_explorer_data_ships_as_a_script():
    """The data is a script the page runs (a page opened from disk may not fetch a file), and
    no JSON copy of it is shipped: the built site's data is what `web.explorer_data` says."""
    static = ROOT / "_build" / "html" / "_static"
    assert not (static / "explorers-data.json").exists(), "a JSON file no page fetches is shipped"
    shipped = web.read_script((static / "explorers-data.js").read_text())
    fresh = web.explorer_data(paging=False)
    assert {k: v for k, v in shipped.items() if k != "paging"} == {k: v for k, v in fresh.items() if k != "paging"}
    assert shipped["paging"]["rows"], "the paging table is missing"


def test_explorer_data_script_round_trips(tmp_path):
    """`python -m kvbook.web OUT.js` writes one global, the data exactly, and nothing else."""
    path = web.write(tmp_path / "data.js", paging=False)
    body = path.read_text()
    assert web.read_script(body) == json.loads(json.dumps(web.explorer_data(paging=False)))
    code = [line for line in body.splitlines() if not line.startswith("//")]  # past the comment
    assert len(code) == 1 and code[0].startswith("window.kvExplorerData = {") and code[0].endswith("};")
    with pytest.raises(ValueError, match=r"\.js"):
        web.write(tmp_path / "data.json", paging=False)


def visible_height(page) -> float:
    """The viewport's height below the theme's sticky article header (the icons' bar)."""
    return page.evaluate("innerHeight - document.querySelector('.bd-header-article').getBoundingClientRect().height")


@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_fits_a_laptop_screen(browser, server, kind):  # noqa: F811
    """At 1280x800 an explorer is shorter than the screen below the sticky header: every
    control and its chart are in view together, so moving one shows the other change."""
    page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind, width=1280, height=800)
    room, height = visible_height(page), box.bounding_box()["height"]
    assert height <= room, f"{kind}: {height:.0f} px tall, {room:.0f} px in view at 1280x800"
    clean(external, errors)
    close(page)


def test_step_explorer_controls_and_chart_share_a_phone_screen(browser, server):  # noqa: F811
    """On a 390x844 phone the step explorer's controls and its roofline fit the screen together."""
    page, box, external, errors = open_explorer(browser, server, PAGES["step"], "step", width=390, height=844)
    span = box.evaluate("""b => { const top = b.querySelector('form').getBoundingClientRect().top;
        const roof = [...b.querySelectorAll('svg')].find(s => s.querySelector('polyline'));
        return roof.getBoundingClientRect().bottom - top; }""")
    room = visible_height(page)
    assert span <= room, f"controls to roofline: {span:.0f} px, {room:.0f} px in view on a phone"
    clean(external, errors)
    close(page)


@pytest.mark.parametrize("kind", list(PAGES))
def test_explorer_controls_are_tap_targets(browser, server, kind):  # noqa: F811
    """On a phone every control is a comfortable tap target (44 px, Apple's and WCAG 2.5.5's
    size), its text at least 16 px (smaller, and iOS zooms the page when it is tapped)."""
    page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind, width=390, height=844)
    sizes = box.locator("select").evaluate_all(
        "ss => ss.map(s => [s.name, s.getBoundingClientRect().height, parseFloat(getComputedStyle(s).fontSize)])")
    assert len(sizes) == len(LABELS[kind])
    small = [(name, round(h), f) for name, h, f in sizes if h < 44 or f < 16]
    assert small == [], f"{kind}: controls (name, px tall, font px) too small to tap: {small}"
    clean(external, errors)
    close(page)


def heads_change_the_cache(c) -> bool:
    """Whether a model's number of KV heads changes its cache: not for MLA, which caches one latent."""
    other = c.replace(n_kv_head=1 if c.n_kv_head != 1 else c.n_head)
    return memory.kv_cache_bytes(other, 4096, 1) != memory.kv_cache_bytes(c, 4096, 1)


def test_cache_explorer_heads_control_only_where_it_counts(browser, server):  # noqa: F811
    """DeepSeek-V3's MLA caches a latent per token, not heads: its heads control is disabled and a
    visible note says why; every other preset's control is live and changes the cache."""
    page, box, external, errors = open_explorer(browser, server, PAGES["cache"], "cache")
    heads = box.get_by_label("KV heads per layer", exact=True)
    latent = [m for m in MODELS if not heads_change_the_cache(PRESETS[m])]
    assert latent == ["deepseek-v3"]
    for model in MODELS:
        pick(box, "model", model)
        why = box.locator('[data-name="heads_note"]')
        if model in latent:
            assert heads.is_disabled(), f"{model}: its KV-heads control does nothing, yet it is live"
            assert why.is_visible() and "latent" in why.inner_text(), model
            assert heads.get_attribute("aria-describedby") == why.get_attribute("id")
        else:
            assert heads.is_enabled() and not why.is_visible(), model
    clean(external, errors)
    close(page)


def says_past_the_limit(browser, server, kind: str, models) -> None:  # noqa: F811
    """Past a model's context limit (the preset's max_seq_len, its max_position_embeddings) the
    explorer says so plainly, in the notebook widget's words, naming the limit; within it, it
    says nothing. At least one context past some model's limit is tried."""
    page, box, external, errors = open_explorer(browser, server, PAGES[kind], kind)
    said = 0
    for model in models:
        pick(box, "model", model)
        limit = PRESETS[model].max_seq_len
        for ctx in CONTEXTS:
            pick(box, "context (tokens per sequence)", ctx)
            warning = box.locator('[data-name="limit"]')
            if ctx > limit:
                assert warning.is_visible(), f"{model} at {ctx:,} tokens, past its {limit:,}: no word"
                assert f"{limit:,} tokens" in warning.inner_text() and PRESETS[model].name in warning.inner_text()
                assert warning.inner_text() == limit_text(cache_report(model, 1, ctx))  # the widget's words
                said += 1
            else:
                assert not warning.is_visible(), (model, ctx)
    assert said > 0, "no context past any model's limit was tried"
    clean(external, errors)
    close(page)


def test_cache_explorer_says_when_a_context_is_past_the_model(browser, server):  # noqa: F811
    says_past_the_limit(browser, server, "cache", MODELS)


def test_step_explorer_says_when_a_context_is_past_the_model(browser, server):  # noqa: F811
    """Chapter 5's explorer too: Llama-3-8B at 131,072 tokens is past its 8,192."""
    says_past_the_limit(browser, server, "step", STEP_MODELS)


def limit_text(report) -> str:
    from kvbook.explorer import limit_text as words
    return words(report)


RED = """b => { const probe = document.createElement('span');  // the theme's danger colour, resolved
    probe.style.color = 'var(--pst-color-danger)'; b.append(probe);
    const red = getComputedStyle(probe).color; probe.remove();
    return [red, getComputedStyle(b.querySelector('output[data-name="fits"]')).color]; }"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_cache_explorer_shows_does_not_fit_in_red(browser, server, theme):  # noqa: F811
    """"does not fit" in the theme's danger colour, as chapter 5's explorer shows it, legible in both themes."""
    page, box, external, errors = open_explorer(browser, server, PAGES["cache"], "cache", theme=theme)
    red, colour = box.evaluate(RED)
    assert value(box, "fits") == "true" and colour != red, "a setting that fits is shown as an alarm"
    pick(box, "model", "llama-3-70b")  # 131 GiB of weights in 80 GiB, at 131,072 tokens (past its 8,192)
    pick(box, "context (tokens per sequence)", 131072)
    red, colour = box.evaluate(RED)
    assert value(box, "fits") == "false" and "does not fit" in text(box, "fits")
    assert colour == red, f"'does not fit' is {colour}, not the danger colour {red} chapter 5 uses"
    step, step_box, *_ = open_explorer(browser, server, PAGES["step"], "step", theme=theme)
    pick(step_box, "hardware", "t4")
    pick(step_box, "model", "llama-3-70b")
    assert value(step_box, "fits") == "false" and step_box.evaluate(RED)[1] == colour  # the same style
    close(step)
    result = box.evaluate(CONTRAST)  # the red verdict and the limit's warning are legible
    assert result["bad"] == [], f"in {theme} mode: {result['bad'][:6]}"
    clean(external, errors)
    close(page)


def test_chapter_4_says_use_the_panel_above_only_in_a_notebook(browser, server):  # noqa: F811
    """"In a notebook, use the panel above" is true in Jupyter and Colab; on the website the panel
    above is not shown (its output is removed), so there the sentence must not show either."""
    sentence = "In a notebook, use the panel above"
    page, box, external, errors = open_explorer(browser, server, PAGES["cache"], "cache")
    shown = page.get_by_text(sentence).evaluate_all("es => es.filter(e => e.checkVisibility()).length")
    assert shown == 0, "the website shows a sentence meant for notebooks"
    reader = json.loads((ROOT / "reader" / "ch04_how_big.ipynb").read_text())
    assert any(sentence in "".join(c["source"]) for c in reader["cells"])  # the notebooks keep it
    clean(external, errors)
    close(page)


def test_explorer_data_is_kvlib_presets():
    data = web.explorer_data(paging=False)
    for name in MODELS:
        c, m = PRESETS[name], data["models"][name]
        assert (m["n_layer"], m["n_kv_head"], m["head_dim"], m["d_ff"]) == (c.n_layer, c.n_kv_head, c.head_dim, c.d_ff)
        assert m["kv_heads"] == kv_head_choices(c)
        assert m["max_seq_len"] == c.max_seq_len  # the context limit the cache explorer warns past
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


# -- the knobs' explorers (kvbook.knobs): the mask and kept tokens, a quantized cache's bytes, a draft's yield --
def test_masks_explorer_equals_kvlib(browser, server):  # noqa: F811
    """Every cell of the grid is kvlib.layers.visible, and the kept tokens what a HybridCache of the layer
    holds (kvbook.knobs.masks.kept_positions), at a grid of kinds, windows, sinks, chunks and lengths."""
    import torch

    from kvbook.knobs.masks import kept_positions, layer_kind
    from kvlib import layers as L

    page, box, external, errors = open_explorer(browser, server, PAGES["masks"], "masks")
    rng = random.Random(3)
    grid = [("window", 4, 2, 4, 12), ("full", 4, 2, 4, 9), ("chunked", 4, 2, 5, 13), ("chunked", 4, 0, 1, 3),
            ("window", 16, 4, 4, 32), ("window", 1, 0, 4, 1)]
    grid += [(rng.choice(["full", "window", "chunked"]), rng.randint(1, 16), rng.randint(0, 4), rng.randint(1, 16),
              rng.randint(1, 32)) for _ in range(10)]
    for kind, window, sinks, chunk, n in grid:
        pick(box, "kind of layer", kind)  # then the settings this kind uses (the others are disabled)
        if kind == "window":
            pick(box, "window (tokens)", window), pick(box, "sinks", sinks)
        if kind == "chunked":
            pick(box, "chunk (tokens)", chunk)
        pick(box, "text (tokens)", n)
        layer, setting = layer_kind(kind, window, sinks, chunk), (kind, window, sinks, chunk, n)
        pos = torch.arange(n)
        want = L.visible(layer, pos, pos)
        seen = box.locator("rect.kv-seen").evaluate_all("rs => rs.map(r => [+r.dataset.q, +r.dataset.k])")
        assert sorted(map(tuple, seen)) == [tuple(x) for x in want.nonzero().tolist()], setting
        assert box.locator("rect.kv-hidden").count() == n * n - len(seen), setting
        assert value(box, "kind") == str(layer), setting
        assert int(value(box, "tokens_held")) == L.tokens_held(layer, n), setting
        kept = kept_positions(layer, n)
        assert value(box, "kept") == ",".join(map(str, kept)), setting
        marked = box.locator("rect.kv-kept").evaluate_all("rs => rs.map(r => +r.dataset.k)")
        assert marked == kept, setting
        disabled = [box.get_by_label(lab, exact=True).is_disabled() for lab in ("window (tokens)", "chunk (tokens)")]
        assert disabled == [kind != "window", kind != "chunked"], setting
    clean(external, errors)
    close(page)


def test_chapter_10_masks_open_on_its_sink_cache():
    """Chapter 10's explorer opens on its own setting (a window of 8 and 4 sinks over 24 tokens), read
    from its div; the page is the one the chapter's panel describes."""
    nb = json.loads((ROOT / "book" / "ch10_long_context.ipynb").read_text())
    div = next("".join(c["source"]) for c in nb["cells"] if 'data-explorer="masks"' in "".join(c["source"]))
    code = next("".join(c["source"]) for c in nb["cells"] if "kvbook.knobs.masks" in "".join(c["source"]))
    assert 'data-window="8" data-sinks="4" data-n="24"' in div
    assert 'explorer(kind="window", window=8, sinks=4, n=24)' in code


def test_chapter_10_masks_explorer(browser, server):  # noqa: F811
    from kvbook.knobs.masks import kept_positions
    from kvlib import layers as L

    page, box, external, errors = open_explorer(browser, server, "book/ch10_long_context", "masks")
    assert value(box, "kept") == ",".join(map(str, kept_positions(L.window(8, 4), 24)))  # 0-3, 16-23
    assert value(box, "kept") == "0,1,2,3,16,17,18,19,20,21,22,23"
    clean(external, errors)
    close(page)


def test_quant_explorer_equals_quantized_nbytes(browser, server):  # noqa: F811
    """Bytes per number are kvlib.quant.quantized_nbytes' (and so what quantize stores), and a token's
    bytes those times the numbers kvlib.memory counts in a token of the model's cache."""
    from kvlib.quant import quantized_nbytes

    page, box, external, errors = open_explorer(browser, server, PAGES["quant"], "quant")
    rng = random.Random(4)
    for bits in (2, 4, 8):
        for group in (8, 16, 32, 64):
            model = rng.choice(MODELS)
            pick(box, "bits", bits), pick(box, "numbers per scale", group), pick(box, "model", model)
            per = quantized_nbytes(64 * group, bits, group) / (64 * group)
            assert float(value(box, "bytes_per_number")) == per, (bits, group)
            numbers = memory.kv_bytes_per_token(PRESETS[model], 1)
            assert float(value(box, "token_bytes")) == pytest.approx(per * numbers, rel=1e-12), (bits, group, model)
            assert float(value(box, "share")) == pytest.approx(per / 2, rel=1e-12)
    pick(box, "bits", 4), pick(box, "numbers per scale", 64), pick(box, "model", "smollm2-135m")
    assert text(box, "token_bytes").startswith("6,480 bytes, against 23,040 in fp16")  # 0.5625 x 11,520 numbers
    clean(external, errors)
    close(page)


def test_speculate_explorer_equals_expected_tokens(browser, server):  # noqa: F811
    from kvlib.speculative import expected_tokens_per_forward

    page, box, external, errors = open_explorer(browser, server, PAGES["speculate"], "speculate")
    for k in (1, 2, 4, 8):
        for i in (0, 5, 15, 19, 20):
            a = i / 20
            pick(box, "draft length k", k), pick(box, "chance a guess is right", f"{a:g}")  # as JS writes it: 0, 0.25, 1
            want = expected_tokens_per_forward(k, a)
            assert float(value(box, "tokens_per_forward")) == pytest.approx(want, rel=1e-12), (k, a)
            shown = text(box, "tokens_per_forward")  # 3 decimals (1.3125 may show as 1.313: JS rounds half up)
            assert abs(number(shown) - want) <= 0.0005 + 1e-12 and shown.endswith(f" (at most {k + 1})"), (k, a)
    clean(external, errors)
    close(page)
