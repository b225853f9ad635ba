"""A Sphinx extension of the book's own: the Colab and download buttons open the reader edition.

sphinx-book-theme points the rocket menu's Colab link at the chapter itself
(``.../blob/main/book/ch02_prefill_decode.ipynb``) and the download menu's ``.ipynb`` at
the source Jupyter Book parsed. Both are MyST notebooks, which Jupyter and Colab show as
raw markup. This extension, listed in ``_config.yml``'s ``extra_extensions``, points both
at the chapter's reader edition in ``reader/`` (`kvlib.book.reader`), copies the
editions into the site, and leaves pages without one as they were.
"""

from __future__ import annotations

import shutil
from pathlib import Path

READER = "reader"  # the reader editions' folder, at the repository root and in the site


def _edition(app, pagename: str) -> Path | None:
    path = Path(app.srcdir) / READER / f"{Path(pagename).name}.ipynb"
    return path if path.is_file() else None


def point_buttons(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """After the theme made its header buttons (priority 501), retarget the two links."""
    edition = _edition(app, pagename)
    if edition is None:
        return
    name = edition.name
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            url = button.get("url", "")
            if button.get("text") == "Colab" and url.endswith(f"/{pagename}.ipynb"):
                button["url"] = url[: -len(f"{pagename}.ipynb")] + f"{READER}/{name}"
                button["tooltip"] = "Open the reader edition in Colab"
            elif button.get("label") == "download-notebook-button" or (
                    button.get("label") == "download-source-button" and url.endswith(".ipynb")):
                button["url"] = context["pathto"](f"{READER}/{name}", 1)
                button["tooltip"] = "Download the notebook (the reader edition, for Jupyter and Colab)"


def copy_editions(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    src = Path(app.srcdir) / READER
    if src.is_dir():
        dest = Path(app.outdir) / READER
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(src.glob("*.ipynb")):
            shutil.copy2(path, dest / path.name)


def setup(app) -> dict:
    app.connect("html-page-context", point_buttons, priority=600)
    app.connect("build-finished", copy_editions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
