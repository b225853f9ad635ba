"""A Sphinx extension of the book's own: what the theme and myst-nb leave wrong on each page.

Listed in ``_config.yml``'s ``extra_extensions``. It mends five things, each at the
``html-page-context`` event, so no vendored file is patched by hand, and sets one option:

1. **The Colab and download buttons open the reader edition.** sphinx-book-theme points
   the rocket menu's Colab link at the chapter itself
   (``.../blob/main/book/ch02_prefill_decode.ipynb``) and the download menu's ``.ipynb``
   at the source Jupyter Book parsed. Both are MyST notebooks, which Jupyter and Colab show
   as raw markup. Both now point at the chapter's reader edition in ``reader/``
   (`kvbook.reader`), copied into the site; pages without one stay as they were.
2. **The download menu says what it gives.** The ``.ipynb`` is a notebook without outputs
   (to run), and ``.pdf`` opens the browser's print dialog: the labels say so.
3. **No script twice.** Sphinx 7 replays inline scripts added after the builder started
   (sphinx-thebe's ``THEBE_JS_URL``, sphinx-togglebutton's selector), and a ``const``
   declared twice throws on every page. Repeats are dropped, the first kept.
4. **No widget state or runtime.** myst-nb adds ipywidgets' stored state, and its runtime's
   scripts, to any page whose notebook stored widget state (chapter 4's panel, whose place
   the live explorer takes; chapter 2's progress bars), though no page renders a widget
   view. They are dropped; `kvbook.lean` fails the build on a page that renders one.
5. **A first visit logs no error.** With no ``default_mode`` set, pydata-sphinx-theme
   stores an empty theme mode for a browser that has never chosen one, then logs
   "Got invalid theme mode" on every page. The default is "auto" (follow the system).

6. **Every page in the menu.** A page filed under a chapter (chapter 2's "When cached and
   uncached disagree", 2.12) would sit in a collapsed branch of the sidebar on every other
   page; ``show_navbar_depth`` 2 lists it open, at the ``config-inited`` event (setting it in
   ``_config.yml`` would replace the theme options Jupyter Book derives from that file).

7. **A page filed under a chapter is lettered, not numbered after its headings.** Sphinx
   numbers such a page as the chapter's next section: chapter 2 has eleven sections, so
   its page on numerics was "2.12", and the sidebar showed "2.12" under "2" as if 2.1-2.11
   were missing. The pages under a chapter are now "2A", "10A", "10B"..., their sections
   "2A.1", ..., at the ``env-get-updated`` event, after Sphinx has numbered them (figures
   keep the chapter's count: "Fig. 2.13" is on page 2A).

8. **The root page has the site's icon.** The ``index.html`` that sends a browser from
   the site's root to the landing page was one ``<meta>`` line (sphinx-external-toc's), so
   the browser asked for a ``/favicon.ico`` that does not exist. It is now a small page with
   the title, the icon and a link, written before that extension would write its own.

The sidebar buttons are mended in ``js/site.js`` (pydata-sphinx-theme issue #2451).
"""

from __future__ import annotations

import shutil
from pathlib import Path

READER = "reader"  # the reader editions' folder, at the repository root and in the site


def _edition(app, pagename: str) -> Path | None:
    path = Path(app.srcdir) / READER / f"{Path(pagename).name}.ipynb"
    return path if path.is_file() else None


# The download menu's items, labelled for what they give (sphinx-book-theme says ".ipynb", ".pdf").
NOTEBOOK_LABEL = ".ipynb (no outputs: run it)"
PRINT_LABEL = "Print or save as PDF"


