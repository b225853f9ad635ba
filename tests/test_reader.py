"""The reader editions (reader/*.ipynb): what Colab and the download button open.

Each must hold no MyST (Jupyter and Colab would show it as raw markup), run the chapter's
own code, and be up to date with its chapter: rebuilt from the chapter and what the build
resolved (stored in the edition), it is the committed file again. They are executed by
the portable CI job (scripts/portable_run.sh), as a Colab reader runs them.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from kvbook.reader import bib_citations, edition, myst_left, site_url

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("ch*.ipynb"))
SITE = "https://example.org/book/"


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_an_up_to_date_reader_edition_with_no_myst(chapter):
    path = ROOT / "reader" / chapter.name
    assert path.is_file(), f"no reader edition of {chapter.name}: run `make reader`"
    stored = load(path)
    assert myst_left(stored) == [], "MyST syntax left where Colab opens it"
    resolved = stored["metadata"]["kvlib_reader"]
    site = site_url(yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8")))
    try:
        again = edition(load(chapter), f"book/{chapter.stem}.html", resolved, site)
    except KeyError as missing:
        pytest.fail(f"{chapter.name} changed since its reader edition was made ({missing}): run `make reader`")
    assert again == stored, f"{path} is out of date with {chapter.name}: run `make reader`"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_reader_edition_runs_the_chapters_own_code(chapter):
    path = ROOT / "reader" / chapter.name
    if not path.is_file():
        pytest.fail(f"no reader edition of {chapter.name}: run `make reader`")
    code = ["".join(c["source"]) for c in load(chapter)["cells"] if c["cell_type"] == "code"]
    ours = [re.sub(r"\A#@title [^\n]*\n", "", "".join(c["source"]))
            for c in load(path)["cells"] if c["cell_type"] == "code"]
    assert ours == code


def notebook(*cells):
    return {"cells": [{"cell_type": kind, "metadata": meta, "source": src, **({"outputs": [],
             "execution_count": None} if kind == "code" else {})} for kind, src, meta in cells],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


RESOLVED = {
    "built": "a test",
    "glue": {"ms": "12.3456", "verdict": "'flat, as the model says'", "n": "4096"},
    "refs": {"ch2-ex1": ["book/ch02.html#ch2-ex1", "Exercise 4"],
             "fig-x": ["book/ch02.html#fig-x", "Fig. 3"],
             "sec-y": ["book/ch05.html#sec-y", "Why it paid less"],
             "ch09_paging": ["book/ch09_paging.html", "Paging the cache"]},
    "cites": {"kwon2023": "Kwon et al., 2023"},
}
TOY = notebook(
    ("markdown", "(ch2)=\n# A chapter\n\nA step took {glue:text}`ms:.1f` ms, {glue:text}`verdict`; "
                 "{glue:text}`n:,` tokens. See {numref}`fig-x`, {ref}`sec-y`, {ref}`that part <sec-y>`, "
                 "{doc}`ch09_paging` and {cite}`kwon2023`, as argued {cite:p}`kwon2023`.", {}),
    ("code", "plot()", {"tags": ["hide-input"], "mystnb": {"figure": {"name": "fig-x", "caption": "Steps."}}}),
    ("markdown", ":::{note}\nA note with {glue:text}`n`.\n:::", {}),
    ("markdown", "```{exercise-start}\n:label: ch2-ex1\n```\nDo this.\n\nThen that.\n```{exercise-end}\n```", {}),
    ("markdown", "```{solution-start} ch2-ex1\n:class: dropdown\n```\nBecause.", {}),
    ("code", "answer = 42", {}),
    ("markdown", "```{solution-end}\n```", {}),
    ("markdown", "After the exercises.", {}),
    ("markdown", "```{admonition} An aside\n:class: dropdown\nIt took {glue:text}`ms:.0f` ms.\n```", {}),
    ("code", "side()", {"tags": ["hide-cell"]}),
)


def test_each_myst_form_becomes_what_jupyter_renders():
    out = edition(TOY, "book/ch02.html", RESOLVED, SITE)
    md = ["".join(c["source"]) for c in out["cells"] if c["cell_type"] == "markdown"]
    first = md[0]
    assert first.startswith('<a id="ch2"></a>\n# A chapter')
    assert "<em>12.3</em> ms, <em>flat, as the model says</em>; <em>4,096</em> tokens" in first
    assert "[Fig. 3](#fig-x)" in first  # the same page: an anchor
    assert f"[Why it paid less]({SITE}book/ch05.html#sec-y)" in first  # another page: the website
    assert f"[that part]({SITE}book/ch05.html#sec-y)" in first
    assert f"[Paging the cache]({SITE}book/ch09_paging.html)" in first
    assert f"([Kwon et al., 2023]({SITE}book/references.html#ref-kwon2023))" in first
    assert f"as argued ([Kwon et al., 2023]({SITE}book/references.html#ref-kwon2023))" in first
    assert "reader edition" in first and "a test" in first  # the numbers are marked as the build's
    assert md[1] == '<a id="fig-x"></a>\n\n*Fig. 3.* Steps.'  # the caption under its figure
    assert md[2] == "> **Note**\n>\n> A note with <em>4096</em>."
    assert md[3] == '<a id="ch2-ex1"></a>\n\n> **Exercise 4**\n>\n> Do this.\n>\n> Then that.'
    assert md[4].startswith("**Solution to Exercise 4**") and "<details>" in md[4] and "Because." in md[4]
    assert md[-2] == "After the exercises."  # the solution ended: not folded, not quoted
    assert md[-1] == "<details><summary>An aside</summary>\n\nIt took <em>12</em> ms.\n\n</details>"
    plot, answer, aside = [c for c in out["cells"] if c["cell_type"] == "code"]
    assert aside["metadata"]["cellView"] == "form" and "".join(aside["source"]).startswith("#@title An aside")
    assert plot["metadata"]["cellView"] == "form" and plot["metadata"]["jupyter"]["source_hidden"]
    assert answer["metadata"]["cellView"] == "form" and "".join(answer["source"]).startswith(
        "#@title Solution to Exercise 4 (code)\n")
    assert myst_left(out) == [] and len(myst_left(TOY)) >= 10  # the check sees every form
    assert out["metadata"]["kvlib_reader"] == RESOLVED


@pytest.mark.parametrize("text", ["{glue:text}`x`", "{numref}`fig`", "```{exercise-start}\n```",
                                  ":::{note}\nx\n:::", "(label)=", ":label: ch1-ex1", "{cite}`a`"])
def test_myst_left_finds_each_form(text):
    assert myst_left(notebook(("markdown", text, {})))


def test_a_value_the_build_did_not_glue_is_an_error_not_a_blank():
    bad = notebook(("markdown", "took {glue:text}`missing:.1f` ms", {}))
    with pytest.raises(KeyError, match="missing"):
        edition(bad, "book/ch02.html", RESOLVED, SITE)


def test_citations_in_the_sites_author_year_style():
    bib = ("@article{a1,\n  author = {Kwon, Woosuk and Li, Zhuohan and Stoica, Ion},\n  year = {2023},\n}\n"
           "@misc{b2,\n  author = {Leviathan, Yaniv and Kalman, Matan},\n  year = {2023},\n}\n")
    assert bib_citations(bib) == {"a1": "Kwon et al., 2023", "b2": "Leviathan and Kalman, 2023"}


def test_a_corporate_author_is_cited_by_its_whole_name():
    """Braces make an author corporate: "[Team, 2025]" for Gemma Team, "(He and Lab, 2025)" and
    "[authors, 2025]" were what the reader editions printed before."""
    bib = ("@article{g,\n  author = {{Gemma Team}},\n  year = {2025}\n}\n"
           "@misc{h,\n  author = {He, Horace and {Thinking Machines Lab}},\n  year = {2025},\n}\n"
           "@misc{l,\n  author = {{The LMCache authors}},\n  year = {2025},\n}\n"
           "@article{d,\n  author = {Dubey, Abhimanyu and others},\n  year = {2024},\n}\n"
           "@misc{s,\n  author = {{Anderson and Brown Labs}},\n  year = {2023},\n}\n")
    assert bib_citations(bib) == {"g": "Gemma Team, 2025", "h": "He and Thinking Machines Lab, 2025",
                                  "l": "The LMCache authors, 2025", "d": "Dubey et al., 2024",
                                  "s": "Anderson and Brown Labs, 2023"}


def test_two_works_that_would_share_a_label_are_told_apart_by_a_letter():
    """Two DeepSeek-AI reports of 2024 were both "(DeepSeek-AI, 2024)"; the letters follow the
    References page's order (authors, year, title), as the website's labels do."""
    bib = ("@article{v3,\n  author = {{DeepSeek-AI}},\n  title = {DeepSeek-V3 Technical Report},\n  year = {2024}\n}\n"
           "@article{v2,\n  author = {{DeepSeek-AI}},\n  title = {DeepSeek-V2: A Strong MoE},\n  year = {2024}\n}\n"
           "@misc{x,\n  author = {Xie, Zhiqiang},\n  title = {HiCache},\n  year = {2024}\n}\n")
    assert bib_citations(bib) == {"v2": "DeepSeek-AI, 2024a", "v3": "DeepSeek-AI, 2024b", "x": "Xie, 2024"}


def test_a_page_is_named_by_its_own_title_whatever_other_links_say(tmp_path):
    """A bare {doc} shows the page's title; a link elsewhere with words of its own must not
    decide what the reader edition calls the page (pages are read in name order)."""
    from kvbook.reader import site_references

    (tmp_path / "a.html").write_text('<a class="reference internal" href="b.html"><span class="doc">'
                                     'chapter 2</span></a>')
    (tmp_path / "b.html").write_text('<h1><span class="section-number">2. </span>Title B<a class="headerlink" '
                                     'href="#t">#</a></h1>')
    assert site_references(tmp_path)["b"] == ["b.html", "Title B"]
