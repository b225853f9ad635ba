"""The data behind the website's explorers: kvlib's presets and tables, exported to JSON.

The book's three explorers (cache size, step time, paged vs contiguous) run in the
reader's browser, with no kernel and no network. Their JavaScript
(``js/explorers.js``) holds only the few formulas, each naming the kvlib function
it mirrors; every number they start from comes from here, so kvlib stays the one
source of truth. ``make book`` writes the file before Jupyter Book copies ``js/``
into the site::

    python -m kvlib.book.web js/explorers-data.json

The paging explorer shows waste that only a simulation can measure, so this
module runs `kvlib.simulate` over a small grid at build time and ships the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import PRESETS
from .explorer import CONTEXTS, GPUS_GIB, MODELS, kv_head_choices
from ..hardware import HARDWARE
from ..memory import DTYPE_BYTES, GiB
from ..simulate import request_trace, simulate

# The paging explorer's grid: block sizes, context limits, and the median request length
PAGING_BLOCKS = [1, 4, 8, 16, 32, 64, 128]
PAGING_MAX_LENS = [1024, 2048, 4096]
PAGING_MEDIANS = [64, 128, 256, 512]
PAGING_REQUESTS = 200  # requests per simulated trace
PAGING_POOL = 32768  # token slots in the simulated pool
STEP_DTYPES = ["fp32", "fp16", "bf16", "fp8"]


def _model(name: str) -> dict:
    c = PRESETS[name]
    return {"name": c.name, "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
            "head_dim": c.head_dim, "d_model": c.d_model, "d_ff": c.d_ff, "vocab_size": c.vocab_size,
            "tie_embeddings": c.tie_embeddings, "kv_heads": kv_head_choices(c)}


def paging_table(blocks=PAGING_BLOCKS, max_lens=PAGING_MAX_LENS, medians=PAGING_MEDIANS,
                 n: int = PAGING_REQUESTS, pool: int = PAGING_POOL) -> list[dict]:
    """`kvlib.simulate` over the grid: the waste (`SimResult.waste`) of reserving the context
    limit (``max``), a power of two (``pow2``) and paging with each block size."""
    rows = []
    for max_len in max_lens:
        for median in medians:
            trace = request_trace(n, prompt_median=median / 2, output_median=median / 2, max_len=max_len, seed=0)
            row = {"max_len": max_len, "median": median,
                   "mean_len": sum(r.total for r in trace) / len(trace),
                   "max": simulate(trace, "max", memory_slots=pool, max_len=max_len).waste,
                   "pow2": simulate(trace, "pow2", memory_slots=pool, max_len=max_len).waste,
                   "paged": {b: simulate(trace, "paged", memory_slots=pool, max_len=max_len, block_size=b).waste
                             for b in blocks}}
            rows.append(row)
    return rows


def explorer_data(*, paging: bool = True) -> dict:
    """Everything the three explorers read: presets, dtype widths, GPU sizes, hardware
    spec sheets and (unless ``paging=False``) the simulated paging table."""
    return {
        "models": {name: _model(name) for name in MODELS},
        "dtype_bytes": dict(DTYPE_BYTES),
        "contexts": CONTEXTS,
        "gpus_gib": GPUS_GIB,
        "gib": GiB,
        "hardware": {k: {"name": h.name, "mem_bandwidth": h.mem_bandwidth, "peak_flops": dict(h.peak_flops),
                         "memory": h.memory, "source": h.source} for k, h in HARDWARE.items()},
        "step_dtypes": STEP_DTYPES,
        "paging": {"blocks": PAGING_BLOCKS, "requests": PAGING_REQUESTS, "pool": PAGING_POOL,
                   "rows": paging_table() if paging else []},
    }


def write(path: str | Path, **kwargs) -> Path:
    """Write `explorer_data` as JSON to ``path`` (its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(explorer_data(**kwargs), indent=1))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m kvlib.book.web OUT.json")
    print(f"wrote {write(sys.argv[1])}")
