"""The website as a reader sees it on a desktop and on a phone (issue 44): figures at their
true shape, nothing cut off, drawers that close, no tooltip in the way, pages that load only
what they use, lettered sub-pages, readable captions and lines. Chromium through the fixtures
of ``test_site``; build the site first (``make book``). Each check failed on the build of
2026-12-04 (run this file with ``KVLIB_SITE=<that build>`` to see it).
"""

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from test_site import DESKTOP, PHONE, ROOT, SITE, browser, built, chapter_pages, open_page, pages, server  # noqa: F401

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

WIDTHS = {"desktop": {"width": 1280, "height": 800}, "phone": PHONE}


def settled(page):
    """Wait for MathJax (where the page loads it) to typeset, and for fonts and layout."""
    page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise "
                  "? MathJax.startup.promise : null")
    page.evaluate("() => document.fonts.ready.then(() => null)")
    page.wait_for_timeout(200)


# What is wider than its room: display and inline math, printed output, code, tables. Each
# must scroll in a box that lies within the article, and every box but inline math's shows
# the cue (a shadow at the edge that hides more, js/site.css). Math is measured by what
# MathJax draws (mjx-math), not by scrollWidth, which counts its hidden copy for screen readers.
CUT_OFF = """() => {
    const article = document.querySelector('article');
    const edge = article.getBoundingClientRect().right + 1;
    const scrolls = a => ['auto', 'scroll'].includes(getComputedStyle(a).overflowX);
    const scroller = e => { for (let a = e; a && a !== article; a = a.parentElement)
                                if (scrolls(a)) return a; return null; };
    const text = e => (e.textContent || '').trim().replace(/\\s+/g, ' ').slice(0, 50);
    const cued = 'mjx-container[display="true"], div.cell_output pre, div.highlight pre, article table';
    const bad = [];
    for (const e of article.querySelectorAll(cued + ', span.math')) {
        const r = e.getBoundingClientRect();
        if (!r.width) continue;
        const box = scroller(e), math = e.querySelector('mjx-math'), table = e.tagName === 'TABLE';
        const drawn = math ? math.getBoundingClientRect().width : table ? r.width : e.scrollWidth;
        const room = table ? (box ? box.clientWidth : edge - r.left) : e.clientWidth;
        if (drawn <= room + 1 && r.right <= edge) continue;
        const over = Math.round(drawn - room);
        if (!box) bad.push(['cut off, no scroll box', e.tagName, over, text(e)]);
        else if (box.getBoundingClientRect().right > edge)
            bad.push(['box wider than the page', e.tagName, over, text(e)]);
        else if (e.matches(cued) && !getComputedStyle(box).backgroundImage.includes('gradient'))
            bad.push(['no cue that it scrolls', e.tagName, over, text(e)]);
    }
    return bad; }"""


FIGURES = """() => [...document.querySelectorAll('article img')]
    .filter(i => i.naturalWidth > 0 && i.getBoundingClientRect().height > 0)
    .map(i => { const r = i.getBoundingClientRect();
                return [i.src.split('/').pop().slice(0, 12), r.width / r.height,
                        i.naturalWidth / i.naturalHeight]; })"""


@pytest.fixture(scope="module")
def layout(server, browser):  # noqa: F811
    """Each page opened once at each width: its figures' shapes and what is cut off on it
    (measured on demand, then kept for the other tests)."""
    seen: dict[str, dict[str, tuple[list, list]]] = {}

    def at(width: str) -> dict[str, tuple[list, list]]:
        if width not in seen:
            seen[width] = {}
            for doc in pages():
                page, _ = open_page(browser, server, doc, WIDTHS[width])
                settled(page)
                seen[width][doc] = (page.evaluate(FIGURES), page.evaluate(CUT_OFF))
                page.close()
        return seen[width]
    return at


@pytest.mark.parametrize("width", WIDTHS)
def test_figures_keep_their_shape(layout, width):
    """Every image is shown at its own aspect ratio, within 2%: a squashed 12x12 mask is no
    longer square, and a squashed log-log plot changes the slopes chapter 4 reads."""
    shapes = [(doc.split("/")[-1], *s) for doc, (figs, _) in layout(width).items() for s in figs]
    off = [(doc, name, round(shown / true, 2)) for doc, name, shown, true in shapes if abs(shown / true - 1) > 0.02]
    assert len(shapes) >= 50, f"only {len(shapes)} figures found on the pages"
    assert not off, f"{len(off)} of {len(shapes)} figures at {width} width are not their true shape " \
                    f"(page, image, shown / true aspect ratio): {off[:8]}"


