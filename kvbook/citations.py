"""The book's citation labels: one author-year label per work, the same in the text, on the
References page and in the reader editions.

sphinxcontrib-bibtex's ``author_year`` style labels a citation in the text from the entry's
authors and year, while the References page shows the bibliography style's own labels
(``alpha``: "KLZ+23"), so the two never matched; and two works by the same authors in one
year were both cited "(Kwon et al., 2023)". Here one function, `labels`, decides every
label, and the site and the reader editions (`kvbook.reader`) both ask it:

* one author: "Shazeer, 2019"; two: "Milakov and Gimelshein, 2018"; three or more, or a list
  ending in ``and others``: "Kwon et al., 2023";
* an author in braces is a corporate author, cited whole: "Gemma Team, 2025";
* where two works would share a label, "2024a" and "2024b", in the References page's order:
  by the authors' names as printed (a corporate author's too: "DeepSeek-AI" among the Ds,
  where pybtex's own order puts every braced name after Z), then year, then title.

As a Sphinx extension (``kvbook.citations`` in ``_config.yml``) it registers the pybtex
style ``kvlib`` (the References page: ``bibtex_default_style``), which sorts and labels
entries this way, and the referencing style ``kvlib`` (``bibtex_reference_style``), which
cites by that label: "(Kwon et al., 2023a; Yu et al., 2022)", or "Kwon et al. (2023a)" for
``{cite:t}``.

>>> from kvbook.citations import bib_labels
>>> bib_labels('''@misc{p, author = {{PyTorch Team}}, title = {gpt-fast}, year = 2023}
... @misc{q, author = {{PyTorch Team}}, title = {Accelerating generative AI}, year = 2023}
... @misc{k, author = {Kwon, Woosuk and Li, Zhuohan and Stoica, Ion}, title = {vLLM}, year = 2023}
... ''')
{'k': 'Kwon et al., 2023', 'q': 'PyTorch Team, 2023a', 'p': 'PyTorch Team, 2023b'}
"""

from __future__ import annotations

import collections
import string
from dataclasses import dataclass, field
from typing import Iterable

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import join, node
from sphinxcontrib.bibtex.plugin import register_plugin as register_referencing
from sphinxcontrib.bibtex.style.referencing import BaseReferenceStyle, BracketStyle, GroupReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_label import BasicLabelParentheticalReferenceStyle
from sphinxcontrib.bibtex.style.referencing.extra_author import ExtraAuthorReferenceStyle
from sphinxcontrib.bibtex.style.referencing.extra_empty import ExtraEmptyReferenceStyle
from sphinxcontrib.bibtex.style.referencing.extra_label import ExtraLabelReferenceStyle
from sphinxcontrib.bibtex.style.template import post_text, pre_text, reference

STYLE = "kvlib"  # the name of both styles, for _config.yml


def _plain(latex: str) -> str:
    """BibTeX text as a reader sees it: ``Lebr{\\'o}n`` -> "Lebrón", ``{Gemma Team}`` -> "Gemma Team"."""
    return Text.from_latex(latex).render_as("text")


def _surnames(entry) -> tuple[list[str], bool]:
    """The authors' (or editors') surnames as printed, and whether the list ends ``and others``."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    others = bool(people) and str(people[-1]) == "others"
    return [_plain(" ".join(p.prelast_names + p.last_names)) for p in people[:-1 if others else None]], others


def authors(entry) -> str:
    """Who a work is cited by: "Shazeer", "Milakov and Gimelshein", "Kwon et al.", "Gemma Team"."""
    names, others = _surnames(entry)
    if not names:
        return _plain(entry.fields.get("organization", entry.fields.get("title", "Anonymous")))
    if others or len(names) > 2:
        return f"{names[0]} et al."
    return " and ".join(names)


def labels(entries: Iterable) -> dict[str, str]:
    """``{key: label}`` for pybtex entries, in the References page's order: "Kwon et al., 2023a"."""
    ordered = SortingStyle().sort(list(entries))
    base = {e.key: f"{authors(e)}, {e.fields.get('year', 'n.d.')}" for e in ordered}
    shared = collections.Counter(base.values())
    seen: collections.Counter = collections.Counter()
    out = {}
    for e in ordered:
        label = base[e.key]
        if shared[label] > 1:  # a second work would read the same: "2024a", "2024b"
            label += string.ascii_lowercase[seen[label]]
            seen[base[e.key]] += 1
        out[e.key] = label
    return out