def point_buttons(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """After the theme made its header buttons (priority 501), retarget and relabel them;
    and give the theme mode a default (5. in the module docstring)."""
    if not context.get("default_mode"):
        context["default_mode"] = "auto"
    edition = _edition(app, pagename)
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            url = button.get("url", "")
            if button.get("label") == "download-pdf-button":
                button["text"] = PRINT_LABEL
                button["tooltip"] = "Opens the browser's print dialog"
            elif edition is None:  # a page with no reader edition keeps its links
                continue
            elif button.get("text") == "Colab" and url.endswith(f"/{pagename}.ipynb"):
                button["url"] = url[: -len(f"{pagename}.ipynb")] + f"{READER}/{edition.name}"
                button["tooltip"] = "Open the reader edition in Colab"
            elif button.get("label") == "download-notebook-button" or (
                    button.get("label") == "download-source-button" and url.endswith(".ipynb")):
                button["url"] = context["pathto"](f"{READER}/{edition.name}", 1)
                button["text"] = NOTEBOOK_LABEL
                button["tooltip"] = "The reader edition, for Jupyter and Colab: run it to see the outputs"


def _script_key(script) -> tuple:
    """What makes two ``<script>`` tags the same: the file (``None`` and ``""`` alike for an
    inline script) and the attributes, the inline body among them."""
    attrs = getattr(script, "attributes", {}) or {}
    return (getattr(script, "filename", str(script)) or "", tuple(sorted((k, str(v)) for k, v in attrs.items())))


def drop_repeated_scripts(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Keep the first of each script (3. in the module docstring)."""
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            kept.append(script)
    scripts[:] = kept


def drop_widget_runtime(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Before myst-nb adds its per-page scripts (priority 500), forget the widget ones
    (4. in the module docstring)."""
    meta = getattr(app.env, "nb_metadata", {}).get(pagename, {})
    js_files = meta.get("js_files", {})
    if any(k.startswith("ipywidgets") for k in js_files):
        meta["js_files"] = {k: v for k, v in js_files.items() if not k.startswith("ipywidgets")}


def copy_editions(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    src = Path(app.srcdir) / READER
    if src.is_dir():
        dest = Path(app.outdir) / READER
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(src.glob("*.ipynb")):
            shutil.copy2(path, dest / path.name)


def open_navbar(app, config) -> None:
    """6: list the pages filed under a chapter open in the sidebar, on every page."""
    config.html_theme_options = {**config.html_theme_options, "show_navbar_depth": 2}


def letter_filed_pages(app, env) -> list[str]:
    """7: renumber the pages filed under a chapter, (2, 12, ...) -> ("2A", ...), everywhere
    Sphinx keeps a section number: the page's numbers, its title and its table of contents
    (which the sidebar and the previous/next links copy)."""
    from docutils import nodes

    filed = sorted((nums[""], doc) for doc, nums in env.toc_secnumbers.items() if len(nums.get("", ())) == 2)
    letters: dict[tuple, str] = {}
    for (chapter, k), _doc in filed:
        n = sum(1 for key in letters if key[0] == chapter)
        letters[(chapter, k)] = f"{chapter}{chr(ord('A') + n)}"

    def renumber(number):
        key = tuple(number[:2]) if number is not None and len(number) >= 2 else None
        return (letters[key], *number[2:]) if key in letters else number

    for _, doc in filed:
        env.toc_secnumbers[doc] = {a: renumber(n) for a, n in env.toc_secnumbers[doc].items()}
        for node in [*env.tocs[doc].findall(nodes.reference), env.titles.get(doc)]:
            if node is not None and node.get("secnumber"):
                node["secnumber"] = list(renumber(node["secnumber"]))
    return []


def write_root_redirect(app, exception) -> None:
    """8: the site root's page, before sphinx-external-toc's (which skips an existing one)."""
    if exception is not None or app.builder.format != "html":
        return
    from html import escape

    target = f"{app.config.root_doc}.html"
    icon = f"_static/{Path(app.config.html_favicon).name}" if app.config.html_favicon else ""
    title = escape(app.config.html_title or app.config.project)
    (Path(app.outdir) / "index.html").write_text(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{title}</title>\n"
        + (f'<link rel="icon" href="{icon}">\n' if icon else "")
        + f'<meta http-equiv="Refresh" content="0; url={target}">\n</head>\n'
        f'<body><p><a href="{target}">{title}</a></p></body>\n</html>\n', encoding="utf-8")


def setup(app) -> dict:
    app.connect("build-finished", write_root_redirect, priority=400)
    app.connect("env-get-updated", letter_filed_pages, priority=900)
    app.connect("config-inited", open_navbar)
    app.connect("html-page-context", drop_widget_runtime, priority=400)
    app.connect("html-page-context", point_buttons, priority=600)
    app.connect("html-page-context", drop_repeated_scripts, priority=900)
    app.connect("build-finished", copy_editions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
