"""A Sphinx extension of the book's own: a page loads only what it uses, and the site ships
only what some page loads (issue 44).

Listed in ``_config.yml``'s ``extra_extensions``. Measured on chapter 9 before it, a page
made 45 requests, 4.8 MB raw (1.8 MB gzipped), most of it for nothing on the page, and
the built folder was 60 MB. It drops:

1. **The icon font's script** (``_static/scripts/fontawesome.js``, 1.49 MB, and its 1.67 MB
   source map). pydata-sphinx-theme loads Font Awesome's JavaScript on every page "so that
   users can add custom icons", and the theme's own stylesheet already draws every icon
   the pages show from Font Awesome's web fonts (loaded only by a page that shows one).
   The script tag is taken out of each page, and the file out of the site.
2. **MathJax on a page with no math.** Sphinx loads MathJax on a page whose toctree
   includes a page with math: the landing page, which has none, loaded its 1.2 MB.
3. **The MathJax bundles no page can load.** sphinx-mathjax-offline copies the whole
   MathJax distribution (24 MB); the pages load ``tex-chtml.js``, which pulls its
   components, fonts and extensions from the same folder on demand (the menu can switch
   to SVG output or speech, so ``output/`` and ``sre/`` stay). The other complete bundles
   (``tex-svg.js``, ``mml-chtml.js``, ..., and ``latest.js``, which loads from a CDN) are
   deleted.
4. **Source maps** (``*.map``): only a browser's developer tools fetch them.
5. **The search index on a page that does not search.** pydata-sphinx-theme loads Sphinx's
   search scripts and the whole index (``searchindex.js``, 360 KB) on every page, for its
   search-as-you-type; with that off (the default, and this book's), the search box only
   sends the query to the search page, which loads them itself (`kvbook.search`).

The widget runtime (12 MB of ipywidgets bundles) is not vendored at all: no page renders a
widget (chapter 4's notebook panel gives its place to a live explorer, js/explorers.js),
and a page that did would fail the build here, with a warning that says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ICON_SCRIPT = "_static/scripts/fontawesome.js"
# tex-chtml.js is what the pages load (sphinx-mathjax-offline sets mathjax_path to it);
# these are MathJax's other complete bundles, which nothing loads.
UNUSED_MATHJAX = ["tex-svg.js", "tex-svg-full.js", "tex-mml-chtml.js", "tex-mml-svg.js",
                  "tex-chtml-full.js", "tex-chtml-full-speech.js", "mml-chtml.js",
                  "mml-svg.js", "node-main.js", "latest.js"]
_ICON_TAG = re.compile(r'[ \t]*<script defer src="[./]*' + re.escape(ICON_SCRIPT) + r'[^"]*"></script>\n?')
_MATH_ON_PAGE = ('class="math', "\\(", "\\[", "$$")
# the theme's copies of the search page's scripts, on every other page (5.)
_SEARCH_TAGS = re.compile(r'[ \t]*<script src="[./]*(?:_static/searchtools\.js|_static/language_data\.js|'
                          r'searchindex\.js)[^"]*"></script>\n?')


def page_has_math(body: str) -> bool:
    """Math that MathJax would typeset: Sphinx's math nodes, or TeX delimiters in an output."""
    return any(mark in body for mark in _MATH_ON_PAGE)


def drop_mathjax_without_math(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """2: after Sphinx added MathJax (priority 500), take it off a page with no math."""
    scripts = context.get("script_files")
    if not scripts or page_has_math(context.get("body", "")):
        return
    scripts[:] = [s for s in scripts
                  if "mathjax" not in (getattr(s, "filename", "") or "")
                  and not str(getattr(s, "attributes", {}).get("body", "")).startswith("window.MathJax")]


def refuse_widgets(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """No widget runtime ships, so a page that renders a widget would show an empty box."""
    if WIDGET_VIEW in context.get("body", ""):
        logger.warning(f"{pagename} renders an ipywidget, but the site ships no widget runtime "
                       "(kvbook.lean): remove its output (tag the cell remove-output), or "
                       "give the widget a plain-JavaScript version as js/explorers.js does")


def prune(app, exception) -> None:
    """1, 3, 4 and 5, once every page is written and every asset copied (after
    sphinx-mathjax-offline's copy, which is also at build-finished)."""
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    as_you_type = app.config.html_theme_options.get("search_as_you_type", False)
    for page in out.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        lean = _ICON_TAG.sub("", html)
        if not as_you_type and page != out / "search.html":
            lean = _SEARCH_TAGS.sub("", lean)
        if lean != html:
            page.write_text(lean, encoding="utf-8")
    shipped = [out / ICON_SCRIPT, *(out / "_static" / "mathjax" / name for name in UNUSED_MATHJAX)]
    for path in shipped + list(out.rglob("*.map")):
        path.unlink(missing_ok=True)


def setup(app) -> dict:
    app.connect("html-page-context", drop_mathjax_without_math, priority=800)
    app.connect("html-page-context", refuse_widgets, priority=800)
    app.connect("build-finished", prune, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