def bib_labels(bib: str) -> dict[str, str]:
    """`labels` for a .bib file's text."""
    from pybtex.database import parse_string

    return labels(parse_string(bib, "bibtex").entries.values())


class SortingStyle(BaseSortingStyle):
    """The References page's order: authors' surnames as printed, year, title (case aside)."""

    def sorting_key(self, entry):
        names, _ = _surnames(entry)
        return ([n.casefold() for n in names], entry.fields.get("year", ""),
                _plain(entry.fields.get("title", "")).casefold())


class LabelStyle(BaseLabelStyle):
    """The References page's labels: `labels`."""

    def format_labels(self, sorted_entries):
        found = labels(sorted_entries)
        return [found[e.key] for e in sorted_entries]


class Style(UnsrtStyle):
    """The References page: pybtex's plain entries, sorted by authors, year and title, with
    author-year labels."""

    default_label_style = STYLE
    default_sorting_style = STYLE


@node
def label_authors(children, data) -> Text:
    """The authors part of an entry's label: "Kwon et al."."""
    return Text(data["formatted_entry"].label.rpartition(", ")[0])


@node
def label_year(children, data) -> Text:
    """The year part of an entry's label, its letter included: "2023a"."""
    return Text(data["formatted_entry"].label.rpartition(", ")[2])


@dataclass
class TextualReferenceStyle(BaseReferenceStyle):
    """``{cite:t}``: "Kwon et al. (2023a)", one link."""

    bracket: BracketStyle = field(default_factory=BracketStyle)

    def role_names(self) -> Iterable[str]:
        return [f"{capfirst}t{full}" for capfirst in ["", "c"] for full in ["", "s"]]

    def outer(self, role_name: str, children: list) -> object:
        return self.bracket.outer(children, brackets=False, capfirst="c" in role_name)

    def inner(self, role_name: str) -> object:
        return join(sep=" ")[pre_text, reference[join[label_authors, " (", label_year, ")"]], post_text]


@dataclass
class YearReferenceStyle(BaseReferenceStyle):
    """``{cite:year}``: the label's year, its letter included ("2023a")."""

    bracket: BracketStyle = field(default_factory=BracketStyle)

    def role_names(self) -> Iterable[str]:
        return ["year", "yearpar"]

    def outer(self, role_name: str, children: list) -> object:
        return self.bracket.outer(children, brackets="par" in role_name, capfirst=False)

    def inner(self, role_name: str) -> object:
        return reference[label_year]


@dataclass
class ReferenceStyle(GroupReferenceStyle):
    """Citations in the text, by the entry's label: "(Kwon et al., 2023a; Yu et al., 2022)"."""

    def __post_init__(self):
        # parentheses, and a semicolon between works: "2024, Qin et al., 2025" would read as one
        bracket = BracketStyle(left="(", right=")", sep="; ")
        self.styles.extend([
            BasicLabelParentheticalReferenceStyle(bracket=bracket),  # {cite}, {cite:p}
            TextualReferenceStyle(bracket=bracket),
            ExtraAuthorReferenceStyle(bracket=bracket),
            ExtraLabelReferenceStyle(bracket=bracket),
            YearReferenceStyle(bracket=bracket),
            ExtraEmptyReferenceStyle(),
        ])
        super().__post_init__()


def setup(app) -> dict:
    register_plugin("pybtex.style.sorting", STYLE, SortingStyle)
    register_plugin("pybtex.style.labels", STYLE, LabelStyle)
    register_plugin("pybtex.style.formatting", STYLE, Style)
    register_referencing("sphinxcontrib.bibtex.style.referencing", STYLE, ReferenceStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
