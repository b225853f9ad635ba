"""Data shipped inside kvlib: Tiny Shakespeare, and a stored benchmark record.

The file is Andrej Karpathy's ``tinyshakespeare/input.txt`` (public-domain plays,
1,115,394 characters). ``split="val"`` is its last 10%, the slice nanoGPT holds
out. Nothing in kvlib trains on it; the book uses it to compare a model with a
modified copy of itself (fewer KV heads, a quantized cache).

``bench_record()`` is the JSON that ``python -m kvlib.bench --compile --json`` wrote
on the machine that builds the book: measurements too slow to repeat inside a
chapter (Hugging Face's loader, ``torch.compile``), kept as data with their date,
machine and load, so a chapter can quote them and say where they came from.
"""

from __future__ import annotations

import json
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
    """The stored ``python -m kvlib.bench`` results ``data/bench_<name>.json``, as a dict."""
    path = PATH.with_name(f"bench_{name}.json")
    if not path.is_file():
        have = sorted(p.stem.removeprefix("bench_") for p in PATH.parent.glob("bench_*.json"))
        raise ValueError(f"no stored bench record {name!r}; kvlib has {have}")
    return json.loads(path.read_text(encoding="utf-8"))
