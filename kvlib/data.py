"""Data shipped inside kvlib: Tiny Shakespeare.

The file is Andrej Karpathy's ``tinyshakespeare/input.txt`` (public-domain plays,
1,115,394 characters). ``split="val"`` is its last 10%, the slice nanoGPT holds
out. Nothing in kvlib trains on it; the book uses it to compare a model with a
modified copy of itself (fewer KV heads, a quantized cache).

The stored benchmark run moved with the benchmark in 0.5: it is `kvbench.load_record`
now (``bench_record`` here forwards to it, with a DeprecationWarning, until 0.6).
"""

from __future__ import annotations

import importlib
from pathlib import Path

PATH = Path(__file__).with_name("data") / "tinyshakespeare.txt"


def tiny_shakespeare(split: str = "val") -> str:
    """The text: ``"train"`` (first 90%), ``"val"`` (last 10%) or ``"all"``."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    text = PATH.read_text(encoding="utf-8")
    cut = int(0.9 * len(text))
    return {"train": text[:cut], "val": text[cut:], "all": text}[split]


def bench_record(name: str = "cpu") -> dict:
    """Deprecated (kvlib 0.5; goes in 0.6): the stored benchmark run is ``kvbench.load_record(name)``."""
    from . import _moved

    _moved.warn("kvlib.data.bench_record", "kvbench.load_record")
    return importlib.import_module("kvbench").load_record(name)
