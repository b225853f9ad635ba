"""NVIDIA's kvpress, run beside kvlib's presses on the same passage, position for position.

kvpress pins its own transformers (``>=4.56,<5.3``), so it lives in an environment of its
own (``make kvpress`` builds ``.venv-kvpress``: kvpress 0.5.5, kvlib, and SmolLM2 written
in Hugging Face format by `kvlib.hf.to_hf`). The check

    python -m kvpresscheck --json kvpresscheck/data/kvpress_cpu.json

prefills one Tiny Shakespeare passage (`kvpresscheck.workload`) with each press
(SnapKV, PyramidKV, TOVA, Expected Attention, StreamingLLM) at two compression ratios:
through kvpress in its environment (`kvpresscheck.kvpress_side`, which reads the kept
positions out of kvpress's pruned cache), through `kvlib.press`, and through a
brute-force version of each paper's algorithm (`kvpresscheck.reference`). It then
compares, per layer and KV head, which positions each kept, their scores, and the greedy
tokens after compression (`kvpresscheck.compare`); any difference must come with a
tested cause. The record it writes is what the book reads where kvpress is not installed.

* `kvpress_python`: the kvpress environment's interpreter, or None.
* `run`: all of it, compared (`kvpresscheck.driver`).
* `load_record`: the stored record (``kvpresscheck/data/kvpress_cpu.json``); `table`: its rows.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllmcheck import env_python, read_record

#: The stored presscheck record, read where kvpress is not installed (`load_record`).
RECORD = Path(__file__).resolve().parent / "data" / "kvpress_cpu.json"
VENV = Path(__file__).resolve().parents[1] / ".venv-kvpress"  # where `make kvpress` puts it, beside kvlib/
ENV_VAR = "KVLIB_KVPRESS_PYTHON"  # a path to another kvpress interpreter, or "off"


def kvpress_python() -> Path | None:
    """The interpreter of the kvpress environment: ``$KVLIB_KVPRESS_PYTHON`` if set ("off": none),
    else ``.venv-kvpress/bin/python`` beside kvlib when ``make kvpress`` built it; None otherwise."""
    return env_python(VENV, ENV_VAR)


def load_record(path: str | os.PathLike | None = None) -> dict:
    """The press check's stored record: settings, versions, each side's results and the comparisons."""
    return read_record(RECORD if path is None else path, "kvpress presscheck")


def table(record: dict, side: str = "kvlib") -> list[dict]:
    """One row per run of ``side`` (``"kvlib"`` or ``"reference"``) against kvpress: press, ratio,
    heads with identical kept sets, the worst overlap, the largest score difference, whether the
    greedy tokens are equal, the status and the causes of any difference."""
    if side not in ("kvlib", "reference"):
        raise ValueError(f"side must be 'kvlib' or 'reference', got {side!r}")
    rows = []
    for c in record["comparisons"]:
        if c["side"] != side:
            continue
        if c["status"] == "missing":
            rows.append({"press": c["press"], "ratio": c["ratio"], "status": "missing", "cause": c["detail"]})
            continue
        rows.append({
            "press": c["press"], "ratio": c["ratio"], "identical heads": f"{c['identical']}/{c['heads']}",
            "worst overlap": round(c["worst"]["overlap"], 4),
            "score max |diff|": c["score_max_abs_diff"], "tokens equal": c["tokens_equal"],
            "status": c["status"], "cause": "; ".join(x["cause"] for x in c["causes"]),
        })
    return rows


def run(*args, **kwargs) -> dict:
    """`kvpresscheck.driver.run` (imported on first use: it needs the model code)."""
    from .driver import run as _run

    return _run(*args, **kwargs)


__all__ = ["RECORD", "kvpress_python", "load_record", "run", "table"]
