"""A Sphinx extension of the book's own: a search that finds concepts (issue 44).

Listed in ``_config.yml``'s ``extra_extensions``. Sphinx's search ranks a page by the best
single word it matches, so "paged attention" ranked chapter 9 fifth of 23, after every page
with "attention" in a heading; and it indexes "PagedAttention" as one word, which chapter 9
never writes, so that query found only the reference and the bibliography. Two things mend it:

1. **A concept index**, as a printed book has: `CONCEPTS` names each concept the book teaches,
   in the forms a reader types ("PagedAttention", "paged attention"), and the page that
   teaches it. Each becomes an index entry on that page, at its top, at the ``doctree-read``
   event. Sphinx's search scores an index entry that contains the whole query at
   ``100 * len(query) / len(entry)``, above any match of single words (at most 15), so the
   teaching page comes first. The entries also appear on the site's general index.
2. **Snippets from the text** (``js/search.js``, added to the search page only): Sphinx cut a
   result's snippet around the first place its words appear in the page's main element,
   which begins with the page's header and its table of contents ("Contents 9.1 Overview
   9.2 ..."). The snippet now comes from the article's prose, where the query's words stand
   together.

And on every other page, the search index (360 KB) and Sphinx's search scripts are no longer
loaded (`kvbook.lean`): with search-as-you-type off, the search box only sends the query
to the search page.
"""

from __future__ import annotations

import re
import zlib

from docutils import nodes
from sphinx import addnodes

# The page that teaches each concept, and the forms of its name a reader would type. A form
# is searched as typed (case aside): list both "PagedAttention" and "paged attention".
CONCEPTS: dict[str, tuple[str, ...]] = {
    "book/ch01_naive": ("scaled dot-product attention", "recomputation", "naive decoding"),
    "book/ch02_prefill_decode": ("KV cache", "key-value cache", "prefill and decode", "prefill", "decode step"),
    "book/ch02b_numerics": ("batch-invariant", "batch invariance", "floating-point drift", "numerics"),
    "book/ch03_where_cache_lives": ("cache layout", "preallocated cache", "cache update API"),
    "book/ch04_how_big": ("cache size", "KV cache size", "memory footprint"),
    "book/ch05_step_time": ("roofline", "arithmetic intensity", "memory-bound", "step time"),
    "book/ch06_padding": ("padding", "left padding", "attention mask", "position ids"),
    "book/ch07_sharing_kv": ("grouped-query attention", "GQA", "multi-query attention", "MQA",
                             "multi-head latent attention", "MLA"),
    "book/ch07b_layer_shapes": ("sliding window attention", "sliding window", "chunked attention",
                                "cross-layer KV sharing", "hybrid cache"),
    "book/ch08_quantization": ("KV cache quantization", "quantized cache", "quantization", "KIVI"),
    "book/ch09_paging": ("PagedAttention", "paged attention", "paging", "block table", "fragmentation"),
    "book/ch09b_serving_blocks": ("continuous batching", "copy-on-write", "paged attention kernel",
                                  "parallel sampling"),
    "book/ch10_long_context": ("attention sink", "StreamingLLM", "H2O", "heavy hitters", "ring buffer",
                               "cache eviction"),
    "book/ch10a_budget_limits": ("cache budget", "context extension"),
    "book/ch10b_compression": ("SnapKV", "PyramidKV", "TOVA", "expected attention", "kvpress",
                               "KV cache compression", "prompt compression"),
    "book/ch11_decode_fast": ("FlashAttention", "flash attention", "online softmax", "FlashDecoding",
                              "flash decoding", "split-KV"),
    "book/ch11b_weight_formats": ("weight quantization", "int8 weights", "int4 weights", "bf16 weights",
                                  "llama.cpp"),
    "book/ch11c_gpu": ("GPU", "CUDA", "CUDA graphs", "HBM bandwidth", "SDPA backends",
                       "FlashAttention backend"),
    "book/ch12_serving": ("speculative decoding", "draft model", "prompt lookup"),
    "book/ch12b_prefix_reuse": ("prefix caching", "prefix reuse", "RadixAttention", "radix tree",
                                "multi-turn chat"),
    "book/ch12c_engines": ("chunked prefill", "vLLM", "SGLang", "continuous batching engine"),
    "book/ch13_beyond_one_machine": ("tensor parallelism", "tensor-parallel", "column-parallel",
                                     "row-parallel"),
    "book/ch13b_disaggregation": ("disaggregation", "disaggregated prefill", "prefill-decode disaggregation",
                                  "LMCache", "tiered cache", "KV cache transfer"),
    "book/ch14_find_the_bug": ("find the bug", "debugging exercises", "grader", "KV cache bugs"),
}


def concept_id(form: str) -> str:
    return "concept-" + re.sub(r"[^a-z0-9]+", "-", form.lower()).strip("-")


def add_concepts(app, doctree: nodes.document) -> None:
    """1: the page's concepts as index entries, pointing at the top of its first section."""
    forms = CONCEPTS.get(app.env.docname)
    section = next(iter(doctree.findall(nodes.section)), None)
    if not forms or section is None:
        return
    ids = [concept_id(f) for f in forms]
    target = nodes.target("", "", ids=ids)
    # "main": Sphinx's search lists other index entries after every other result
    index = addnodes.index(entries=[("single", f, i, "main", None) for f, i in zip(forms, ids)], inline=False)
    title = next(iter(section.findall(nodes.title)), None)
    at = section.index(title) + 1 if title is not None else 0
    section.insert(at, index)
    section.insert(at + 1, target)
    for i in ids:
        doctree.ids.setdefault(i, target)


def search_page_script(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """2: the search page's own script; deferred, so it runs after searchtools.js defined
    ``Search`` and before Search.init queries (both wait for the page to be parsed)."""
    if pagename == "search":
        app.add_js_file("search.js", defer="defer")


def setup(app) -> dict:
    app.connect("doctree-read", add_concepts)
    app.connect("html-page-context", search_page_script)
    # a change to CONCEPTS re-reads every page (Sphinx re-reads when an env_version changes)
    return {"parallel_read_safe": True, "parallel_write_safe": True,
            "env_version": zlib.crc32(repr(sorted(CONCEPTS.items())).encode())}
