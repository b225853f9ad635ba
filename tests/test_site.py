"""The built website, as a reader's browser sees it.

Serves ``_build/html`` on 127.0.0.1 and opens every page in headless Chromium
(Debian's, driven by Playwright). Build the site first: ``make book``.
"""

import http.server
import re
import threading
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
# Console errors logged by the theme itself, not by the project's scripts:
# sphinx-book-theme declares THEBE_JS_URL twice, and pydata-sphinx-theme complains
# about an empty theme mode in a browser profile that has never stored one.
KNOWN_THEME_ERRORS = ("THEBE_JS_URL", "Got invalid theme mode")


def pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [c["file"] for c in toc["chapters"]]


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"{SITE} is not built: run `make book` (jupyter-book build) before the site tests")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output readable
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(SITE)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (never `playwright install`)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.mark.parametrize("doc", pages())
def test_page_renders_offline(server, browser, doc):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    external, failed, errors = [], [], []
    page.on("request", lambda r: external.append(r.url) if urlparse(r.url).hostname not in ("127.0.0.1", None) and not r.url.startswith("data:") else None)
    page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})"))
    page.on("response", lambda r: failed.append(f"{r.url} (HTTP {r.status})") if r.status >= 400 else None)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(f"{server}/{doc}.html", wait_until="load")
    # wait for MathJax to finish typesetting (it is vendored; see _config.yml)
    page.wait_for_function("() => !window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)", timeout=30_000)
    page.evaluate("() => window.MathJax && window.MathJax.startup ? window.MathJax.startup.promise : null")
    page.wait_for_load_state("networkidle")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{doc.replace('/', '_')}.png"), full_page=True)

    assert page.title().strip(), "page has no <title>"
    assert page.locator("article h1").count() >= 1, "page has no heading"

    text = page.locator("article").inner_text()
    raw_tex = re.findall(r"\$\$|\\\(|\\\[|\\frac|\\sum|\\begin\{", text)
    assert not raw_tex, f"raw TeX left on the page (MathJax did not typeset it): {raw_tex[:5]}"
    if doc.endswith(("ch01_naive", "ch02_prefill_decode", "ch03_where_cache_lives", "ch04_how_big", "ch05_step_time", "ch06_padding", "ch07_sharing_kv", "ch08_quantization", "ch09_paging", "ch10_long_context", "ch11_decode_fast", "ch12_serving")):
        assert page.locator("mjx-container").count() > 0, "expected typeset math on this page"

    broken = page.evaluate("() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    assert not broken, f"images that did not load: {broken}"
    assert not failed, f"failed requests: {failed}"
    assert not external, f"requests that left the machine: {external}"
    ours = [e for e in errors if not any(k in e for k in KNOWN_THEME_ERRORS)]
    assert not ours, f"console errors: {ours}"

    if (ROOT / f"{doc}.ipynb").is_file():  # notebook pages: Colab and download open the reader edition
        cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
        org_repo = urlparse(cfg["repository"]["url"]).path.strip("/")
        edition = f"reader/{Path(doc).name}.ipynb"
        assert (ROOT / edition).is_file(), f"no reader edition {edition}: run `make reader`"
        want = f"https://colab.research.google.com/github/{org_repo}/blob/{cfg['repository']['branch']}/{edition}"
        hrefs = page.eval_on_selector_all("a[href*='colab.research.google.com']", "els => els.map(e => e.href)")
        assert want in hrefs, f"Colab link {want} not among {hrefs}"
        downloads = page.eval_on_selector_all("a[href$='.ipynb']", "els => els.map(e => e.href)")
        local = [h for h in downloads if "colab.research.google.com" not in h]
        assert local and all(h.endswith(edition) for h in local), f"download links {local} should open {edition}"
        served = SITE / edition
        assert served.is_file() and served.read_bytes() == (ROOT / edition).read_bytes(), f"{served} not copied"
    page.close()
