"""The reader edition of a chapter: the notebook Colab and the download button open.

The chapters in ``book/`` are MyST notebooks. Jupyter Book turns ``{glue:text}`x:.1f```
into a number, ``{numref}`fig-x``` into "Fig. 5" and an ``{exercise-start}`` fence into a
numbered box; Jupyter and Colab render none of it, so there the same notebook reads as
markup. The reader edition is the same notebook with every MyST construct turned into
what those front ends do render:

* a glued value becomes the value the book's build computed, in italics, and a note at
  the top says so (the cells, when run, print the reader's own);
* ``{doc}``, ``{ref}`` and ``{numref}`` become links with the words the website shows
  ("Fig. 5", a section's title), to an anchor on the same page or to the website;
  ``{cite}`` becomes "(Kwon et al., 2023a)", each work linked to its entry on the references page;
* ``(label)=`` targets become ``<a id="label"></a>``, a figure's caption a line under it;
* an exercise becomes a quoted block headed with its number, its solution's prose a
  ``<details>`` block and its code a folded cell (Colab's ``cellView: form``, Jupyter's
  ``source_hidden``), as plotting code (``hide-input``) is;
* ``:::{note}`` becomes a quoted **Note**.

Code cells keep their source (a folded one gains a ``#@title`` comment line), so the
edition runs exactly what the chapter runs. What the build resolved (glued values,
reference texts, figure and exercise numbers) is stored in the edition's metadata, so
`edition` can rebuild it from the chapter alone and a test can check the committed
editions are up to date. ``python -m kvbook.reader`` writes ``reader/*.ipynb`` from
a built book (``make reader``).
"""

from __future__ import annotations

import copy
import html
import json
import posixpath
import re
import sys
from pathlib import Path

# Every piece of MyST syntax the chapters use, and what `myst_left` looks for afterwards
ROLE = re.compile(r"\{([a-z][a-z:\-]*)\}`([^`]*)`")
FENCE = re.compile(r"^(`{3,}|:{3,})\s*\{([a-z][a-z\-]*)\}([^\n]*)\n(.*?)^\1\s*$", re.M | re.S)
TARGET = re.compile(r"^\(([^()\s]+)\)=\s*$", re.M)
OPTION = re.compile(r"^:(label|class|name):[^\n]*\n?", re.M)
MYST_LEFT = re.compile(r"\{[a-z][a-z:\-]*\}`|^(`{3,}|:{3,})\s*\{|^\([^()\s]+\)=\s*$|^:(label|class):", re.M)

REF_LINK = re.compile(
    r'<a class="reference internal" href="([^"]*)"[^>]*>\s*<span class="(std std-ref|doc)">'
    r"(.*?)</span>", re.S)
PAGE_TITLE = re.compile(  # the article's heading, not crossing its </h1>
    r'<h1>(?:<span class="section-number">[^<]*</span>)?((?:[^<]|<(?!/h1>|a class="headerlink"))*)<a class="headerlink"')
NUMBERED = re.compile(
    r'<(?:figure|div) class="(?:[^"]*\s)?(?:align-\w+|exercise admonition)[^"]*" id="([^"]+)">.*?'
    r'<span class="caption-number">([^<]+?)\s*</span>', re.S)


def glue_values(executed: dict) -> dict[str, str]:
    """The ``text/plain`` of every value an executed notebook glued, by name."""
    values = {}
    for cell in executed["cells"]:
        for out in cell.get("outputs", []):
            scrap = out.get("metadata", {}).get("scrapbook", {})
            key = scrap.get("mime_prefix", "") + "text/plain"  # glue(display=False) prefixes it
            if "name" in scrap and key in out.get("data", {}):
                name, text = scrap["name"], out["data"][key]
                values[name] = "".join(text) if isinstance(text, list) else text
    return values


