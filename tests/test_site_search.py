"""The website's search, as a reader uses it (issue 44, kvbook.search and js/search.js).

A concept the book teaches finds the page that teaches it first, typed either way
("PagedAttention", "paged attention"); a result's snippet is the page's text around the
query, not its table of contents; and the search box works from a page that no longer loads
the 360 KB index. Chromium through the fixtures of ``test_site``; build the site first.
"""

import json
import re
from urllib.parse import quote

import pytest
import yaml
from test_site import DESKTOP, ROOT, SITE, browser, built, server  # noqa: F401

from kvbook.search import CONCEPTS

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

# A query, and the page that must come first.
FIRST = {
    "paged attention": "book/ch09_paging",
    "PagedAttention": "book/ch09_paging",
    "FlashDecoding": "book/ch11_decode_fast",
    "radix tree": "book/ch12b_prefix_reuse",
    "speculative decoding": "book/ch12_serving",
}


def results(page, server, query: str) -> list[tuple[str, str]]:  # noqa: F811
    """(page, snippet) of each result, best first, once Sphinx says the search finished
    and every snippet is in."""
    page.goto(f"{server}/search.html?q={quote(query)}", wait_until="load")
    page.wait_for_function("() => /finished/i.test((document.querySelector("
                           "'#search-results .search-summary') || {}).textContent || '')", timeout=30_000)
    page.wait_for_function("() => [...document.querySelectorAll('#search-results ul.search > li')]"
                           ".slice(0, 5).every(li => li.querySelector('p.context'))", timeout=30_000)
    found = page.evaluate("""() => [...document.querySelectorAll('#search-results ul.search > li')]
        .map(li => [li.querySelector('a').getAttribute('href'),
                    (li.querySelector('p.context') || {}).textContent || ''])""")
    return [(href.split(".html")[0], text) for href, text in found]


@pytest.mark.parametrize("query", FIRST)
def test_a_concept_finds_the_page_that_teaches_it_first(server, browser, query):  # noqa: F811
    page = browser.new_page(viewport=DESKTOP)
    found = results(page, server, query)
    assert found and found[0][0] == FIRST[query], \
        f"{query!r}: {FIRST[query]} is result {[d for d, _ in found].index(FIRST[query]) + 1 if FIRST[query] in [d for d, _ in found] else 'none'} " \
        f"of {len(found)}; first: {[d for d, _ in found[:5]]}"
    page.close()


def test_a_snippet_is_the_text_around_the_query(server, browser):  # noqa: F811
    """Not the page's header and table of contents ("Contents 9.1 Overview 9.2 ...")."""
    page = browser.new_page(viewport=DESKTOP)
    found = results(page, server, "paged attention")[:5]
    contents = [(d, s[:90]) for d, s in found if re.search(r"Contents|\b\d+\.\d+\. \w+ \d+\.\d+\.", s)]
    assert not contents, f"snippets that show a table of contents: {contents}"
    silent = [(d, s[:90]) for d, s in found if not re.search(r"pag|attent", s, re.I)]
    assert not silent, f"snippets without the query's words: {silent}"
    page.close()


def test_the_search_box_works_on_a_page_without_the_index(server, browser):  # noqa: F811
    """A chapter no longer loads searchindex.js (kvbook.lean); its search box still sends
    the query to the search page, which finds it."""
    html = built("book/ch09_paging")
    assert "searchindex.js" not in html and "searchtools.js" not in html
    page = browser.new_page(viewport=DESKTOP)
    page.goto(f"{server}/book/ch09_paging.html", wait_until="load")
    page.wait_for_timeout(300)
    [b for b in page.query_selector_all(".search-button-field, .search-button") if b.is_visible()][0].click()
    field = page.locator("#pst-search-dialog input[name=q]")
    field.fill("radix tree")
    with page.expect_navigation():
        field.press("Enter")
    assert "search.html" in page.url
    page.wait_for_function("() => document.querySelectorAll('#search-results ul.search > li').length > 0",
                           timeout=30_000)
    first = page.evaluate("document.querySelector('#search-results ul.search > li a').getAttribute('href')")
    assert first.startswith("book/ch12b_prefix_reuse.html"), first
    page.close()


def test_every_concept_is_an_entry_on_its_page():
    """Each form in CONCEPTS is a main index entry of the page that teaches it, and that page
    is in the book."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    docs = {d for c in toc["parts"][0]["chapters"] for d in [c["file"]] + [s["file"] for s in c.get("sections", [])]}
    assert set(CONCEPTS) <= docs, set(CONCEPTS) - docs
    text = (SITE / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1: text.rindex(")")])
    wrong = []
    for doc, forms in CONCEPTS.items():
        for form in forms:
            entries = index["indexentries"].get(form.lower(), [])
            if not any(index["docnames"][i] == doc and main for i, _, main in entries):
                wrong.append((form, doc, [(index["docnames"][i], main) for i, _, main in entries]))
    assert not wrong, f"concepts not indexed as main entries of their pages: {wrong[:5]}"