@pytest.mark.parametrize("width", WIDTHS)
def test_nothing_is_cut_off(layout, width):
    """On a 390 px phone, an equation, a printed table or a code line wider than the column
    scrolls in its own box with a visible cue; nothing runs off the edge, or is clipped,
    unseen. At 1280 px too: chapter 12's widest equation lost 263 px of its right end."""
    bad = {doc.split("/")[-1]: cut for doc, (_, cut) in layout(width).items() if cut}
    n = sum(len(v) for v in bad.values())
    assert not bad, f"{n} boxes overflow at {width} width on {len(bad)} pages (why, element, px, text): " \
                    f"{[(doc, cut[:2]) for doc, cut in list(bad.items())[:4]]}"


def tap_phone(browser, server, doc):
    context = browser.new_context(viewport=PHONE, has_touch=True, is_mobile=True)
    page = context.new_page()
    page.goto(f"{server}/{doc}.html", wait_until="load")
    page.wait_for_timeout(300)
    return context, page


def open_drawers(page) -> list[str]:
    return page.evaluate("() => [...document.querySelectorAll('dialog')].filter(d => d.open).map(d => d.id)")


def test_a_tapped_entry_closes_its_drawer(server, browser):
    """On a phone, the contents drawer (links within the page) and the chapters drawer close
    once an entry is tapped, and the page shows what was tapped."""
    context, page = tap_phone(browser, server, "book/ch09_paging")
    [b for b in page.query_selector_all(".secondary-toggle") if b.is_visible()][0].tap()
    page.wait_for_timeout(400)
    assert open_drawers(page) == ["pst-secondary-sidebar-modal"]
    entries = [a for a in page.query_selector_all("#pst-secondary-sidebar-modal a[href^='#']") if a.is_visible()]
    target = entries[3].get_attribute("href")[1:]
    entries[3].tap()
    page.wait_for_timeout(500)
    assert open_drawers(page) == [], "the contents drawer stays open over the page after a tap"
    top = page.evaluate(f"document.getElementById('{target}').getBoundingClientRect().top")
    assert 0 <= top < PHONE["height"] / 2, f"the tapped section #{target} is at {top:.0f} px"

    [b for b in page.query_selector_all(".primary-toggle") if b.is_visible()][0].tap()
    page.wait_for_timeout(400)
    chapter = page.locator("#pst-primary-sidebar-modal a[href$='ch04_how_big.html']").first
    with page.expect_navigation():
        chapter.tap()
    page.wait_for_timeout(300)
    assert page.url.endswith("ch04_how_big.html") and open_drawers(page) == []
    context.close()


def test_no_tooltip_covers_a_button_after_a_tap(server, browser):
    """A tapped button's tooltip ("Toggle secondary sidebar") stayed up over the header's
    icons and took the next tap on search."""
    context, page = tap_phone(browser, server, "book/ch09_paging")
    [b for b in page.query_selector_all(".secondary-toggle") if b.is_visible()][0].tap()
    page.wait_for_timeout(400)
    [a for a in page.query_selector_all("#pst-secondary-sidebar-modal a[href^='#']") if a.is_visible()][0].tap()
    page.wait_for_timeout(500)
    search = [b for b in page.query_selector_all(".search-button") if b.is_visible()]
    assert len(search) == 1
    box = search[0].bounding_box()
    hit = page.evaluate(f"""() => {{ const e = document.elementFromPoint({box['x'] + box['width'] / 2},
                                                                    {box['y'] + box['height'] / 2});
        return e.closest('.search-button') ? 'search' : e.outerHTML.slice(0, 120); }}""")
    assert hit == "search", f"the search button is covered by {hit}"
    search[0].tap()
    page.wait_for_timeout(400)
    assert page.evaluate("document.getElementById('pst-search-dialog').open"), "search did not open"
    context.close()


def requests_of(browser, server, doc) -> dict[str, int]:
    """Every file the page fetched, with its size in bytes."""
    page = browser.new_page(viewport=DESKTOP)
    responses = []
    page.on("response", lambda r: responses.append(r))
    page.goto(f"{server}/{doc}.html", wait_until="networkidle")
    settled(page)
    sizes = {urlparse(r.url).path: len(r.body()) for r in responses if r.status == 200}
    page.close()
    return sizes


# A chapter page's bytes as a reader's browser fetches them (chapter 9, uncompressed):
# 4.8 MB before issue 44 (the icon font's 1.5 MB script, MathJax, the search index on
# every page), 3.0 MB after it; the budget leaves room for a figure or two more.
PAGE_BYTES = 3_300_000


def test_a_page_loads_only_what_it_uses(server, browser):
    sizes = requests_of(browser, server, "book/ch09_paging")
    unused = [p for p in sizes if p.endswith(("fontawesome.js", ".map", "embed-amd.js", "searchindex.js"))]
    assert not unused, f"chapter 9 fetches what it does not use: {unused}"
    total = sum(sizes.values())
    assert total <= PAGE_BYTES, f"chapter 9 fetches {total:,} bytes in {len(sizes)} files (budget " \
        f"{PAGE_BYTES:,}); the largest: {sorted(sizes.items(), key=lambda kv: -kv[1])[:5]}"
    landing = requests_of(browser, server, "book/intro")
    assert not [p for p in landing if "mathjax" in p.lower()], "the landing page, which has no math, loads MathJax"