def executed_chapter(root: Path, src: Path) -> dict:
    """The executed copy of chapter ``src`` from the book build's cache.

    Jupyter Book strips the glue outputs from ``_build/jupyter_execute``; its execution
    cache (``_build/.jupyter_cache``, jupyter-cache) keeps whole notebooks, matched by
    their code. ``KeyError`` if the build has not run this version of the chapter.
    """
    import nbformat
    from jupyter_cache import get_cache

    cache = get_cache(str(root / "_build" / ".jupyter_cache"))
    try:
        record = cache.match_cache_notebook(nbformat.read(str(src), as_version=4))
    except KeyError:
        raise KeyError(f"{src}: the book's build has not executed this version; run `make book`") from None
    return json.loads(nbformat.writes(cache.get_cache_bundle(record.pk).nb))


def _plain(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


def site_references(html_dir: Path) -> dict[str, list[str]]:
    """What the built website shows for each reference target: ``{target: [href, text]}``.

    Targets are labels (``ch5-why-less``, ``fig-ch2-step``, ``ch1-ex1``) and pages
    (``ch09_paging``); hrefs are relative to the site's root. Read from the HTML, so the
    words and numbers are exactly the website's: a section's title from the links to it,
    a figure's or an exercise's number from its own caption, a page's title from its own
    heading (what a bare ``{doc}`` shows; a link with words of its own says nothing of it).
    """
    refs: dict[str, list[str]] = {}
    for page in sorted(html_dir.rglob("*.html")):
        rel = page.relative_to(html_dir).parent
        text = page.read_text(encoding="utf-8")
        for href, kind, shown in REF_LINK.findall(text):
            path, _, frag = href.partition("#")
            target_page = (rel / path).as_posix() if path else page.relative_to(html_dir).as_posix()
            target_page = posixpath.normpath(target_page)
            if kind == "doc":
                refs.setdefault(Path(target_page).stem, [target_page, _plain(shown)])
            elif kind == "std std-ref":  # a section's title
                refs.setdefault(frag, [f"{target_page}#{frag}", _plain(shown)])
        for label, number in NUMBERED.findall(text):
            refs.setdefault(label, [f"{page.relative_to(html_dir).as_posix()}#{label}", _plain(number)])
    for page in sorted(html_dir.rglob("*.html")):
        title = PAGE_TITLE.search(page.read_text(encoding="utf-8"))
        if title and page.stem in refs:
            refs[page.stem] = [page.relative_to(html_dir).as_posix(), _plain(title.group(1))]
    return refs


def bib_citations(bib: str) -> dict[str, str]:
    """``{key: "Kwon et al., 2023a"}`` from a .bib file's text: the labels the website shows
    (`kvbook.citations.labels`), "a" and "b" where two works would share one."""
    from .citations import bib_labels

    return bib_labels(bib)


class _Noting(dict):
    """A dict that notes which of its keys were found."""

    def __init__(self, *args):
        super().__init__(*args)
        self.noted: set = set()

    def __contains__(self, key) -> bool:
        found = super().__contains__(key)
        if found:
            self.noted.add(key)
        return found

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.noted.add(key)
        return value


class _Resolver:
    """Turns one chapter's MyST into CommonMark, from what the build resolved."""

    def __init__(self, page: str, resolved: dict, site: str):
        self.page, self.site = page, site.rstrip("/") + "/"
        self.glue, self.refs, self.cites = resolved["glue"], resolved["refs"], resolved["cites"]

    def link(self, target: str, text: str | None = None) -> str:
        if target not in self.refs:
            raise KeyError(f"{self.page}: the build resolved no reference {target!r}; rebuild the book")
        href, shown = self.refs[target]
        path, _, frag = href.partition("#")
        url = f"#{frag}" if path == self.page and frag else self.site + href
        return f"[{text or shown}]({url})"

    def glued(self, body: str) -> str:
        from myst_nb.core.variables import format_plain_text

        key, fmt = body.rsplit(":", 1) if ":" in body else (body, "s")
        if key not in self.glue:
            raise KeyError(f"{self.page}: nothing glued {key!r} in the executed chapter; rebuild the book")
        return f"<em>{format_plain_text(self.glue[key], fmt)}</em>"

    def role(self, m: re.Match) -> str:
        name, body = m.groups()
        if name in ("glue:text", "glue", "glue:"):
            return self.glued(body)
        if name in ("doc", "ref", "numref"):
            custom = re.fullmatch(r"(.*?)\s*<([^>]+)>", body)
            text, target = (custom.group(1), custom.group(2)) if custom else (None, body)
            if name == "doc":
                target = Path(target).name
            return self.link(target, text)
        if name in ("cite", "cite:t", "cite:p"):  # cite:p is the parenthetical form
            keys = [k.strip() for k in body.split(",")]
            # each work linked to its own entry (the site's ids, "ref-<key>"), and in
            # parentheses, as the website shows {cite} and {cite:p}
            links = "; ".join(f"[{self.cites[k]}]({self.site}book/references.html#ref-{k})" for k in keys)
            return links if name == "cite:t" else f"({links})"
        raise ValueError(f"{self.page}: no reader-edition form for the role {{{name}}}")

    def prose(self, text: str) -> str:
        text = TARGET.sub(lambda m: f'<a id="{m.group(1)}"></a>', text)
        text = FENCE.sub(self.fence, text)
        return ROLE.sub(self.role, text)

    def fence(self, m: re.Match) -> str:
        _, name, arg, body = m.groups()
        options = dict(re.findall(r"^:(\w+):\s*([^\n]*)$", body, re.M))
        body = OPTION.sub("", body).strip("\n")
        if name == "note":
            return "> **Note**\n>\n" + _quote(self.prose(body))
        if name == "admonition":  # an aside: folded under its title, as the site's dropdown
            return f"<details><summary>{arg.strip()}</summary>\n\n{self.prose(body)}\n\n</details>"
        if name == "exercise-start":  # markers: `edition` quotes what lies between them
            return f"\x00exercise {options['label']}\x00"
        if name == "solution-start":
            return f"\x00solution {arg.strip()}\x00"
        if name in ("exercise-end", "solution-end"):
            return "\x00end\x00"
        raise ValueError(f"{self.page}: no reader-edition form for the directive {{{name}}}")


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" if line else ">" for line in text.splitlines())


def _fold(cell: dict, title: str) -> None:
    src = "".join(cell["source"])
    if not src.startswith("%%"):  # a cell magic must stay the first line
        cell["source"] = f"#@title {title}\n{src}"  # a comment outside Colab
    cell["metadata"]["cellView"] = "form"  # Colab: show the title, fold the code
    cell["metadata"].setdefault("jupyter", {})["source_hidden"] = True  # JupyterLab, Notebook 7


def edition(chapter: dict, page: str, resolved: dict, site: str) -> dict:
    """The reader edition of ``chapter`` (a notebook's JSON), the page ``book/chXX.html``.

    ``resolved`` holds what the build resolved: ``glue`` (name -> text/plain), ``refs``
    (`site_references`), ``cites`` (`bib_citations`) and ``built`` (a line saying where
    the numbers were measured). The result is stored with it in its metadata, so that
    ``edition(chapter, page, stored["metadata"]["kvlib_reader"], site)`` is the stored
    notebook again.
    """
    r = _Resolver(page, resolved, site)
    nb = copy.deepcopy(chapter)
    cells: list[dict] = []
    inside: tuple[str, str] | None = None  # ("exercise" | "solution", its number), across cells
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            parts = []
            for piece in re.split(r"(\x00[^\x00]*\x00)", r.prose("".join(cell["source"]))):
                if piece.startswith("\x00"):
                    kind, _, label = piece.strip("\x00").partition(" ")
                    inside = None if kind == "end" else (kind, r.refs[label][1])
                    if kind == "exercise":
                        parts.append(f'<a id="{label}"></a>\n\n> **{inside[1]}**\n>\n')
                    elif kind == "solution":
                        parts.append(f"**Solution to {inside[1]}**\n\n")
                elif inside and inside[0] == "exercise" and piece.strip():
                    parts.append(_quote(piece.strip("\n")) + "\n\n")
                elif inside and inside[0] == "solution" and piece.strip():
                    parts.append(f"<details><summary>Show the solution</summary>\n\n{piece.strip()}"
                                 "\n\n</details>\n\n")
                else:
                    parts.append(piece)
            text = re.sub(r"\n{3,}", "\n\n", "".join(parts)).strip("\n")
            if text:
                cell["source"] = text
                cells.append(cell)
            continue
        if inside and inside[0] == "solution":
            _fold(cell, f"Solution to {inside[1]} (code)")
        elif "hide-input" in cell.get("metadata", {}).get("tags", []):
            _fold(cell, "Plotting code (run it to draw the figure)")
        elif "hide-cell" in cell.get("metadata", {}).get("tags", []):
            _fold(cell, "An aside (run it to see it)")
        cells.append(cell)
        figure = cell.get("metadata", {}).get("mystnb", {}).get("figure")
        if figure and figure.get("name") in r.refs:
            name = figure["name"]
            caption = r.prose(figure.get("caption", ""))
            cells.append({"cell_type": "markdown", "metadata": {},
                          "source": f'<a id="{name}"></a>\n\n*{r.refs[name][1]}.* {caption}'})
    title = next((line[2:] for line in "".join(cells[0]["source"]).splitlines() if line.startswith("# ")),
                 "this chapter")
    note = (f"> **The reader edition**, for Jupyter and Colab, of the website's page "
            f"[{title}]({site}{page}). Numbers and phrases in *italics* in the text are what the "
            f"book's build measured ({resolved['built']}); run the cells and they print your "
            "machine's own, which may differ.")
    first = cells[0]  # the note goes under the chapter's title
    head, sep, rest = "".join(first["source"]).partition("\n\n")
    first["source"] = f"{head}\n\n{note}\n\n{rest}".rstrip("\n") if sep else f"{head}\n\n{note}"
    for cell in cells:
        if isinstance(cell["source"], str):
            cell["source"] = cell["source"].splitlines(keepends=True)
    nb["cells"] = cells
    nb["metadata"]["kvlib_reader"] = resolved
    return nb


def myst_left(nb: dict) -> list[str]:
    """Every piece of MyST syntax left in a notebook's markdown: ``[]`` for a reader edition."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            for m in MYST_LEFT.finditer("".join(cell["source"])):
                found.append(f"cell {i}: {m.group(0)!r}")
    return found


def build(root: Path, out: Path, site: str) -> list[Path]:
    """Write the reader edition of every chapter in ``root/book`` to ``out`` from the built
    book in ``root/_build``; the paths written."""
    import platform

    import torch

    html_dir = root / "_build" / "html"
    refs = site_references(html_dir)
    cites = bib_citations((root / "references.bib").read_text(encoding="utf-8"))
    built = (f"torch {torch.__version__.split('+')[0]}, {torch.get_num_threads()} threads, "
             f"{platform.machine()} CPU with {torch.backends.cpu.get_cpu_capability()} kernels")
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted((root / "book").glob("ch*.ipynb")):
        glue = glue_values(executed_chapter(root, src))
        chapter = json.loads(src.read_text(encoding="utf-8"))
        page = f"book/{src.stem}.html"
        # make it once with everything the build resolved, noting what it looks up ...
        seen = {"glue": _Noting(glue), "refs": _Noting(refs), "cites": _Noting(cites)}
        edition(chapter, page, {"built": built, **seen}, site)
        # ... then keep only that in the edition's metadata
        resolved = {"built": built, **{k: {n: v[n] for n in sorted(v.noted)} for k, v in seen.items()}}
        nb = edition(chapter, page, resolved, site)
        path = out / src.name
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(path)
    return written


def site_url(config: dict) -> str:
    """The website's address: ``html.baseurl`` if ``_config.yml`` sets one, else the GitHub
    Pages address of ``repository.url`` (so a fork changes one line)."""
    base = config.get("html", {}).get("baseurl")
    if base:
        return base.rstrip("/") + "/"
    org, repo = config["repository"]["url"].rstrip("/").split("/")[-2:]
    return f"https://{org}.github.io/{repo}/"


def main(argv: list[str] | None = None) -> None:
    import yaml

    root = Path.cwd()
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    site = site_url(config)
    args = argv if argv is not None else sys.argv[1:]
    out = Path(args[0]) if args else root / "reader"
    for path in build(root, out, site):
        left = myst_left(json.loads(path.read_text(encoding="utf-8")))
        if left:
            raise SystemExit(f"{path}: MyST left in the reader edition: {left[:5]}")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
