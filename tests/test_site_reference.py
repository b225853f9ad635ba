"""The built site's kvlib reference and citations, as a reader meets them (issue 44, items 8 and 11).

* A name in a docstring reads as code, never as italics, and a name of kvlib's reads as a link
  to its own entry (kvlib's docstrings write names in single backticks, which reStructuredText
  renders as an italic ``<cite>`` unless a default role says otherwise).
* A chapter's kvlib link opens the entry of the object it names, not the top of its module.
* A citation shows the same label as the entry it opens on the References page, and no two
  entries share a label.

Most checks read the built HTML (``make book`` first); the last opens a docstring link in Chromium.
"""

from __future__ import annotations

import collections
import html
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

from test_site import browser, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.cpu_only("drives Chromium over the built site")

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
CALL = re.compile(r"\(.*\)$")  # `load_smollm2()`, ``kvlib.causal_mask(1, n)``: the name is before it


def soup(path: Path):
    from bs4 import BeautifulSoup  # nbconvert's dependency: no package of our own

    if not path.is_file():
        pytest.fail(f"{path} is not built: run `make book` first")
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser").select_one("article.bd-article")


def reference_pages() -> dict[str, object]:
    return {p.name: soup(p) for p in sorted((SITE / "book" / "api").glob("*.html")) if p.name != "index.html"}


def entries(pages: dict) -> dict[str, tuple[str, str]]:
    """Every documented object -> (page, the id its entry carries): ``kvlib.memory`` ->
    ``module-kvlib.memory``, ``kvlib.memory.kv_cache_bytes`` -> itself."""
    out = {}
    for name, article in pages.items():
        for dt in article.select("dt.sig[id]"):
            out[dt["id"]] = (name, dt["id"])
        for section in article.select("section[id^='module-']"):
            out[section["id"].removeprefix("module-")] = (name, section["id"])
    return out


def docstring_names(article):
    """(element, name) for each inline name in a page's docstrings: ``<cite>`` is what a single
    backtick gave without a default role, ``<code>`` a literal; signatures are not docstrings."""
    for el in article.find_all(["cite", "code"]):
        if el.find_parent("dt") is None:
            yield el, CALL.sub("", el.get_text()).strip()


def test_no_name_in_the_reference_is_set_in_italics():
    pages = reference_pages()
    italic = collections.Counter(el.get_text() for page in pages.values() for el in page.find_all("cite"))
    assert not italic, (f"{sum(italic.values())} names in the reference render as italic <cite> "
                        f"(a single backtick without a default role), e.g. {sorted(italic)[:8]}")


def test_kvlib_names_in_docstrings_link_to_their_own_entries():
    """Each name a docstring writes that means one documented kvlib object is a link to that
    object's entry: a full dotted name (``kvlib.memory``, ``kvlib.generate``, which is the
    function kvlib exports, as in the chapters), a dotted name only one entry ends with
    (``PagedCache.step``, ``tp.plan``), or a class's bare name only one entry has. A bare
    lowercase name is left to context (a parameter ``cache`` is not a link) and not required."""
    import kvlib

    pages = reference_pages()
    known = entries(pages)
    ends = collections.defaultdict(set)
    for full in known:
        parts = full.split(".")
        for i in range(1, len(parts)):
            ends[".".join(parts[i:])].add(full)
    exported = {f"kvlib.{n}": f"{getattr(kvlib, n).__module__}.{getattr(kvlib, n).__qualname__}"
                for n in kvlib.__all__ if hasattr(getattr(kvlib, n), "__qualname__")}

    def meant(name: str) -> str | None:
        if name in exported:
            return exported[name]
        if name in known:
            return name
        if ("." in name or name[:1].isupper()) and len(ends.get(name, ())) == 1:
            return next(iter(ends[name]))
        return None

    linked, unlinked = 0, []
    for page, article in pages.items():
        for el, name in docstring_names(article):
            full = meant(name)
            if full is None:
                continue
            a = el.find_parent("a")
            target_page, anchor = known[full]
            href = a.get("href", "") if a else ""
            if href.partition("#")[2] != anchor or href.partition("#")[0] not in ("", target_page):
                unlinked.append(f"{page}: {name} ({href or 'no link'})")
            else:
                linked += 1
    assert not unlinked, (f"{len(unlinked)} kvlib names in docstrings are not links to their entries "
                          f"({linked} are), e.g. {unlinked[:6]}")
    assert linked > 500, f"only {linked} kvlib names in the docstrings link to their entries"


