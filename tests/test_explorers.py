"""The website's live explorers (js/explorers.js) against kvlib itself, in headless Chromium.

Each explorer is set to a grid of settings through its labelled controls, and what it
displays must equal kvlib's own result: bytes exactly (`cache_report`), times to 3
significant figures (`step_time`), waste to the display's 0.1 percentage point
(`simulate`). The network is blocked: nothing may be fetched from outside the site.
Build the site first (``make book``).
"""

import random
from urllib.parse import urlparse

import pytest
from test_site import KNOWN_THEME_ERRORS, SHOTS, browser, server  # noqa: F401  (fixtures)

from kvlib import cost
from kvlib.book import web
from kvlib.config import PRESETS
from kvlib.book.explorer import CONTEXTS, GPUS_GIB, MODELS, cache_report, kv_head_choices
from kvlib.hardware import HARDWARE, step_time
from kvlib.memory import DTYPE_BYTES
from kvlib.simulate import request_trace, simulate

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def open_explorer(browser, server, doc, kind):  # noqa: F811
    """The page with the network cut off; returns (page, explorer box, external requests, errors)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
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
    return page, box, external, errors


def value(box, name: str) -> str:
    return box.locator(f'output[data-name="{name}"]').get_attribute("data-value")


def text(box, name: str) -> str:
    return box.locator(f'output[data-name="{name}"]').inner_text()


def pick(box, label: str, v) -> None:
    box.get_by_label(label, exact=True).select_option(str(v))


def clean(external, errors):
    assert external == [], f"requests outside the site: {external}"
    assert [e for e in errors if not any(k in e for k in KNOWN_THEME_ERRORS)] == []


def test_cache_explorer_equals_cache_report(browser, server):  # noqa: F811
    page, box, external, errors = open_explorer(browser, server, "book/ch04_how_big", "cache")
    rng = random.Random(0)
    grid = [(m, d, rng.choice(BATCHES), rng.choice(CONTEXTS), rng.choice(kv_head_choices(PRESETS[m])),
             rng.choice(GPUS_GIB)) for m in MODELS for d in DTYPE_BYTES for _ in range(2)]
    for model, dtype, batch, ctx, heads, gpu in grid:
        pick(box, "model", model)
        pick(box, "cache dtype", dtype)
        pick(box, "batch", batch)
        pick(box, "context", ctx)
        pick(box, "KV heads", heads)
        pick(box, "GPU memory", gpu)
        want = cache_report(model, batch, ctx, dtype, heads, gpu)
        setting = (model, dtype, batch, ctx, heads, gpu)
        assert int(value(box, "cache_bytes")) == want["cache_bytes"], setting
        assert int(value(box, "weight_bytes")) == want["weight_bytes"], setting
        assert value(box, "fits") == str(want["fits"]).lower(), setting
    assert box.get_by_role("img").get_attribute("aria-label").startswith("weights ")
    assert page.locator(".widget-dropdown").count() == 0  # no frozen ipywidgets panel beside it
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-cache.png"))
    clean(external, errors)


def test_step_explorer_equals_step_time(browser, server):  # noqa: F811
    page, box, external, errors = open_explorer(browser, server, "book/ch05_step_time", "step")
    rng = random.Random(1)
    for hw_name, hw in HARDWARE.items():
        dtypes = [d for d in web.STEP_DTYPES if d in hw.peak_flops]
        for _ in range(4):
            model, dtype = rng.choice(MODELS), rng.choice(dtypes)
            batch, ctx = rng.choice(BATCHES), rng.choice(CONTEXTS)
            pick(box, "hardware", hw_name)
            pick(box, "model", model)
            pick(box, "dtype", dtype)
            pick(box, "batch", batch)
            pick(box, "context", ctx)
            t = step_time(PRESETS[model], hw, batch, ctx, dtype=dtype)
            setting = (hw_name, model, dtype, batch, ctx)
            shown = float(text(box, "step_seconds").split()[0])
            assert shown == float(f"{1e3 * t.total:.3g}"), setting  # 3 significant figures, in ms
            assert float(value(box, "step_seconds")) == pytest.approx(t.total, rel=1e-12), setting
            assert value(box, "bound") == ("memory" if t.memory_bound else "compute"), setting
            assert float(value(box, "tokens_per_s")) == pytest.approx(batch / t.total, rel=1e-12)
            kv = t.bytes - cost.step_bytes(PRESETS[model], batch, ctx, dtype=dtype)["weights"]
            assert float(value(box, "kv_share")) == pytest.approx(kv / t.bytes, rel=1e-12), setting
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-step.png"))
    clean(external, errors)


def test_paging_explorer_equals_simulate(browser, server):  # noqa: F811
    """The table was simulated at build time; here each cell is simulated again from scratch."""
    page, box, external, errors = open_explorer(browser, server, "book/ch09_paging", "paging")
    rng = random.Random(2)
    for max_len in web.PAGING_MAX_LENS:
        for median in web.PAGING_MEDIANS:
            block = rng.choice(web.PAGING_BLOCKS)
            pick(box, "block size", block)
            pick(box, "context limit", max_len)
            pick(box, "median request length", median)
            trace = request_trace(web.PAGING_REQUESTS, prompt_median=median / 2, output_median=median / 2,
                                  max_len=max_len, seed=0)
            pool = web.PAGING_POOL
            want = {"waste_max": simulate(trace, "max", memory_slots=pool, max_len=max_len).waste,
                    "waste_pow2": simulate(trace, "pow2", memory_slots=pool, max_len=max_len).waste,
                    "waste_paged": simulate(trace, "paged", memory_slots=pool, max_len=max_len,
                                            block_size=block).waste}
            mean = sum(r.total for r in trace) / len(trace)
            assert float(value(box, "mean_len")) == pytest.approx(mean, rel=1e-12)
            for name, w in want.items():
                shown = float(text(box, name).rstrip("%")) / 100
                assert abs(shown - w) <= 0.0005 + 1e-12, (name, block, max_len, median)
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "explorer-paging.png"))
    clean(external, errors)


def test_explorer_data_is_kvlib_presets():
    data = web.explorer_data(paging=False)
    for name in MODELS:
        c, m = PRESETS[name], data["models"][name]
        assert (m["n_layer"], m["n_kv_head"], m["head_dim"], m["d_ff"]) == (c.n_layer, c.n_kv_head, c.head_dim, c.d_ff)
        assert m["kv_heads"] == kv_head_choices(c)
    assert data["hardware"]["h100"]["mem_bandwidth"] == HARDWARE["h100"].mem_bandwidth
    assert data["dtype_bytes"] == DTYPE_BYTES and data["contexts"] == CONTEXTS


def test_paging_table_is_simulate():
    rows = web.paging_table(blocks=[16], max_lens=[1024], medians=[128], n=40, pool=4096)
    trace = request_trace(40, prompt_median=64, output_median=64, max_len=1024, seed=0)
    assert rows[0]["paged"][16] == simulate(trace, "paged", memory_slots=4096, max_len=1024, block_size=16).waste
    assert rows[0]["max"] == simulate(trace, "max", memory_slots=4096, max_len=1024).waste
