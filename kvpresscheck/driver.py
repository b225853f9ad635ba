"""Running the press check: kvpress in its environment, kvlib and the reference here, compared.

* `run_kvpress`: every run through kvpress, in one fresh process (`kvpresscheck.kvpress_side`).
* `comparison`: one row of the table, side ``a`` against kvpress, with the causes of any difference.
* `run`: all of it, the record `kvpresscheck.load_record` reads back.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvlib.model import Transformer
from kvlib.timing import threads
from . import compare as cmp
from .kvlib_side import kvlib_runs, reference_runs
from .workload import DEFAULTS, NEW_TOKENS, RATIOS, runs as all_runs

ENV = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TRANSFORMERS_VERBOSITY": "error"}


def run_kvpress(python: Path, spec: dict, timeout: int = 1800) -> dict:
    """Every run of ``spec`` through kvpress in its own interpreter; what `kvpress_side.main` saved."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), "-m", "kvpresscheck.kvpress_side", str(spec_path), str(out)],
                              env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"kvpress_side exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        result = torch.load(out, weights_only=True)
        result["process_seconds"] = time.perf_counter() - t0
        return result


def _finite_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    both = torch.isfinite(a) & torch.isfinite(b)
    return float((a[both] - b[both]).abs().max()) if bool(both.any()) else 0.0


def comparison(run: dict, side: str, a: dict, kvpress: dict, extra_causes: list[dict] | None = None) -> dict:
    """One row: ``a`` (the reference's or kvlib's result for ``run``) against kvpress's.

    Where kept sets differ, heads whose swaps lie within the two sides' score rounding are
    explained by `compare.rounding_flip`; ``extra_causes`` (a switch that makes them agree)
    may explain the others. The row's ``status`` is `compare.judge`'s.
    """
    row = {"run": run["name"], "press": run["press"], "ratio": run["ratio"], "side": side, "against": "kvpress"}
    if "error" in a:
        return {**row, "status": "missing", "detail": a["error"]}
    kept_b = [k.tolist() for k in kvpress["kept"]]
    diff = cmp.compare_kept(a["kept"], kept_b)
    scores = a.get("scores")
    if scores is not None and side == "kvlib" and run["press"] == "streaming_llm":
        # kvlib scores every token by its position (sinks above all), kvpress 1 for kept and 0 for dropped:
        # the same order at the boundary, not the same numbers, so only the kept sets are compared
        scores, row["score_note"] = None, "kvlib scores by position, kvpress by 0/1: not comparable numbers"
    row["score_max_abs_diff"] = (max(_finite_max_diff(sa, sb) for sa, sb in zip(scores, kvpress["scores"]))
                                 if scores is not None else None)
    causes = []
    if diff["differ"] and scores is not None:
        flips = {}
        for key, d in diff["differ"].items():
            layer, head = map(int, key.split("."))
            ev = cmp.rounding_flip(scores[layer][head].tolist(), kvpress["scores"][layer][head].tolist(),
                                   d["only_a"], d["only_b"])
            if ev is not None:
                flips[key] = ev
        if flips:
            causes.append({"cause": "fp32 rounding at the top-k boundary", "heads": sorted(flips), "holds": True,
                           "reason": "the swapped positions' scores differ by less than twice the largest score "
                                     "difference between the two sides on that head", "evidence": flips})
    causes += extra_causes or []
    row.update({"heads": diff["heads"], "identical": diff["identical"], "worst": diff["worst"],
                "differ": diff["differ"], "tokens_equal": a["tokens"] == kvpress["tokens"],
                "tokens_shared": cmp.shared_prefix(a["tokens"], kvpress["tokens"]), "causes": causes})
    row["status"] = cmp.judge(diff, a["tokens"], kvpress["tokens"], causes)
    return row


def run(model: Transformer, ids: list[int], python: Path | None = None, model_dir: Path | None = None, *,
        presses: tuple[str, ...] | None = None, ratios: tuple[float, ...] = RATIOS, new_tokens: int = NEW_TOKENS,
        log=None) -> dict:
    """kvpress (its environment, ``OMP_NUM_THREADS=2``), the reference and kvlib (here, 2 threads)
    on the same token ids: the record. ``log``: a function given one line per step, or None."""
    from . import kvpress_python

    python = python or kvpress_python()
    if python is None:
        raise FileNotFoundError("no kvpress environment: run `make kvpress` (or set KVLIB_KVPRESS_PYTHON)")
    model_dir = Path(model_dir) if model_dir is not None else Path(python).parents[1] / "smollm2-hf"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {model_dir}: run `make kvpress`")
    work = all_runs(**({"presses": presses} if presses else {}), ratios=ratios)
    log = log or (lambda line: None)
    t_all = time.perf_counter()
    kp = run_kvpress(python, {"model_dir": str(model_dir), "ids": ids, "new_tokens": new_tokens, "runs": work})
    log(f"kvpress: {kp['process_seconds']:.0f} s in its process (model loaded in {kp['load_seconds']:.1f} s)")
    with threads(2):
        t0 = time.perf_counter()
        ref = reference_runs(model, ids, work, new_tokens)
        log(f"reference: {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        mine = kvlib_runs(model, ids, work, new_tokens)
        log(f"kvlib.press: {time.perf_counter() - t0:.0f} s")
    rows = []
    for r in work:
        for side, res in (("reference", ref[r["name"]]), ("kvlib", mine[r["name"]])):
            rows.append(comparison(r, side, res, kp["runs"][r["name"]]))

    def slim(res: dict) -> dict:
        if "error" in res:
            return res
        return {"tokens": res["tokens"], "seconds": res["seconds"], "n_kept": [len(k[0]) for k in res["kept"]]}

    return {
        "settings": {"ids": ids, "new_tokens": new_tokens, "runs": work, "defaults": DEFAULTS},
        "versions": {**kp["versions"], "attn_implementation": kp["attn_implementation"]},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": str(torch.__version__), "python": platform.python_version(),
                    "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")},
        "kvpress": {n: {"kept": [[cmp.to_mask(h.tolist()) for h in k] for k in res["kept"]],
                        "n_kept": [int(k.shape[-1]) for k in res["kept"]], "tokens": res["tokens"],
                        "params": res["params"], "topk_agrees": res["topk_agrees"],
                        "prefill_seconds": res["prefill_seconds"], "decode_seconds": res["decode_seconds"]}
                    for n, res in kp["runs"].items()},
        "reference": {n: slim(res) for n, res in ref.items()},
        "kvlib": {n: slim(res) for n, res in mine.items()},
        "comparisons": rows,
        "seconds": time.perf_counter() - t_all,
    }