def test_the_site_ships_only_what_a_page_loads():
    """No widget runtime (no page renders a widget), no icon-font script, no source maps, no
    MathJax bundle other than the one the pages load (kvbook.lean)."""
    files = [p for p in SITE.rglob("*") if p.is_file()]
    unused = [str(p.relative_to(SITE)) for p in files if p.name.endswith(
        ("embed-amd.js", "libembed-amd.js", "fontawesome.js", ".map", "tex-svg.js", "mml-chtml.js", "latest.js"))]
    assert not unused, f"{len(unused)} files no page loads: {unused[:8]}"
    size = sum(p.stat().st_size for p in files)
    assert size < 32e6, f"the built site is {size / 1e6:.1f} MB (60 MB before issue 44)"


def test_pages_filed_under_a_chapter_are_lettered():
    """A page filed under chapter 2 is "2A", not "2.12" (which reads as if 2.1-2.11 were
    missing from the sidebar); the chapters' own sections keep their numbers."""
    html = built("book/intro")
    nav = re.findall(r'toctree-l(\d)"><a class="reference internal" href="([^"]+)">([^<]+)<', html)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    chapters = toc["parts"][0]["chapters"]
    want = {f"{Path(s['file']).name}.html": f"{i}{chr(65 + j)}. "
            for i, c in enumerate(chapters, 1) for j, s in enumerate(c.get("sections", []))}
    shown = {href: title for level, href, title in nav if href in want}
    wrong = {h: t for h, t in shown.items() if not t.startswith(want[h])}
    assert len(shown) == len(want) and not wrong, f"filed pages numbered {wrong or shown}"
    h1 = re.search(r'<h1><span class="section-number">([^<]+)</span>', built("book/ch02b_numerics"))
    assert h1 and h1.group(1).strip() == "2A.", h1 and h1.group(1)
    assert '<span class="section-number">2A.1. </span>' in built("book/ch02b_numerics")


def test_the_landing_map_lists_every_page():
    html = built("book/intro")
    table = html[html.index('id="the-map"'):]
    table = table[:table.index("</table>")]
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    docs = [d for c in toc["parts"][0]["chapters"] for d in [c["file"]] + [s["file"] for s in c.get("sections", [])]]
    missing = [d for d in docs if f'href="{Path(d).name}.html"' not in table]
    assert not missing, f"the landing page's map leaves out {missing}"


def contrast(a: list[float], b: list[float]) -> float:
    lum = lambda c: sum(w * ((v / 255 / 12.92) if v / 255 <= 0.03928 else ((v / 255 + 0.055) / 1.055) ** 2.4)
                        for w, v in zip((0.2126, 0.7152, 0.0722), c))
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_captions_read_as_text(server, browser):
    """Captions were set thin (300) and muted."""
    page, _ = open_page(browser, server, "book/ch04_how_big", DESKTOP)
    style = page.evaluate("""() => { const c = getComputedStyle(document.querySelector('figcaption p'));
        const rgb = s => s.match(/[\\d.]+/g).slice(0, 3).map(Number);
        return [Number(c.fontWeight), rgb(c.color), rgb(getComputedStyle(document.body).backgroundColor)]; }""")
    weight, fg, bg = style
    assert weight >= 400, f"captions at font-weight {weight}"
    assert contrast(fg, bg) >= 7, f"caption contrast {contrast(fg, bg):.1f} (want 7, WCAG AAA)"
    page.close()


def test_prose_lines_stay_readable_on_a_wide_screen(server, browser):
    """At 1920 px with the sidebar collapsed, lines of prose ran to about 130 characters."""
    page, _ = open_page(browser, server, "book/ch04_how_big", {"width": 1920, "height": 1080})
    [b for b in page.query_selector_all(".primary-toggle") if b.is_visible()][0].click()
    page.wait_for_timeout(600)
    chars = page.evaluate("""() => { const p = [...document.querySelectorAll('article section > p')]
            .sort((a, b) => b.textContent.length - a.textContent.length)[0];
        const c = document.createElement('canvas').getContext('2d');
        const s = getComputedStyle(p); c.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
        const text = p.textContent.replace(/\\s+/g, ' ');
        return p.clientWidth / (c.measureText(text).width / text.length); }""")
    assert chars <= 95, f"about {chars:.0f} characters a line at 1920 px"
    page.close()


def test_the_site_root_has_the_icon():
    root = (SITE / "index.html").read_text(encoding="utf-8")
    assert re.search(r'<link rel="icon" href="_static/[^"]+"', root), root[:300]
    assert "book/intro.html" in root
