"""The built website, as a reader's browser sees it.

Serves ``_build/html`` on 127.0.0.1 and opens every page in headless Chromium
(Debian's, driven by Playwright). Build the site first: ``make book``.
"""

import http.server
import os
import re
import threading
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

ROOT = Path(__file__).resolve().parents[1]
# KVLIB_SITE: another built site to test, e.g. an older build, to watch a new check fail on it.
SITE = Path(os.environ.get("KVLIB_SITE", ROOT / "_build" / "html"))
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
# Console errors tolerated: none. The theme's two (THEBE_JS_URL declared twice, and
# "Got invalid theme mode" in a browser that never chose one) are mended by kvbook.site.
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}


def pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    chapters = [c for part in toc["parts"] for c in part["chapters"]]
    return [toc["root"]] + [f for c in chapters for f in [c["file"]] + [s["file"] for s in c.get("sections", [])]]


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
    assert not errors, f"console errors: {errors}"

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


def chapter_pages() -> list[str]:
    return [doc for doc in pages() if (ROOT / f"{doc}.ipynb").is_file()]


def visible_chapter_links(page) -> int:
    """Entries of the site's navigation (the home page, the chapters, the pages filed under a
    chapter, the references) that a reader can see, and tap, right now."""
    return page.evaluate("""() => [...document.querySelectorAll(
            '.bd-docs-nav li.toctree-l1 > a, .bd-docs-nav li.toctree-l2 > a')]
        .filter(a => { const r = a.getBoundingClientRect(); const s = getComputedStyle(a);
                       return r.width > 0 && r.height > 0 && s.visibility !== 'hidden'
                              && r.right > 0 && r.left < innerWidth; }).length""")


def open_page(browser, server, doc, viewport):
    page = browser.new_page(viewport=viewport)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"{r.url} (HTTP {r.status})") if r.status >= 400 else None)
    page.goto(f"{server}/{doc}.html", wait_until="load")
    page.wait_for_timeout(300)  # the themes bind their buttons on DOMContentLoaded
    return page, errors


@pytest.mark.parametrize("doc", ["book/intro", "book/ch09_paging"])
def test_the_phone_menu_opens_and_lists_the_chapters(server, browser, doc):
    """pydata-sphinx-theme issue #2451: the visible button used to open nothing (js/site.js)."""
    page, errors = open_page(browser, server, doc, PHONE)
    assert visible_chapter_links(page) == 0, "the chapter list shows before the menu is opened"
    buttons = [b for b in page.query_selector_all(".primary-toggle") if b.is_visible()]
    assert len(buttons) == 1, f"{len(buttons)} visible menu buttons"
    buttons[0].click()
    page.wait_for_timeout(500)
    shown = visible_chapter_links(page)
    page.screenshot(path=str(SHOTS / f"phone_menu_{doc.replace('/', '_')}.png"))
    assert shown == len(pages()), f"the opened menu shows {shown} of the book's {len(pages())} pages"
    page.keyboard.press("Escape")
    page.wait_for_timeout(300)
    assert visible_chapter_links(page) == 0, "Escape does not close the menu"
    assert errors == [], errors
    page.close()


def test_the_phone_contents_button_opens_the_page_contents(server, browser):
    page, errors = open_page(browser, server, "book/ch09_paging", PHONE)
    toc = "#pst-page-toc-nav a, .bd-toc-nav a"
    assert not any(a.is_visible() for a in page.query_selector_all(toc))
    buttons = [b for b in page.query_selector_all(".secondary-toggle") if b.is_visible()]
    assert len(buttons) == 1, f"{len(buttons)} visible contents buttons"
    buttons[0].click()
    page.wait_for_timeout(500)
    assert sum(a.is_visible() for a in page.query_selector_all(toc)) >= 3, "no page contents shown"
    assert errors == [], errors
    page.close()


def test_the_desktop_button_collapses_and_restores_the_sidebar(server, browser):
    page, errors = open_page(browser, server, "book/ch04_how_big", DESKTOP)
    before = visible_chapter_links(page)
    assert before == len(pages()), f"the sidebar shows {before} of the book's {len(pages())} pages"
    button = [b for b in page.query_selector_all(".primary-toggle") if b.is_visible()]
    assert len(button) == 1
    button[0].click()
    page.wait_for_timeout(600)  # the collapse is animated
    assert visible_chapter_links(page) == 0, "the sidebar did not collapse"
    button[0].click()
    page.wait_for_timeout(600)
    assert visible_chapter_links(page) == before, "the sidebar did not come back"
    assert errors == [], errors
    page.close()


def test_no_empty_band_above_the_page(server, browser):
    """pydata-sphinx-theme 0.17's navbar: an empty 64 px band with a second search box."""
    page, _ = open_page(browser, server, "book/ch01_naive", DESKTOP)
    searches = [b for b in page.query_selector_all(".search-button-field, .search-button") if b.is_visible()]
    assert len(searches) == 1, f"{len(searches)} visible search boxes"
    top = page.evaluate("document.querySelector('article h1').getBoundingClientRect().top")
    assert top < 160, f"the title starts {top:.0f} px down the page"
    page.close()