def named_object(name: str):
    """What a full dotted ``kvlib...`` name is in Python after ``import kvlib``: attributes first
    (``kvlib.attention`` is the function kvlib exports, not its module); where that path fails
    (``kvlib.attention.attend``), the object in the longest module the name starts with."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])  # kvlib, or a package of the tooling beside it
    for attr in parts[1:]:
        obj = getattr(obj, attr, None)
        if obj is None:
            break
    else:
        return obj
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(name)


def entry_id(obj) -> str | None:
    """The id of the entry that documents a Python object (None for data: any module listing it)."""
    if isinstance(obj, ModuleType):
        return f"module-{obj.__name__}"
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return None


def meant_by(name: str) -> list:
    """What a name a chapter writes can mean: a full ``kvlib...`` name (or the tooling's beside it,
    ``kvbook.table``, ``vllmcheck.run``), or one relative to kvlib or to any of its modules
    (``tp.plan``, ``distcheck.load_record``, ``PagedCache.step``)."""
    from test_apiref import all_modules

    first, _, rest = name.partition(".")
    full = first in ("kvlib", "kvbook", "kvbench", "vllmcheck", "kvpresscheck")
    candidates = [name] if full else [f"kvlib.{name}"] + [
        f"{m}.{rest}" for m in all_modules() if rest and m.endswith(f".{first}")]
    found = []
    for candidate in candidates:
        try:
            found.append(named_object(candidate))
        except (AttributeError, ImportError, LookupError):
            pass
    return found


# a chapter's link to the reference, and the dotted code that goes on after it, if any
LINK_AND_REST = (r'<a class="[^"]*\bkvlib-api\b[^"]*" href="([^"]+)"[^>]*>(.*?)</a>'
                 r'((?:<span class="o">\.</span><span class="n">\w+</span>)*)')


def test_a_chapters_link_opens_the_entry_of_what_it_names():
    """``kvlib.hardware.fast_dtype()`` in a code cell opened the top of kvlib.hardware's section
    (fast_dtype is kvlib.native's, imported into kvlib.hardware): the link must open the
    function's own entry. A module's name opens its module; a class or function, its entry."""
    wrong, checked = [], 0
    for ch in sorted((SITE / "book").glob("ch*.html")):
        text = ch.read_text(encoding="utf-8")
        for m in re.finditer(LINK_AND_REST, text, re.S):
            href, name = m.group(1), CALL.sub("", html.unescape(re.sub(r"<[^>]+>", "", m.group(2)))).strip()
            anchor = href.partition("#")[2]
            if m.group(3):  # code that goes on past the link: ``kvlib.hardware`` + ``.fast_dtype``
                whole = name + re.sub(r"<[^>]+>", "", m.group(3))
                if {entry_id(obj) for obj in meant_by(whole)} - {None}:
                    wrong.append(f"{ch.name}: {whole} is linked only as far as {name}")
            wants = {entry_id(obj) for obj in meant_by(name)} - {None}
            checked += 1
            if len(wants) == 1 and anchor not in wants:
                wrong.append(f"{ch.name}: {name} -> #{anchor}, not #{wants.pop()}")
            elif not wants and not anchor.removeprefix("module-").endswith(name):  # data, or not importable
                wrong.append(f"{ch.name}: {name} -> #{anchor}")
    assert checked > 500 and not wrong, f"{len(wrong)} of {checked} links open the wrong entry: {wrong}"


# -- citations -------------------------------------------------------------------------------------
LABEL = re.compile(r"^\S.*, (\d{4}[a-z]?|n\.d\.)$")  # "Kwon et al., 2023a", "Gemma Team, 2025"


def bibliography() -> dict[str, str]:
    """The References page: each entry's id -> the label it shows (its brackets aside)."""
    article = soup(SITE / "book" / "references.html")
    out = {}
    for entry in article.select("div.citation[id]"):
        label = entry.select_one("span.label")
        for bracket in label.select("span.fn-bracket"):
            bracket.extract()
        out[entry["id"]] = label.get_text().strip()
    return out


def test_each_work_has_its_own_author_year_label():
    labels = bibliography()
    shared = {lab: n for lab, n in collections.Counter(labels.values()).items() if n > 1}
    odd = sorted(lab for lab in labels.values() if not LABEL.match(lab) or " and others" in lab)
    assert len(labels) > 50 and not shared and not odd, \
        f"labels shared by two works: {shared}; not author-year: {odd}"


def test_every_citation_shows_the_label_of_the_entry_it_opens():
    labels = bibliography()
    wrong, ids, cited = [], collections.defaultdict(set), 0
    for page in sorted(SITE.rglob("*.html")):
        article = soup(page) if "bibtex-citation" in page.read_text(encoding="utf-8") else None
        for a in article.select("span.bibtex-citation a[href*='references.html#']") if article else ():
            shown, anchor = a.get_text().strip(), a["href"].partition("#")[2]
            ids[shown].add(anchor)
            cited += 1
            if labels.get(anchor) != shown:
                wrong.append(f"{page.relative_to(SITE)}: {shown!r} opens {labels.get(anchor)!r}")
    two = {shown: sorted(targets) for shown, targets in ids.items() if len(targets) > 1}
    assert cited > 100 and not two and not wrong, (f"one label for two works: {two}; {len(wrong)} citations "
                                                   f"differ from their entry: {sorted(set(wrong))[:8]}")


def test_the_reader_editions_cite_with_the_sites_labels():
    """kvbook.reader labels citations itself (Colab shows no Sphinx): by key, its labels are
    the References page's (an entry's id is ``ref-`` and its key)."""
    from kvbook.reader import bib_citations

    site = {anchor.removeprefix("ref-"): label for anchor, label in bibliography().items()}
    reader = bib_citations((ROOT / "references.bib").read_text(encoding="utf-8"))
    differ = {k: (reader.get(k), site.get(k)) for k in sorted(set(site) | set(reader))
              if reader.get(k) != site.get(k)}
    assert not differ, f"reader edition vs site, by key: {differ}"


def test_a_docstring_link_opens_its_entry_in_chromium(server, browser):  # noqa: F811
    """Chapter 9's reference page: ``PagedCache`` named in another entry's docstring opens
    PagedCache's entry, in view."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{server}/book/api/paging.html", wait_until="load")
    links = page.locator("dd a.reference.internal:has(code)", has_text=re.compile(r"^PagedCache$"))
    assert links.count() > 0, "no docstring on the paging page links PagedCache"
    links.first.click()
    page.wait_for_load_state("load")
    entry = page.locator("[id='kvlib.paged.cache.PagedCache']")
    assert entry.count() == 1 and entry.is_visible() and entry.evaluate(
        "e => { const r = e.getBoundingClientRect(); return r.top >= 0 && r.top < innerHeight; }"), page.url
    page.close()
