"""kvlib's reference on the website: pages built from its docstrings, linked to the chapters.

``python -m kvbook.apiref book/api`` writes one MyST page per group of modules, in the
order the chapters meet them, each module rendered by Sphinx's autodoc from its own
docstrings (`GROUPS`). The pages are committed; ``tests/test_apiref.py`` checks that every
kvlib module is on exactly one page and that the pages are what this module writes.

As a Sphinx extension (``kvbook.apiref`` in ``_config.yml``) it links both ways:

* in a chapter, the first inline-code mention of a public kvlib name (```kvlib.generate```,
  ```PagedCache.step```, ```tp.plan```) becomes a link to that name's reference entry, and so
  does the first use in its code cells of each name the prose did not link;
* each reference entry lists the chapters that mention or use it ("Taught in");
* in the reference itself, a name a docstring writes in backticks (`PagedCache`, ``tp.plan``)
  is code (the default role ``literal``, not reStructuredText's italic title) and links to
  its entry when it means one documented object, read where it is written (a parameter
  stays code).

A name is linked only when it resolves to one documented object: a full dotted name, a
top-level ``kvlib.X``, a module-relative ``module.X``, or a bare name or ``Class.method``
that no other documented object shares (in code, a bare name only if it is a class's). A
name a module imports from another (``kvlib.hardware.fast_dtype``, kvlib.native's) opens
the entry where it is defined.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

from kvbook.docstrings import link_docstrings

# (slug, title, chapters that teach it, modules, one line on what the page holds)
KVLIB_GROUPS = [
    ("model", "The model and its caches", ["ch01_naive", "ch02_prefill_decode", "ch02b_numerics",
                                            "ch03_where_cache_lives", "ch14_find_the_bug"],
     ["kvlib", "kvlib.config", "kvlib.model", "kvlib.rope", "kvlib.attention", "kvlib.generate", "kvlib.sampling",
      "kvlib.cache", "kvlib.cache.protocol", "kvlib.cache.dynamic", "kvlib.cache.static", "kvlib.check",
      "kvlib.grade", "kvlib.grade.result", "kvlib.grade.storage", "kvlib.grade.compute", "kvlib.numerics", "kvlib.invariant", "kvlib.pretrained", "kvlib.hf", "kvlib.data", "kvlib.chat"],
     "the decoder, the generation loops, the cache protocol and its two plain caches, the checks and graders"),
    ("sizes", "Sizes, costs and hardware", ["ch04_how_big", "ch05_step_time"],
     ["kvlib.memory", "kvlib.cost", "kvlib.hardware"],
     "how many bytes a cache takes, what a step costs, and what a machine can do"),
    ("batches", "Batches", ["ch06_padding"], ["kvlib.padding"],
     "prompts of different lengths in one batch"),
    ("sharing", "Sharing and quantizing the cache", ["ch07_sharing_kv", "ch07b_layer_shapes",
                                                      "ch08_quantization"],
     ["kvlib.gqa", "kvlib.mla", "kvlib.layers", "kvlib.hybrid", "kvlib.quant", "kvlib.fp8", "kvlib.wquant"],
     "fewer KV heads, latent caches, layers that keep less, and fewer bits per number"),
    ("paging", "Paging and the engine", ["ch09_paging", "ch09b_serving_blocks", "ch12b_prefix_reuse",
                                          "ch12c_engines"],
     ["kvlib.paged", "kvlib.paged.blocks", "kvlib.paged.cache", "kvlib.paged.batch", "kvlib.paged.varlen", "kvlib.paged.hybrid",
      "kvlib.paged.kernel", "kvlib.paged.trace", "kvlib.paged.replay", "kvlib.simulate", "kvlib.scheduler",
      "kvlib.engine", "kvlib.radix"],
     "blocks, block tables, prefix caching, and the engine that schedules them"),
    ("long", "Long contexts", ["ch10_long_context", "ch10a_budget_limits", "ch10b_compression"],
     ["kvlib.evict", "kvlib.press", "kvlib.needle", "kvlib.evaluate"],
     "caches under a budget, and prompt compression"),
    ("speed", "Decoding fast", ["ch05_step_time", "ch11_decode_fast", "ch11b_weight_formats", "ch11c_gpu"],
     ["kvlib.kernels", "kvlib.native", "kvlib.prepack", "kvlib.piecewise", "kvlib.packed", "kvlib.timing"],
     "the kernels, the packed weights, and timing"),
    ("serving", "Serving", ["ch12_serving", "ch12c_engines"], ["kvlib.speculative"],
     "speculative decoding"),
    ("distributed", "Beyond one machine", ["ch13_beyond_one_machine", "ch13b_disaggregation"],
     ["kvlib.distributed", "kvlib.distributed.launch", "kvlib.distributed.tp", "kvlib.distributed.disagg",
      "kvlib.distributed.disk", "kvlib.distributed.cachekind", "kvlib.distributed.chunkfile",
      "kvlib.distributed.tiered", "kvlib.distributed.cluster"],
     "tensor parallelism, disaggregated prefill and decode, a disk tier, and the cluster's arithmetic"),
    ("support", "Validation", [], ["kvlib.validate"], "the checks behind kvlib's clear errors"),
]
# The packages beside kvlib (they import it; `import kvlib` loads none of them): a section of their own.
TOOLING_GROUPS = [
    ("harnesses", "The cross-checks and the benchmark",
     ["ch04_how_big", "ch09b_serving_blocks", "ch10b_compression", "ch11_decode_fast", "ch11b_weight_formats",
      "ch11c_gpu", "ch12_serving", "ch12c_engines", "ch13_beyond_one_machine", "ch13b_disaggregation"],
     ["vllmcheck", "vllmcheck.workload", "vllmcheck.driver", "vllmcheck.compare", "vllmcheck.kvlib_side",
      "vllmcheck.vllm_side", "vllmcheck.traces", "vllmcheck.vllm_trace", "vllmcheck.distributed",
      "vllmcheck.vllm_distributed",
      "kvpresscheck", "kvpresscheck.reference", "kvpresscheck.workload", "kvpresscheck.driver",
      "kvpresscheck.compare", "kvpresscheck.kvlib_side", "kvpresscheck.kvpress_side",
      "kvbench", "kvbench.plan", "kvbench.generation", "kvbench.huggingface", "kvbench.roofline",
      "kvbench.precision", "kvbench.split_kv", "kvbench.compiled", "kvbench.invariant",
      "kvbench.serving", "kvbench.paged_read", "kvbench.report", "kvbench.cli", "kvbench.gpu",
      "kvbench.gpubench",
      "kvbench.gpurecord"],
     "vLLM and NVIDIA's kvpress run beside kvlib (`vllmcheck`, `kvpresscheck`), and the benchmark (`kvbench`)"),
    ("tooling", "The book's tooling", [],
     ["kvbook", "kvbook.tables", "kvbook.plot", "kvbook.diagrams", "kvbook.explorer",
      "kvbook.knobs", "kvbook.knobs.masks", "kvbook.knobs.quant", "kvbook.knobs.speculative", "kvbook.knobs.step",
      "kvbook.pool", "kvbook.pooltrace",
      "kvbook.requires", "kvbook.reader", "kvbook.web", "kvbook.site", "kvbook.lean",
      "kvbook.apiref", "kvbook.docstrings", "kvbook.citations", "kvbook.search"],
     "what builds this book (`kvbook`): figures, tables, glue, the reader editions and the site"),
]
GROUPS = KVLIB_GROUPS + TOOLING_GROUPS
PACKAGES = ("kvlib", "kvbook", "kvbench", "vllmcheck", "kvpresscheck")  # what the reference documents


def all_modules() -> list[str]:
    """Every module and package of kvlib and of the tooling beside it (``__main__`` entry points and private
    modules, such as ``kvlib._moved``, aside)."""
    found = []
    for top in PACKAGES:
        pkg = importlib.import_module(top)
        found += [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, f"{top}.")]
    return sorted(n for n in found if not any(part.startswith("_") for part in n.split(".")))


def reexports(name: str) -> list[str]:
    """Names in module ``name``'s ``__all__`` defined elsewhere: documented where they are defined."""
    mod = importlib.import_module(name)
    out = []
    for attr in getattr(mod, "__all__", []):
        obj = getattr(mod, attr, None)
        if isinstance(obj, type(sys)):
            defined = obj.__name__ == name
        elif isinstance(obj, type) or inspect.isroutine(obj):
            defined = obj.__module__ == name
        else:  # data: a number, a dict, a path; documented where it is listed
            defined = True
        if not defined:
            out.append(attr)
    return out


