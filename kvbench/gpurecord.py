"""The GPU record: what ``make gpucheck`` measured on one GPU, and how the book reads it.

``make gpucheck`` (a later run on a machine with a GPU) writes ``kvbench/data/bench_gpu.json``
in the format ``kv-bench-gpu/1``: the GPU, its driver and torch, the unit suite's counts on
CUDA, the copy bandwidth of its HBM, and for each model shape (SmolLM2-135M and
Llama-3.1-8B, random weights, bf16) decode at batch 1 and 32, attention at 4k and 32k
tokens, paged against contiguous attention, prefill FLOP/s and the roofline's prediction
against the measured step. The targets the issue set (decode at batch 1 reaching 60% of
HBM bandwidth on the 8B shape, the roofline within its band) are in it with the measured
reason where one was missed.

`load_gpu_record` returns None while no GPU has written the record, so a chapter can show
its prediction alone and say that no measurement exists yet; `check_gpu_record` refuses a
record that lacks what the book reads, naming the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The record's format name, its ``"format"`` key.
FORMAT = "kv-bench-gpu/1"
#: Where ``make gpucheck`` writes the record, and `load_gpu_record` reads it by default.
RECORD = Path(__file__).parent / "data" / "bench_gpu.json"

# What a reader of the record may rely on: top-level keys, and each part's.
TOP_KEYS = ("format", "machine", "suite", "hbm", "shapes", "targets", "seconds")
MACHINE_KEYS = ("gpu", "capability", "memory_bytes", "driver", "cuda", "torch", "python", "date")
SUITE_KEYS = ("passed", "failed", "skipped", "errors", "seconds", "command")  # counts None: the suite did not finish
HBM_KEYS = ("copy_bytes", "bandwidth_bytes_s", "spec_bytes_s")
SHAPE_KEYS = ("config", "dtype", "weight_bytes", "decode", "attention", "paged", "prefill", "roofline")
#: The model shapes the record measures, by their keys in ``"shapes"``.
SHAPES = ("smollm2-135m", "llama-3.1-8b")
# Within a shape; a section that failed on the GPU keeps these keys (None) and adds an "error".
PART_KEYS = {
    "decode": ("batch", "context", "step_s", "bytes_read", "bandwidth_bytes_s", "hbm_fraction", "graphs_step_s"),
    "attention": ("context", "batch", "backend", "step_s", "bytes_read", "bandwidth_bytes_s"),
    "paged": ("context", "batch", "block_size", "contiguous_step_s", "paged_step_s", "ratio"),
    "prefill": ("tokens", "step_s", "flops", "flop_s"),
    "roofline": ("predicted_step_s", "measured_step_s", "ratio", "band", "within", "hardware"),
}
TARGETS = ("decode_b1_hbm_fraction", "roofline_within_band")  # the two, in this order
TARGET_KEYS = ("name", "shape", "value", "met", "reason")


def _lacks(where: str, obj: object, keys: tuple[str, ...]) -> None:
    missing = list(keys) if not isinstance(obj, dict) else [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"GPU record: {where} lacks {missing}; rerun `make gpucheck`")


def check_gpu_record(record: dict) -> dict:
    """``record`` itself if it holds every key the book reads, else a ValueError naming the first one missing.

    Also refused: decode at batches other than [1, 32], targets other than `TARGETS`, and a
    target not met without the measured reason (a sentence in ``reason``).
    """
    if not isinstance(record, dict):
        raise TypeError(f"a GPU record is a dict (JSON object), got {type(record).__name__}")
    if record.get("format") != FORMAT:
        raise ValueError(f"not a GPU record: format {record.get('format')!r}, expected {FORMAT!r}")
    for where, keys in (("the record", TOP_KEYS), ("machine", MACHINE_KEYS), ("suite", SUITE_KEYS),
                        ("hbm", HBM_KEYS)):
        _lacks(where, record if where == "the record" else record.get(where), keys)
    for name in SHAPES:
        shape = record["shapes"].get(name)
        _lacks(f"shape {name!r}", shape, SHAPE_KEYS)
        for part, keys in PART_KEYS.items():
            for i, entry in enumerate(shape[part] if part in ("decode", "attention") else [shape[part]]):
                _lacks(f"shape {name!r} {part}" + (f"[{i}]" if part in ("decode", "attention") else ""), entry, keys)
        batches = sorted(d.get("batch") for d in shape["decode"])
        if batches != [1, 32]:
            raise ValueError(f"GPU record: shape {name!r} has decode at batches {batches}, expected [1, 32]")
    names = [t.get("name") if isinstance(t, dict) else None for t in record["targets"]]
    if names != list(TARGETS):
        raise ValueError(f"GPU record: targets {names}, expected {list(TARGETS)}; rerun `make gpucheck`")
    for t in record["targets"]:
        _lacks(f"target {t['name']!r}", t, TARGET_KEYS)
        if not t["met"] and not (isinstance(t["reason"], str) and t["reason"].strip()):
            raise ValueError(f"GPU record: target {t['name']!r} is not met and gives no reason; the check "
                             f"writes the measured one")
    return record


def load_gpu_record(path: str | os.PathLike | None = None) -> dict | None:
    """The stored GPU record (default ``kvbench/data/bench_gpu.json``), checked; None if no GPU has written it."""
    p = RECORD if path is None else Path(path)
    if not p.is_file():
        return None
    return check_gpu_record(json.loads(p.read_text(encoding="utf-8")))


__all__ = ["FORMAT", "RECORD", "SHAPES", "check_gpu_record", "load_gpu_record"]
