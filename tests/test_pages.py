"""One idea per page, and code that computes (issue 43).

A page holds about 4,500 words of prose at most, counted as ``wc -w`` counts them: past that
it becomes numbered sections (9.1, 9.2, ...). Its code shows the computation and prints its
numbers, each with a short label or in a table (`kvbook.table`); handing numbers to the
website's prose (`glue`), choosing words from a measurement, printing English sentences around
values and aligning a table by hand are plumbing, which a learner in Jupyter or Colab reads
too, so together they stay within 5% of a page's code lines. A page that does not yet meet a budget is named in
``EXCEPTIONS`` with its reason; the test fails as soon as it meets it, so the exception is
then removed."""

import ast
import json
import re
from pathlib import Path

import pytest

from test_book import without_magics

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "book").glob("*.ipynb"))
MAX_WORDS = 4_500
MAX_PLUMBING = 0.05

# page stem -> (budget it does not meet yet, why)
EXCEPTIONS: dict[str, tuple[str, str]] = {}


def source(cell: dict) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def prose_words(markdown: str) -> int:
    """Words a reader reads, counted as ``wc -w`` counts them: every whitespace-separated run
    of the Markdown, roles (``{glue:text}`x```, ``{doc}`ch04```) and inline math included;
    only display math and the fence and option lines of directives are left out."""
    text = re.sub(r"^(`{3,}|:{3,}).*$", "", markdown, flags=re.M)  # fence lines, not their bodies
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"^:[a-z-]+:.*$|^\([^()\s]+\)=\s*$", "", text, flags=re.M)
    return len(text.split())


SAYS = {"print", "say", "display", "Markdown", "HTML"}  # calls that put text in front of a reader
DRAWS = {"set_xlabel", "set_ylabel", "set_title", "suptitle", "legend", "annotate", "text",
         "set_xticklabels", "set_yticklabels", "set", "xlabel", "ylabel", "title"}  # a figure's own text


def _words(node: ast.AST) -> int:
    """The most words in one literal run of a string or f-string, a word being a
    whitespace-separated run with two letters in a row (``tokens/s`` and ``hash_algo`` are one
    word each): a label has three at most ("tokens per s", "cache share:"); four or more build
    a sentence."""
    runs = [node.value] if isinstance(node, ast.Constant) else (
        [v.value for v in node.values if isinstance(v, ast.Constant)] if isinstance(node, ast.JoinedStr) else [])
    return max((sum(bool(re.search(r"[A-Za-z]{2}", w)) for w in r.split()) for r in runs if isinstance(r, str)),
               default=0)


def _wordy(node: ast.AST) -> bool:
    """A string literal or f-string with two or more words in it: a word being chosen."""
    runs = [node.value] if isinstance(node, ast.Constant) else (
        [v.value for v in node.values if isinstance(v, ast.Constant)] if isinstance(node, ast.JoinedStr) else [])
    return any(isinstance(r, str) and len(re.findall(r"[A-Za-z]{2,}", r)) >= 2 for r in runs)


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def sentence_lines(tree: ast.AST) -> set[int]:
    """Lines that build an English sentence around values: an f-string with four or more words
    in one literal run, or such a string printed. Left out: docstrings, assert and error
    messages (they speak only when a check fails), and a figure's labels and titles."""
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    lines: set[int] = set()
    for node in ast.walk(tree):
        f_string = isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in node.values)
        literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if not (f_string or literal) or isinstance(parent.get(node), (ast.JoinedStr, ast.Expr)):
            continue  # a piece of an f-string, or a docstring
        if _words(node) < 4:
            continue
        said, skip, up, statement = False, False, parent.get(node), node
        while up is not None:
            if statement is node and isinstance(up, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)):
                statement = up  # the whole statement that builds or prints the sentence
            skip |= isinstance(up, (ast.Assert, ast.Raise)) or (
                isinstance(up, ast.keyword) and up.arg in ("label", "title", "xlabel", "ylabel"))
            if isinstance(up, ast.Call):
                skip |= _call_name(up) in DRAWS
                said |= _call_name(up) in SAYS
            up = parent.get(up)
        if not skip and (f_string or said):
            lines |= set(range(statement.lineno, statement.end_lineno + 1))
    return lines


WIDTH = re.compile(r"^(.?[<>^=])?[-+ ]?z?#?0?\d")  # a format spec that pads to a width: >7s, 10, 6.2f