def page(slug: str, title: str, chapters: list[str], modules: list[str], blurb: str) -> str:
    taught = ", ".join(f"{{doc}}`../{c}`" for c in chapters)
    source = ("kvlib's docstrings" if all(m.split(".")[0] == "kvlib" for m in modules) else
              "their docstrings. These packages live beside kvlib, not in it: they import kvlib, and "
              "`import kvlib` loads none of them")
    lines = [f"(api-{slug})=", f"# {title}", "",
             f"The reference for {blurb}, rendered from {source}."
             + (f" The chapters that teach it: {taught}." if chapters else ""),
             "Each entry lists the chapters that mention or use it."]
    for name in modules:
        options = ["   :members:", "   :undoc-members:", "   :show-inheritance:"]
        skip = reexports(name)  # a package's names from its modules: documented there
        if skip:
            options.append(f"   :exclude-members: {', '.join(skip)}")
        lines += ["", f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", *options, "```"]
    return "\n".join(lines) + "\n"


def index() -> str:
    rows = "\n".join(f"| {{doc}}`{slug}` | {blurb} |" for slug, _, _, _, blurb in KVLIB_GROUPS)
    tooling = "\n".join(f"| {{doc}}`{slug}` | {blurb} |" for slug, _, _, _, blurb in TOOLING_GROUPS)
    return ("(api)=\n# kvlib reference\n\n"
            "Every public name of kvlib, from its own docstrings, grouped as the chapters meet them. "
            "A chapter links the first mention or use of each name here; each entry lists the chapters "
            "that mention or use it. The examples (`>>>`) assume `import torch` and `import kvlib`, run on the tiny "
            "preset in milliseconds, and are run as tests (`tests/test_doctests.py`), so they stay true. "
            "What changed between versions, and the old names of renamed ones, is in the "
            "{doc}`../changelog`.\n\n| page | what it holds |\n| --- | --- |\n" + rows + "\n"
            "\n## Beside kvlib\n\nThe book's tooling is not part of kvlib: four packages in the same "
            "repository (and the same wheel) that import kvlib, which never imports them. Their reference "
            "is here too, apart.\n\n| page | what it holds |\n| --- | --- |\n" + tooling + "\n")


def pages() -> dict[str, str]:
    """Every reference page, by file name."""
    out = {"index.md": index()}
    for slug, title, chapters, modules, blurb in GROUPS:
        out[f"{slug}.md"] = page(slug, title, chapters, modules, blurb)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvbook.apiref", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the folder for the pages (book/api)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.out / name}")


# -- the Sphinx extension: chapters link to entries, entries list chapters ---------------------------
NAME = re.compile(r"^([A-Za-z_][\w.]*)(\(.*\))?$")


def _aliases(objects: dict) -> dict[str, str]:
    """Every way a chapter may write a documented name -> its full name (ambiguous forms dropped)."""
    import kvlib

    counts: dict[str, set[str]] = {}

    def add(alias: str, full: str) -> None:
        counts.setdefault(alias, set()).add(full)

    for full, entry in objects.items():
        if not full.startswith(tuple(f"{p}." for p in PACKAGES)) or entry.objtype == "module":
            add(full, full)  # a module only by its full name: "cache" or "model" is a variable
            continue
        parts = full.split(".")
        add(full, full)
        for i in range(1, len(parts) - 1):  # "memory.kv_cache_bytes", "tp.plan", "PagedCache.step"
            add(".".join(parts[i:]), full)
        if entry.objtype in ("class", "function", "exception"):  # "check_cache", "PagedCache"
            add(parts[-1], full)
    # A name a module imports from another kvlib module is documented where it is defined, so
    # ``kvlib.hardware.fast_dtype`` (kvlib.native's, imported into kvlib.hardware) means that
    # entry. These forms rank below names defined where they are written: only when free.
    imported: dict[str, set[str]] = {}
    for modname, entry in objects.items():
        if entry.objtype != "module":
            continue
        try:  # a build that reads nothing new has not imported it (autodoc imports while reading)
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for attr, obj in vars(mod).items():
            home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if (attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj))
                    or obj.__module__ == modname or home not in objects):
                continue
            parts = f"{modname}.{attr}".split(".")
            for i in range(len(parts) - 1):  # "kvlib.hardware.fast_dtype", "hardware.fast_dtype"
                imported.setdefault(".".join(parts[i:]), set()).add(home)
    for alias, homes in imported.items():
        counts.setdefault(alias, homes)
    for name in getattr(kvlib, "__all__", []):  # kvlib.generate is kvlib.generate.generate
        obj = getattr(kvlib, name, None)
        home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', name)}"
        if home in objects:
            counts[f"kvlib.{name}"] = {home}
            counts.setdefault(name, set()).add(home)
    return {alias: next(iter(fulls)) for alias, fulls in counts.items() if len(fulls) == 1}


def _chapter(docname: str) -> bool:
    return docname.startswith("book/ch")


def _mentions(doctree, aliases: dict[str, str]):
    """(literal node, full name) for each inline-code mention that resolves, in document order."""
    from docutils import nodes

    for lit in doctree.findall(nodes.literal):
        if isinstance(lit.parent, nodes.reference):
            continue
        m = NAME.match(lit.astext().strip())
        if m and m.group(1) in aliases:
            yield lit, aliases[m.group(1)]


def collect(app, env) -> None:
    """After reading: which chapters mention which documented name (kept on ``env`` for this build)."""
    objects = env.get_domain("py").objects
    env.kvlib_aliases = _aliases(objects)
    taught: dict[str, list[str]] = {}
    for docname in sorted(env.found_docs):
        if _chapter(docname):
            doctree = env.get_doctree(docname)
            used = [full for _, full in _mentions(doctree, env.kvlib_aliases)] + list(_code_names(doctree, env))
            for full in used:
                if docname not in taught.setdefault(full, []):
                    taught[full].append(docname)
    env.kvlib_taught = taught


def _resolve(dotted: str, aliases: dict[str, str]) -> str | None:
    """The documented object a name in code means (see `_resolve_prefix`), or None."""
    found = _resolve_prefix(dotted, aliases)
    return found[0] if found else None


def _resolve_prefix(dotted: str, aliases: dict[str, str]) -> tuple[str, int] | None:
    """(the documented object, how many of the dotted parts name it) for a name in code: the
    longest leading part that resolves (``kvlib.memory.kv_cache_bytes``, ``tp.plan``,
    ``StaticCache.for_model``; ``kvlib.X.y`` as ``X.y``), or None. A bare lowercase name is
    never linked: in code it is as likely a variable (``prompts``, ``overlap``) as the kvlib
    function of that name."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        for start in (0, 1) if parts[0] == "kvlib" else (0,):
            name = ".".join(parts[start:n])
            if name in aliases and (n - start > 1 or name[:1].isupper()):
                return aliases[name], n
    return None


CODE_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _code_names(doctree, env):
    """Documented objects the chapter's code cells use (import lines aside), in order."""
    from docutils import nodes

    for block in doctree.findall(nodes.literal_block):
        for line in block.astext().splitlines():
            if line.lstrip().startswith(("import ", "from ", "#")):
                continue
            for m in CODE_NAME.finditer(line):
                full = _resolve(m.group(0), env.kvlib_aliases)
                if full:
                    yield full


def forget(app, env, docnames) -> None:
    """A new build: what the last one collected may be stale."""
    env.kvlib_taught = env.kvlib_aliases = None


def link(app, doctree, docname: str) -> None:
    """Chapters: the first mention of each name links to its entry. Reference pages: "Taught in"."""
    from docutils import nodes
    from sphinx import addnodes

    env = app.builder.env
    objects = env.get_domain("py").objects
    if getattr(env, "kvlib_taught", None) is None:  # a build that read nothing new skips collect()
        collect(app, env)
    if _chapter(docname):
        seen: set[str] = set()
        env.kvlib_linked = getattr(env, "kvlib_linked", None) or {}
        env.kvlib_linked[docname] = seen  # html-page-context links the code's first uses of the rest
        for lit, full in list(_mentions(doctree, env.kvlib_aliases)):
            if full in seen:
                continue
            seen.add(full)
            entry = objects[full]
            uri = app.builder.get_relative_uri(docname, entry.docname) + "#" + entry.node_id
            ref = nodes.reference("", "", internal=True, refuri=uri, reftitle=full, classes=["kvlib-api"])
            lit.replace_self(ref)
            ref += lit
    elif docname.startswith("book/api/"):
        link_docstrings(app, doctree, docname)
        taught = getattr(env, "kvlib_taught", {})
        for desc in doctree.findall(addnodes.desc):
            sig = next(iter(desc.findall(addnodes.desc_signature)), None)
            full = sig.get("fullname") and f"{sig.get('module')}.{sig.get('fullname')}" if sig else None
            if not full or full not in taught:
                continue
            para = nodes.paragraph("", "Taught in: ", classes=["kvlib-taught"])
            for i, chapter in enumerate(taught[full]):
                if i:
                    para += nodes.Text(", ")
                uri = app.builder.get_relative_uri(docname, chapter)
                para += nodes.reference("", env.titles[chapter].astext(), internal=True, refuri=uri)
            content = next(iter(desc.findall(addnodes.desc_content)))
            content.insert(0, para)


SPANS = re.compile(r'<span class="n">(\w+)</span>(?:<span class="o">\.</span><span class="n">\w+</span>)*')


def link_code(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """A chapter's code cells: the first use of each name its prose did not link becomes a link.

    Pygments has already split the code into spans (``<span class="n">kvlib</span><span
    class="o">.</span>...``); a dotted run of name spans that resolves is wrapped in a link.
    Import lines are left alone: a name is linked where it is used.
    """
    env = app.builder.env
    if not _chapter(pagename) or "body" not in context or getattr(env, "kvlib_aliases", None) is None:
        return
    objects = env.get_domain("py").objects
    linked = set((getattr(env, "kvlib_linked", None) or {}).get(pagename, ()))
    out, last = [], 0
    body = context["body"]
    for m in SPANS.finditer(body):
        if body.endswith('<span class="o">.</span>', 0, m.start()):
            continue  # an attribute of something else: ``served.loaded``
        line_start = body.rfind("\n", 0, m.start()) + 1
        if re.match(r'\s*(<span class="[^"]*">\s*</span>)?\s*<span class="(kn|c1)">', body[line_start:m.start() + 40]):
            continue  # an import line, or a comment
        names = list(re.finditer(r'<span class="n">(\w+)</span>', m.group(0)))
        found = _resolve_prefix(".".join(n.group(1) for n in names), env.kvlib_aliases)
        if not found or found[0] in linked:
            continue
        full, parts = found
        linked.add(full)
        entry = objects[full]
        uri = app.builder.get_relative_uri(pagename, entry.docname) + "#" + entry.node_id
        end = m.start() + names[parts - 1].end()  # the link covers only the parts that name it
        out += [body[last:m.start()], f'<a class="kvlib-api kvlib-api-code reference internal" href="{uri}" '
                f'title="{full}">', body[m.start():end], "</a>"]
        last = end
    context["body"] = "".join(out) + body[last:]


def configure(app, config) -> None:
    """autodoc as the reference wants it, and nitpicky silence for names outside kvlib.

    kvlib's docstrings write names in single backticks (`PagedCache`, `x`). Without a default
    role reStructuredText sets them as an italic title (``<cite>``); with ``literal`` they are
    code, as in the chapters, and `kvbook.docstrings.link_docstrings` links the ones that name a kvlib object.
    (A cross-referencing role such as ``py:obj`` would warn, and fail this ``-W -n`` build, on
    every parameter and expression.) MyST pages are not affected: their backticks are code.
    """
    config.default_role = config.default_role or "literal"
    config.autodoc_typehints = "signature"
    config.autodoc_member_order = "bysource"
    config.nitpick_ignore_regex = list(config.nitpick_ignore_regex) + [
        ("py:class", r"(torch|nn|np|numpy|typing|collections|pathlib|os|datetime|contextlib|argparse|queue|"
                     r"threading|multiprocessing|dataclasses|enum|re|io|subprocess|docutils|sphinx|matplotlib|"
                     r"pybtex|sphinxcontrib)"
                     r"\..*"),
        ("py:class", r"(Tensor|Path|Callable|Sequence|Iterator|Iterable|Module|Generator|Mapping|T)"),
        ("py:class", r"(abc\.ABC|ipywidgets\..*)"),  # bases from outside kvlib
        ("py:class", r"kvlib\..*\._\w+"),  # a private base class: not part of the reference
    ]


def setup(app) -> dict:
    app.setup_extension("sphinx.ext.autodoc")
    app.connect("config-inited", configure)
    app.connect("env-check-consistency", collect)
    app.connect("env-before-read-docs", forget)
    app.connect("doctree-resolved", link)
    app.connect("html-page-context", link_code)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    main()
