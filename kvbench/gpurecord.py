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

FORMAT = "kv-bench-gpu/1"
RECORD = Path(__file__).parent / "data" / "bench_gpu.json"

# What a reader of the record may rely on: top-level keys, and each shape's.
TOP_KEYS = ("format", "machine", "suite", "hbm", "shapes", "targets", "seconds")
MACHINE_KEYS = ("gpu", "capability", "memory_bytes", "driver", "cuda", "torch", "python", "date")
SHAPE_KEYS = ("config", "dtype", "weight_bytes", "decode", "attention", "paged", "prefill", "roofline")
SHAPES = ("smollm2-135m", "llama-3.1-8b")


def check_gpu_record(record: dict) -> dict:
    """``record`` itself if it holds every key the book reads, else a ValueError naming the first one missing."""
    if not isinstance(record, dict):
        raise TypeError(f"a GPU record is a dict (JSON object), got {type(record).__name__}")
    if record.get("format") != FORMAT:
        raise ValueError(f"not a GPU record: format {record.get('format')!r}, expected {FORMAT!r}")
    for where, obj, keys in (("the record", record, TOP_KEYS), ("machine", record.get("machine"), MACHINE_KEYS)):
        missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
        if missing:
            raise ValueError(f"GPU record: {where} lacks {missing}; rerun `make gpucheck`")
    for name in SHAPES:
        shape = record["shapes"].get(name)
        missing = list(SHAPE_KEYS) if not isinstance(shape, dict) else [k for k in SHAPE_KEYS if k not in shape]
        if missing:
            raise ValueError(f"GPU record: shape {name!r} lacks {missing}; rerun `make gpucheck`")
        batches = sorted(d.get("batch") for d in shape["decode"])
        if batches != [1, 32]:
            raise ValueError(f"GPU record: shape {name!r} has decode at batches {batches}, expected [1, 32]")
    return record


def load_gpu_record(path: str | os.PathLike | None = None) -> dict | None:
    """The stored GPU record (default ``kvbench/data/bench_gpu.json``), checked; None if no GPU has written it."""
    p = RECORD if path is None else Path(path)
    if not p.is_file():
        return None
    return check_gpu_record(json.loads(p.read_text(encoding="utf-8")))


__all__ = ["FORMAT", "RECORD", "SHAPES", "check_gpu_record", "load_gpu_record"]