def table_lines(tree: ast.AST) -> set[int]:
    """Lines that align a table by hand: an f-string that pads a value to a width
    (``f"{name:10s}{ms:7.2f}"``) or formats a label as a value (``f"{'tokens':>7s}"``), a
    ``str.ljust``/``rjust``/``center``, or ``%``-formatting with a width. Such a header line
    and row line per table are what `kvbook.table` is for: the cell collects its rows and
    the table's alignment is not the learner's to read."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        padded = False
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            spec = "".join(v.value if isinstance(v, ast.Constant) else "0" for v in node.format_spec.values)
            padded = bool(WIDTH.match(spec)) or isinstance(node.value, ast.Constant)
        elif isinstance(node, ast.Call):
            padded = _call_name(node) in ("ljust", "rjust", "center")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            padded = isinstance(node.left, ast.Constant) and bool(re.search(r"%-?\d+", str(node.left.value)))
        if padded:
            lines.add(node.lineno)
    return lines


def plumbing_lines(code: str) -> set[int]:
    """Lines of one cell that glue values, choose words from a value, or build sentences:
    every line of a ``glue(...)`` call; every line of a conditional expression with words in
    a branch (``"faster" if r > 1 else "slower"``); every line of an ``if`` whose branches only
    assign sentences (a verdict picked from a measurement); and every line of a printed
    sentence (``print(f"decode ran {r:.1f} times as fast")``: print ``"decode / prefill:"``
    and the number, and let the prose say what it means); and every line that aligns a table
    by hand (`table_lines`: `kvbook.table` prints a cell's rows)."""
    try:
        tree = ast.parse(without_magics(code))
    except SyntaxError:
        return set()
    lines = sentence_lines(tree) | table_lines(tree)
    span = lambda n: set(range(n.lineno, n.end_lineno + 1))  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if _call_name(node) == "glue":
                lines |= span(node)
        elif isinstance(node, ast.IfExp) and (_wordy(node.body) or _wordy(node.orelse)):
            lines |= span(node)
        elif isinstance(node, ast.If):
            branches = node.body + node.orelse
            if branches and all(isinstance(b, (ast.Assign, ast.If)) for b in branches) and any(
                    isinstance(b, ast.Assign) and _wordy(b.value) for b in branches):
                lines |= span(node)
    return lines


def page_stats(path: Path) -> dict:
    """Words of prose, lines of code (not blank, not comments; the hidden Colab install cell
    left out), and of those the plumbing lines."""
    cells = json.loads(path.read_text())["cells"]
    words = code = plumbing = 0
    for cell in cells:
        text = source(cell)
        if cell["cell_type"] == "markdown":
            words += prose_words(text)
        elif cell["cell_type"] == "code" and "remove-cell" not in cell["metadata"].get("tags", []):
            real = {i + 1 for i, line in enumerate(text.splitlines())
                    if line.strip() and not line.strip().startswith("#")}
            code += len(real)
            plumbing += len(plumbing_lines(text) & real)
    return {"words": words, "code": code, "plumbing": plumbing,
            "share": plumbing / code if code else 0.0}


def test_the_plumbing_count_can_fail():
    cell = ('r = t_a / t_b\n'
            'word = "faster than" if r > 1 else "no faster than"\n'
            'if r > 2:\n    verdict = "much faster, as the bytes say"\nelse:\n    verdict = f"only {r:.1f} times"\n'
            'glue("x_ratio", r,\n     display=False)\n'
            'kvbook.glue(x_t=t_a)\n'
            'print(f"ratio {r:.2f}")\n')
    assert plumbing_lines(cell) == {2, 3, 4, 5, 6, 7, 8, 9}
    said = ('print(f"decode ran {r:.1f} times as fast as prefill")\n'
            'print("the cache holds every token seen:",\n      n)\n'
            'msg = f"{n} tokens, of which {k} are in the cache"\n')
    assert plumbing_lines(said) == {1, 2, 3, 4}
    tables = ('print(f"{\'model\':12s}{\'ms\':>7s}")\n'
              'for name, r in rows.items():\n    print(f"{name:>12} {r:6.2f}")\n'
              'print(name.ljust(12), "%8.1f" % r)\n')
    assert plumbing_lines(tables) == {1, 3, 4}
    labels = ('print(f"step: {t:.1f} ms")\nx = "fp32" if fast else "bf16"\n'
              'print(f"{name}: {r:.2f}", f"{n:,} tokens")\nprint("decode / prefill:", r)\n'
              'print(cfg["prefix_caching_hash_algo"], f"{n} tokens/s at batch {b}")\n'
              'assert r > 1, f"decode should be faster than this: {r}"\n'
              'ax.set_title(f"the cache of every layer at batch {b}")\n'
              'ax.plot(x, y, label=f"tokens the cache holds at {b}")\n'
              'def f():\n    \"\"\"A docstring of many words is no sentence built.\"\"\"\n'
              'chat = [{"role": "user", "content": "Name three planets of the solar system."}]\n')
    assert plumbing_lines(labels) == set()


def test_the_word_count_leaves_out_display_math_fences_and_options():
    md = ("A cache of {glue:text}`ch4_gb:.1f` GB.\n\n$$\nx = 2 \\cdot L\n$$\n\n"
          "```{exercise-start}\n:label: ch4-ex1\n```\nWork it out.\n")
    assert prose_words(md) == 8  # "A cache of", the role, "GB.", "Work it out."
    assert prose_words("The cost is $2 \\cdot L$ bytes.") == 7


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_a_page_holds_one_idea_and_its_code_computes(path):
    stats = page_stats(path)
    failing = []
    if stats["words"] > MAX_WORDS:
        failing.append(f"words: {stats['words']:,} words of prose, over {MAX_WORDS:,}: split it into sections")
    if stats["share"] > MAX_PLUMBING:
        failing.append(f"plumbing: {stats['plumbing']} of {stats['code']} code lines ({stats['share']:.1%}) glue "
                       "values, build sentences or align tables, over 5%: print the numbers (kvbook.table "
                       "for a table), and let the prose interpret them")
    allowed = EXCEPTIONS.get(path.stem)
    kinds = {f.split(":")[0] for f in failing}
    if allowed:
        assert allowed[0] in kinds, (f"{path.stem} now meets its {allowed[0]} budget ({stats}): "
                                     "remove its entry from EXCEPTIONS")
        kinds.discard(allowed[0])
    assert not kinds, "; ".join(f for f in failing if f.split(":")[0] in kinds)


def test_every_exception_names_a_page_a_budget_and_a_reason():
    stems = {p.stem for p in PAGES}
    for stem, (budget, why) in EXCEPTIONS.items():
        assert stem in stems and budget in ("words", "plumbing") and len(why) > 20, stem


# -- the back-matter page about the book's machinery names every stored record truly -----------------
def record_rows(page: str) -> dict[str, str]:
    """``{"vllmcheck/data/vllm_cpu.json": "<its table row>"}`` from the records table of book/checks.md."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w./]+\.json)` \|.*$", page, re.M)}


def record_facts(record: dict) -> list[str]:
    """What the page must say of a record: its date, and the versions of the engines it ran."""
    machine = record.get("machine", {})
    facts = [machine["date"][:10]] if "date" in machine else [machine.get("capability", "?")]
    facts += [v for k, v in record.get("versions", {}).items() if k in ("kvpress", "transformers")]
    if "vllm_version" in record:
        facts.append(record["vllm_version"])
    return facts


def test_the_checks_page_names_each_record_its_run_and_date():
    page = (ROOT / "book" / "checks.md").read_text()
    rows = record_rows(page)
    records = sorted(p.relative_to(ROOT).as_posix() for top in ("kvlib", "kvbench", "vllmcheck", "kvpresscheck")
                     for p in (ROOT / top / "data").glob("*.json"))
    assert sorted(rows) == records, "the table should list exactly the records in kvlib's and the harnesses' data/"
    for name in records:
        for fact in record_facts(json.loads((ROOT / name).read_text())):
            assert fact in rows[name], f"{name}: the page's row does not say {fact!r}"


def test_the_record_check_can_fail():
    page = "| `a.json` | x | y | vLLM 0.31.0, 2026-12-02 |\n"
    assert record_rows(page) == {"a.json": page.strip()}
    facts = record_facts({"machine": {"date": "2026-12-03T10:00"}, "vllm_version": "0.32.0"})
    assert facts == ["2026-12-03", "0.32.0"] and not all(f in page for f in facts)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_a_page_glues_through_kvbook_glue_only(path):
    """`kvbook.glue` refuses sentences; myst_nb's own glue would take them."""
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join(source(c) for c in cells if c["cell_type"] == "code")
    assert not re.search(r"^\s*(from myst_nb import|import myst_nb)", code, re.M), \
        "glue numbers with kvbook.glue(name=value), not myst_nb's glue"
