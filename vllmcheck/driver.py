"""Running the cross-check: each scenario through kvlib here and through vLLM in its environment.

* `export`: SmolLM2 as a Hugging Face checkpoint, the format vLLM loads.
* `run_vllm`: one scenario in a fresh vLLM process (`vllmcheck.vllm_side`).
* `run`: every scenario through both engines, compared: the record.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

from kvlib.model import Transformer
from kvlib.timing import threads
from .compare import compare
from .kvlib_side import run as run_kvlib


def export(out: str) -> None:
    """Write SmolLM2 (the GGUF's weights, dequantized to fp32) as a Hugging Face checkpoint."""
    from kvlib.hf import to_hf
    from kvlib.pretrained import load_smollm2

    model, _ = load_smollm2()
    to_hf(model).save_pretrained(out)
    print(f"SmolLM2 in Hugging Face format: {out}")


def run_vllm(python: Path, scenario: dict, model_dir: Path, timeout: int = 900, *, trace: bool = False) -> dict:
    """One scenario through vLLM, in its own process (a fresh engine each time); ``trace``: record
    its pool step by step (`vllmcheck.vllm_trace`), as ``result["trace"]``."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "VLLM_LOGGING_LEVEL": "INFO"}
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"scenario": scenario, "model_dir": str(model_dir),
                                    "options": {"trace": True} if trace else {}}))
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), "-m", "vllmcheck.vllm_side", str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"vllm_side exited {proc.returncode}", "stderr": proc.stderr[-4000:]}
        result = json.loads(out.read_text())
        result["process_seconds"] = time.perf_counter() - t0
        # vLLM's own lines about its pool, as it printed them (its logger writes to the process's output)
        printed = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "KV cache" in ln]
        result["log"] = [ln.split("] ", 1)[-1] for ln in printed] or result.get("log", [])
        return result


def run(model: Transformer, scenarios: list[dict], python: Path | None = None, model_dir: Path | None = None, *,
        log=None, trace: Collection[str] = ()) -> dict:
    """Every scenario through kvlib (2 threads) and then vLLM (``OMP_NUM_THREADS=2``), one after
    the other on the same machine, and the checks: the record `load_record` reads back.

    ``python``: vLLM's interpreter (default `vllm_python()`); ``model_dir``: SmolLM2 in Hugging Face
    format (default ``smollm2-hf`` in that environment, where ``make vllm`` writes it); ``log``: a
    function given one line per scenario, or None; ``trace``: the names of the scenarios whose pools
    both engines record step by step (a scenario is the requests and settings; a trace only
    watches them), kept as ``record[side][name]["trace"]``.
    """
    import torch

    from . import vllm_checkpoint

    python, model_dir = vllm_checkpoint(python, model_dir)

    record = {"vllm": {}, "kvlib": {}, "scenarios": scenarios, "machine": {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}}
    t_all = time.perf_counter()
    for s in scenarios:
        t0 = time.perf_counter()
        with threads(2):
            record["kvlib"][s["name"]] = run_kvlib(s, model, trace=s["name"] in trace)
        t1 = time.perf_counter()
        record["vllm"][s["name"]] = v = run_vllm(python, s, model_dir, trace=s["name"] in trace)
        if log:
            log(f"{s['name']:9s} kvlib {t1 - t0:5.1f} s, vLLM {time.perf_counter() - t1:5.1f} s"
                + (f"  ({v['error']})" if "error" in v else ""))
    record["checks"] = [c.as_dict() for c in compare(model.config, scenarios, record["vllm"], record["kvlib"])]
    record["seconds"] = time.perf_counter() - t_all
    return record