@pytest.mark.parametrize("doc", pages())
def test_no_page_is_wider_than_a_phone(server, browser, doc):
    page, _ = open_page(browser, server, doc, PHONE)
    width = page.evaluate("document.documentElement.scrollWidth")
    wide = page.evaluate("""() => [...document.querySelectorAll('article *')]
        .filter(e => e.getBoundingClientRect().right > innerWidth + 1 && !e.closest('pre, .MathJax, mjx-container, .table-wrapper, .output_area, .cell_output'))
        .slice(0, 3).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))""")
    assert width <= PHONE["width"], f"the page is {width} px wide at {PHONE['width']} px: {wide}"
    page.close()


@pytest.mark.parametrize("doc", chapter_pages())
def test_code_and_printed_output_fit_the_page_on_a_desktop(server, browser, doc):
    """At 1280 px no code box or printed output scrolls sideways (12 px code, js/site.css)."""
    page, _ = open_page(browser, server, doc, DESKTOP)
    over = page.evaluate("""() => [...document.querySelectorAll('div.cell_input pre, div.cell_output pre')]
        .filter(p => p.scrollWidth > p.clientWidth + 1)
        .map(p => p.textContent.split('\\n').reduce((a, b) => a.length >= b.length ? a : b))""")
    assert not over, f"{len(over)} boxes scroll sideways, e.g. {over[0]!r} ({len(over[0])} characters)"
    page.close()


def built(doc: str) -> str:
    return (SITE / f"{doc}.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", pages())
def test_no_script_twice_and_no_widget_runtime_without_a_widget(doc):
    html = built(doc)
    inline = re.findall(r"<script>(.*?)</script>", html, re.S)
    repeated = sorted({s[:60] for s in inline if inline.count(s) > 1})
    assert not repeated, f"inline scripts repeated on the page: {repeated}"
    if "application/vnd.jupyter.widget-view+json" not in html:
        assert "embed-amd.js" not in html and "widget-state+json" not in html, "the 4.4 MB widget runtime, for no widget"


@pytest.mark.parametrize("doc", chapter_pages())
def test_the_colab_install_cell_is_not_on_the_website(doc):
    """It is for Colab (the reader edition keeps it); on the website it is noise."""
    assert "google.colab" not in built(doc)
    edition = ROOT / "reader" / f"{Path(doc).name}.ipynb"
    assert "google.colab" in edition.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", chapter_pages())
def test_the_download_menu_says_what_it_gives(doc):
    from kvbook.site import NOTEBOOK_LABEL, PRINT_LABEL

    html = built(doc)
    assert NOTEBOOK_LABEL in html and PRINT_LABEL in html
    assert not re.search(r'btn__text-container">\.(ipynb|pdf)<', html), "a bare .ipynb or .pdf label"


@pytest.mark.parametrize("doc", ["book/ch09_paging", "book/ch13_beyond_one_machine"])
def test_a_chapters_kvlib_name_opens_its_reference_entry(server, browser, doc):
    """In Chromium: the first linked kvlib name of a chapter opens the reference page at its
    entry, and that entry names the chapter among those that teach it."""
    page = browser.new_page(viewport=DESKTOP)
    page.goto(f"{server}/{doc}.html", wait_until="load")
    links = page.locator("a.kvlib-api")
    assert links.count() > 5, f"{doc} links only {links.count()} kvlib names to the reference"
    target = links.first.get_attribute("title")  # the full name, e.g. kvlib.paged
    links.first.click()
    page.wait_for_load_state("load")
    anchor = urlparse(page.url).fragment
    assert "/book/api/" in page.url and anchor, page.url
    entry = page.locator(f"[id='{anchor}']")
    assert entry.count() == 1 and entry.is_visible(), f"{target}: no visible entry #{anchor} on {page.url}"
    taught = page.locator("p.kvlib-taught a")
    assert any(doc.split("/")[-1] in (taught.nth(i).get_attribute("href") or "") for i in range(taught.count())), \
        f"the reference does not list {doc} among the chapters that teach its names"
    page.close()


def test_in_chromium_every_public_name_has_an_entry_and_every_chapter_link_lands(server, browser):
    """The reference as a browser sees it: the ids on every reference page cover every name in
    kvlib's and each module's ``__all__``, and every chapter's kvlib link points at one of them."""
    from test_apiref import public_names

    toc = pages()
    page = browser.new_page(viewport=DESKTOP)
    ids: dict[str, set[str]] = {}
    for doc in (d for d in toc if d.startswith("book/api/")):
        page.goto(f"{server}/{doc}.html", wait_until="load")
        ids[f"{doc}.html"] = set(page.evaluate("() => [...document.querySelectorAll('[id]')].map(e => e.id)"))
    every = set().union(*ids.values())
    names = public_names()
    missing = [(m, n) for m, n, t in names if not ({t} if isinstance(t, str) else set(t)) & every]
    assert len(names) > 100 and not missing, f"public names with no entry: {missing[:10]}"
    links = 0
    for doc in (d for d in toc if d.startswith("book/ch")):
        page.goto(f"{server}/{doc}.html", wait_until="load")
        for href in page.evaluate("() => [...document.querySelectorAll('a.kvlib-api')].map(a => a.href)"):
            path, _, anchor = urlparse(href).path.lstrip("/"), None, urlparse(href).fragment
            assert anchor in ids.get(path, set()), f"{doc}: {href} lands on no entry"
            links += 1
    assert links > 100, f"only {links} links from the chapters to the reference"
    page.close()
