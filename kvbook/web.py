"""The data behind the website's explorers: kvlib's presets and tables, exported as a script.

The book's three explorers (cache size, step time, paged vs contiguous) run in the
reader's browser, with no kernel and no network. Their JavaScript
(``js/explorers.js``) holds only the few formulas, each naming the kvlib function
it mirrors; every number they start from comes from here, so kvlib stays the one
source of truth. ``make book`` writes the file before Jupyter Book copies ``js/``
into the site::

    python -m kvbook.web js/explorers-data.js

The data is a script that sets one global, ``window.kvExplorerData``, not a JSON file
to fetch: a page opened from disk (``file://``, as the README suggests) may not fetch a
file beside it, but it may run a script. ``explorers.js`` adds the script only to the
pages that have an explorer.

The paging explorer shows waste that only a simulation can measure, so this
module runs `kvlib.simulate` over a small grid at build time and ships the table.
Its default setting is chapter 9's own: the chat-like trace of 400 requests, a
2,048-token context limit, a pool of 32,768 slots and 16-token blocks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlib.config import PRESETS
from .explorer import CONTEXTS, GPUS_GIB, MODELS, kv_head_choices
from kvlib.hardware import HARDWARE
from kvlib.memory import DTYPE_BYTES, GiB, param_count
from kvlib.simulate import POLICIES, request_trace, simulate

# The paging explorer's grid: block sizes, context limits, and request traces.
PAGING_BLOCKS = [1, 4, 8, 16, 32, 64, 128, 256]
PAGING_MAX_LENS = [1024, 2048, 4096]
PAGING_REQUESTS = 400  # requests per simulated trace, as in chapter 9
# Each trace: log-normal prompt and output lengths (`request_trace`) and the pool it is
# served from. "chat-like" and "short" are chapter 9's two traces (its cells draw them
# with these medians, sigma and seeds, and serve the short one from a quarter of the
# pool); the two between them scale the chat-like medians.
PAGING_TRACES = {
    "short": {"label": "short exchanges", "prompt_median": 20, "output_median": 60,
              "sigma": 0.9, "seed": 1, "pool": 8192},
    "half": {"label": "shorter chats", "prompt_median": 80, "output_median": 100,
             "sigma": 0.9, "seed": 0, "pool": 32768},
    "chat-like": {"label": "chat-like", "prompt_median": 160, "output_median": 200,
                  "sigma": 0.9, "seed": 0, "pool": 32768},
    "long": {"label": "longer chats", "prompt_median": 320, "output_median": 400,
             "sigma": 0.9, "seed": 0, "pool": 32768},
}
PAGING_DEFAULT = {"trace": "chat-like", "max_len": 2048, "block": 16}  # chapter 9's setting
STEP_DTYPES = ["fp32", "fp16", "bf16", "fp8"]


def _model(name: str) -> dict:
    """One preset for the explorers: its shapes and context limit, its layer pattern (one entry per
    layer, as `kvlib.layers.LayerKind`'s fields, which the JavaScript sums the cache over), and its
    parameter count, None for a ``family="shapes"`` preset (kvlib does not count those)."""
    c = PRESETS[name]
    layers = [{"kind": k.kind, "size": k.size, "sinks": k.sinks, "source": k.source} for k in c.layer_kinds()]
    return {"name": c.name, "family": c.family, "n_layer": c.n_layer, "n_head": c.n_head,
            "n_kv_head": c.n_kv_head, "head_dim": c.head_dim, "d_model": c.d_model, "d_ff": c.d_ff,
            "vocab_size": c.vocab_size, "tie_embeddings": c.tie_embeddings, "kv_heads": kv_head_choices(c),
            "max_seq_len": c.max_seq_len,  # its context limit: the cache explorer says when a context is past it
            "layers": layers, "param_count": None if c.family == "shapes" else param_count(c)}


def trace_for(key: str, max_len: int, n: int = PAGING_REQUESTS, traces: dict | None = None) -> list:
    """The `request_trace` behind one row of the paging table."""
    t = (traces or PAGING_TRACES)[key]
    return request_trace(n, prompt_median=t["prompt_median"], output_median=t["output_median"],
                         sigma=t["sigma"], max_len=max_len, seed=t["seed"])


def paging_row(trace: list, pool: int, max_len: int, blocks=PAGING_BLOCKS) -> dict:
    """`kvlib.simulate` on one trace: the waste (`SimResult.waste`) and the mean batch
    (`SimResult.mean_batch`) of reserving the context limit (``max``), the final length
    rounded up to a power of two (``pow2``) or exactly (``oracle``), and of paging with
    each block size."""
    row = {"mean_len": sum(r.total for r in trace) / len(trace), "waste": {}, "batch": {}}
    for policy in POLICIES:
        if policy == "paged":
            runs = {str(b): simulate(trace, "paged", memory_slots=pool, max_len=max_len, block_size=b)
                    for b in blocks}
            row["waste"]["paged"] = {b: r.waste for b, r in runs.items()}
            row["batch"]["paged"] = {b: r.mean_batch for b, r in runs.items()}
        else:
            r = simulate(trace, policy, memory_slots=pool, max_len=max_len)
            row["waste"][policy], row["batch"][policy] = r.waste, r.mean_batch
    return row


def paging_table(blocks=PAGING_BLOCKS, max_lens=PAGING_MAX_LENS, traces: dict | None = None,
                 n: int = PAGING_REQUESTS) -> list[dict]:
    """`paging_row` for every trace and context limit of the grid."""
    traces = traces or PAGING_TRACES
    rows = []
    for key, t in traces.items():
        for max_len in max_lens:
            row = paging_row(trace_for(key, max_len, n, traces), t["pool"], max_len, blocks)
            rows.append({"trace": key, "max_len": max_len, **row})
    return rows


def explorer_data(*, paging: bool = True) -> dict:
    """Everything the three explorers read: presets, dtype widths, GPU sizes, hardware
    spec sheets and (unless ``paging=False``) the simulated paging table."""
    return {
        "models": {name: _model(name) for name in MODELS},
        # the step explorer needs every weight matrix: the presets whose weights kvlib counts
        "step_models": [name for name in MODELS if PRESETS[name].family == "llama"],
        "dtype_bytes": dict(DTYPE_BYTES),
        "contexts": CONTEXTS,
        "gpus_gib": GPUS_GIB,
        "gib": GiB,
        "hardware": {k: {"name": h.name, "mem_bandwidth": h.mem_bandwidth, "peak_flops": dict(h.peak_flops),
                         "memory": h.memory, "source": h.source} for k, h in HARDWARE.items()},
        "step_dtypes": STEP_DTYPES,
        "paging": {"blocks": PAGING_BLOCKS, "max_lens": PAGING_MAX_LENS, "requests": PAGING_REQUESTS,
                   "traces": PAGING_TRACES, "default": PAGING_DEFAULT,
                   "rows": paging_table() if paging else []},
    }


GLOBAL = "kvExplorerData"  # the one global the script sets, which explorers.js reads
_HEAD = (f"// The explorers' data (js/explorers.js reads window.{GLOBAL}), written by\n"
         f"// `python -m kvbook.web` from kvlib's presets and tables: do not edit.\n"
         f"window.{GLOBAL} = ")


def script(data: dict) -> str:
    """``data`` as a script setting ``window.kvExplorerData``: JSON is a JavaScript expression."""
    return _HEAD + json.dumps(data, separators=(",", ":"), allow_nan=False) + ";\n"


def read_script(text: str) -> dict:
    """The data a `script` sets, back as a dict (for the tests)."""
    if not (text.startswith(_HEAD) and text.endswith(";\n")):
        raise ValueError("not a script written by kvbook.web")
    return json.loads(text[len(_HEAD):-2])


def write(path: str | Path, **kwargs) -> Path:
    """Write `explorer_data` as a script (`script`) to ``path``, a ``.js`` file (its folder is created)."""
    path = Path(path)
    if path.suffix != ".js":
        raise ValueError(f"the explorers' data is a script: write it to a .js file, not {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script(explorer_data(**kwargs)))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m kvbook.web OUT.js")
    print(f"wrote {write(sys.argv[1])}")
