"""kvlib's reference pages (`kvbook.apiref`): every module on one page, pages up to date,
and, in the built site, an entry for every public name and chapter links that land on one."""

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

from kvbook.apiref import GROUPS, all_modules, pages

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "book" / "api"
SITE = ROOT / "_build" / "html"


def test_every_module_is_on_exactly_one_page():
    listed = [m for _, _, _, modules, _ in GROUPS for m in modules]
    assert sorted(listed) == sorted(set(listed)), "a module on two pages"
    assert sorted(listed) == all_modules(), "GROUPS and kvlib's modules differ: add the new module to a group"


def test_the_pages_are_what_apiref_writes():
    for name, text in pages().items():
        path = API / name
        assert path.is_file() and path.read_text(encoding="utf-8") == text, \
            f"{path} is out of date: run `python -m kvbook.apiref book/api`"
    assert sorted(p.name for p in API.glob("*.md")) == sorted(pages())


def public_names() -> list[tuple[str, str, str | tuple[str, ...]]]:
    """(module, name, the entry's id or ids) for every name in kvlib's and each module's ``__all__``."""
    out = []
    for m in all_modules():
        mod = importlib.import_module(m)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if isinstance(obj, ModuleType):
                target = f"module-{obj.__name__}"
            elif hasattr(obj, "__qualname__") and hasattr(obj, "__module__") and obj.__module__.startswith("kvlib"):
                target = f"{obj.__module__}.{obj.__qualname__}"  # documented where it is defined
            else:  # data: documented (a `#:` comment) in one of the modules that hold it
                target = tuple(f"{h}.{name}" for h in all_modules()
                               if importlib.import_module(h).__dict__.get(name) is obj)
            out.append((m, name, target))
    return out


def built(path: Path) -> str:
    if not path.is_file():
        pytest.fail(f"{path} is not built: run `make book` first")
    return path.read_text(encoding="utf-8")


def test_every_public_name_has_an_entry_in_the_built_reference():
    ids = set()
    for name in pages():
        ids |= set(re.findall(r'id="([^"]+)"', built(SITE / "book" / "api" / name.replace(".md", ".html"))))
    names = public_names()
    missing = [(m, n, t) for m, n, t in names if not ({t} if isinstance(t, str) else set(t)) & ids]
    assert len(names) > 100 and not missing, f"public names with no reference entry: {missing[:10]}"


def test_every_chapter_link_lands_on_an_entry():
    chapters = sorted((SITE / "book").glob("ch*.html"))
    links = 0
    for ch in chapters:
        for href in re.findall(r'<a class="[^"]*\bkvlib-api\b[^"]*" href="([^"]+)"', built(ch)):
            page, _, anchor = href.partition("#")
            target = built((ch.parent / page).resolve())
            assert f'id="{anchor}"' in target, f"{ch.name}: {href} lands on no entry"
            links += 1
    assert len(chapters) >= 15 and links > 100, f"only {links} links from the chapters to the reference"
