"""``python -m kvbench --device cuda``: the one-shot GPU check's smoke test and bench.

    python -m kvbench --device cuda --smoke                 # stage 0 of `make gpucheck`: under a minute
    python -m kvbench --device cuda --json PATH [--suite-xml X --suite-seconds S --suite-status N]
    python -m kvbench --device cpu --quick --json PATH      # the same code at toy sizes, seconds on a CPU

`smoke` says what the machine has (Python, torch, CUDA, the GPU) and checks, on a tiny
kvlib model, that cached decode equals recompute and that a bf16 matmul runs; with no
CUDA device it exits `NO_CUDA` (2) at once, so a broken environment costs seconds. `run`
measures each shape of a `kvbench.gpubench.GpuPlan` (`FULL`: SmolLM2-135M's and
Llama-3.1-8B's, random weights, bf16) and builds the record (``kv-bench-gpu/1``, checked
by `kvbench.gpurecord.check_gpu_record` before it is written), with the unit suite's
counts from its JUnit XML (`suite_counts`) and the issue's two targets (`targets`): decode
at batch 1 on the 8B shape reading at least 60% of the HBM's copy bandwidth, and the
roofline's prediction within its band; a missed one holds the measured reason.

The CUDA graphs are captured last, after every other measurement of both shapes: a capture
that fails is recorded (``graphs_error``) and can disturb nothing measured before it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

from kvlib import memory
from kvlib.cache import StaticCache
from kvlib.config import PRESETS, ModelConfig
from kvlib.generate import decode_step, generate, generate_naive, prefill
from kvlib.model import Transformer
from . import gpubench as gb
from .gpurecord import FORMAT, PART_KEYS, check_gpu_record
from .report import json_ready

#: The exit status of the smoke stage when the machine has no CUDA device.
NO_CUDA = 2
#: The issue's target: decode at batch 1 on the 8B shape reaches this share of the HBM's copy bandwidth.
HBM_TARGET = 0.6
TARGET_SHAPE = "llama-3.1-8b"


# -- the machine ----------------------------------------------------------------------------------------
def cuda_missing(device: torch.device) -> str | None:
    """Why ``device`` cannot run here (a sentence naming torch's view of the machine), or None."""
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) < count:
        return None
    return (f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees {count} GPU(s), "
            f"so {device} cannot run; run `make gpucheck` on a machine with a GPU, or "
            f"`python -m kvbench --device cpu --quick` to try the code here")


def driver_version() -> str | None:
    """The NVIDIA driver's version (``570.86.15``), from the kernel module or ``nvidia-smi``; None if neither."""
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d[\d.]*)", Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(device: torch.device) -> dict:
    """The record's ``machine``: the GPU (None off CUDA), driver, CUDA, torch, Python, date, TF32."""
    cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    return {
        "gpu": props.name if cuda else None,
        "capability": f"{props.major}.{props.minor}" if cuda else None,
        "memory_bytes": props.total_memory if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "driver": driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "device": str(device),
    }


# -- stage 0: the smoke test ------------------------------------------------------------------------------
def smoke_checks(device: torch.device) -> list[str]:
    """What must hold before the check spends GPU time, on ``device``: a list of failures (empty: all held).

    A tiny kvlib model in fp32 (TF32 off): greedy tokens from cached decode equal recompute's,
    and each decode step's logits equal a full forward's last row within 1e-4; a bf16 matmul
    runs and is within bf16's rounding of the fp32 product.
    """
    failures = []

    def check(what: str, fn: Callable[[], str | None]) -> None:
        try:
            bad = fn()
        except Exception as e:  # the smoke test reports every failure, then stops the script
            bad = f"{type(e).__name__}: {e}"
        if bad:
            failures.append(f"{what}: {bad}")

    model = Transformer(PRESETS["tiny"], device=device)
    model.reset_parameters(seed=0, std=0.2)
    prompt = torch.tensor([[5, 17, 3, 99, 42]], device=device)  # (1, 5)

    def tokens() -> str | None:
        cached, naive = generate(model, prompt, 8), generate_naive(model, prompt, 8)
        return None if torch.equal(cached, naive) else f"cached {cached.tolist()} != recompute {naive.tolist()}"

    def logits() -> str | None:
        cache = StaticCache.for_model(model, 1, 16)
        out, ids, worst = prefill(model, prompt, cache), prompt, 0.0
        for _ in range(4):
            nxt = out.argmax(-1)  # (1,)
            ids = torch.cat([ids, nxt[:, None]], dim=1)  # (1, T + 1)
            out = decode_step(model, nxt, cache)  # (1, vocab)
            with torch.inference_mode():
                full = model(ids)[:, -1]  # (1, vocab): recomputed from scratch
            worst = max(worst, (out - full).abs().max().item())
        return None if worst < 1e-4 else f"decode logits differ from recompute by {worst:.2e} (limit 1e-4)"

    def bf16() -> str | None:
        g = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(256, 256, generator=g, device=device) for _ in range(2))
        err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max().item() / (a @ b).abs().max().item()
        return None if err < 0.05 else f"bf16 matmul off by {err:.1%} of the fp32 product's largest entry"

    check("cached decode = recompute (tokens)", tokens)
    check("cached decode = recompute (logits)", logits)
    check("bf16 matmul", bf16)
    return failures


def smoke(device: torch.device) -> int:
    """Stage 0: print the machine, run `smoke_checks`; 0 if all held, 1 if not, `NO_CUDA` without CUDA."""
    t0 = time.perf_counter()
    print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}",
          flush=True)
    why = cuda_missing(device)
    if why:
        print(f"gpucheck smoke: {why}", file=sys.stderr)
        return NO_CUDA
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}, driver {driver_version()}", flush=True)
        torch.backends.cuda.matmul.allow_tf32 = False  # reference comparisons in full fp32
        torch.backends.cudnn.allow_tf32 = False
    failures = smoke_checks(device)
    for f in failures:
        print(f"gpucheck smoke FAILED: {f}", file=sys.stderr)
    print(f"smoke on {device}: {'ok' if not failures else f'{len(failures)} failed'} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


# -- stage 1: the unit suite's counts -------------------------------------------------------------------
def suite_counts(xml_path: str | os.PathLike | None, seconds: float | None = None, status: int | None = None,
                 command: str | None = None) -> dict:
    """The record's ``suite``: passed, failed, skipped and errors from pytest's JUnit XML.

    Counts are None when the suite did not run (no path) or stopped before writing its XML.
    """
    out = {"passed": None, "failed": None, "skipped": None, "errors": None, "seconds": seconds,
           "command": command, "status": status}
    if xml_path is None:
        return out | {"note": "the unit suite was not run"}
    if not Path(xml_path).is_file():
        return out | {"note": f"no JUnit XML at {xml_path}: the suite stopped (status {status}) before writing it"}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out |= {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "skipped": n["skipped"], "errors": n["errors"]}
    if status == 124:  # timeout(1)'s status: pytest got SIGINT at the time box and wrote what had run
        out["note"] = f"stopped at its time box after {seconds} s: the counts are of the tests that ran by then"
    return out


# -- stage 2: the bench ---------------------------------------------------------------------------------
def attempt(what: str, fn: Callable[[], dict], keys: tuple[str, ...] = ()) -> dict:
    """``fn()``, or, if it raises, ``keys`` set to None and an ``error`` naming what failed: one section
    that fails on a new GPU or torch leaves the others measured."""
    try:
        return fn()
    except Exception as e:
        print(f"!!! {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dict.fromkeys(keys) | {"error": f"{type(e).__name__}: {e}"[:400]}


def config_dict(config: ModelConfig) -> dict:
    keys = ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "vocab_size", "max_seq_len",
            "tie_embeddings", "name")
    return {k: getattr(config, k) for k in keys}


def bench_shape(config: ModelConfig, device: torch.device, hbm_bandwidth: float, plan: gb.GpuPlan) -> tuple[dict, list]:
    """One shape's entry of the record, and the decode steps whose CUDA graphs `run` captures last."""
    model = gb.random_model(config, device)
    decode, graphs = [], []
    for b in plan.batches:
        cache, tok = gb.filled_cache(model, b, plan.context)
        entry = attempt(f"decode at batch {b}", lambda: gb.decode(model, cache, tok, hbm_bandwidth, plan),
                        PART_KEYS["decode"])
        decode.append(entry | {"batch": b, "context": plan.context})
        graphs.append((decode[-1], model, cache, tok))
    steps = ", ".join(f"batch {d['batch']} {_ms(d['step_s'])}" for d in decode)
    print(f"  decode: {steps}", flush=True)
    attn = [attempt(f"attention at {c}", lambda c=c: gb.attention(config, 1, c, device, plan),
                    PART_KEYS["attention"]) | {"context": c, "batch": 1} for c in plan.attention_contexts]
    paged = attempt("paged attention", lambda: gb.paged(config, device, plan), PART_KEYS["paged"])
    pre = attempt("prefill", lambda: gb.prefill(model, plan), PART_KEYS["prefill"])
    print("  attention, paged, prefill: done", flush=True)
    roof_keys = PART_KEYS["roofline"]
    roof = (attempt("roofline", lambda: gb.roofline(config, device, decode[0], plan), roof_keys)
            if decode[0]["step_s"] else dict.fromkeys(roof_keys) | {"error": "no decode step at batch 1 to predict"})
    print(f"  roofline: predicted {_ms(roof['predicted_step_s'])}, measured {_ms(roof['measured_step_s'])}",
          flush=True)
    return {"config": config_dict(config), "dtype": gb.DTYPE, "weight_bytes": memory.weight_bytes(config, gb.DTYPE),
            "decode": decode, "attention": attn, "paged": paged, "prefill": pre, "roofline": roof}, graphs


def run(plan: gb.GpuPlan, device: torch.device, suite: dict) -> dict:
    """Every measurement of ``plan`` on ``device``: the record, targets included (not yet checked)."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    machine = machine_info(device)
    print(f"HBM copy, {plan.copy_bytes / 2**20:,.0f} MiB ...", flush=True)
    hbm = gb.hbm_copy(plan.copy_bytes, device, plan.warmup, plan.repeats, machine["gpu"])
    shapes, graphs = {}, []
    for name, config in plan.shapes:
        print(f"{name} ({config.name}, {gb.DTYPE}, random weights) ...", flush=True)
        shapes[name], jobs = bench_shape(config, device, hbm["bandwidth_bytes_s"], plan)
        graphs += jobs
    print("CUDA graphs ...", flush=True)
    for entry, model, cache, tok in graphs:
        if entry["step_s"] is not None:
            entry.update(gb.graphed_decode(model, cache, tok, plan))
    del graphs
    record = {"format": FORMAT, "mode": "quick" if plan.quick else "full", "machine": machine, "suite": suite,
              "hbm": hbm, "shapes": shapes}
    record["targets"] = targets(record)
    record["seconds"] = time.perf_counter() - t0
    return record


# -- the targets ----------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3g} ms"


def _gbs(x: float) -> str:
    return f"{x / 1e9:,.0f} GB/s"


def decode_reason(b1: dict, hbm_bandwidth: float) -> str:
    """Why decode at batch 1 read less than `HBM_TARGET` of the copy bandwidth, in its own numbers."""
    if b1.get("step_s") is None:
        return f"decode at batch 1 was not measured: {b1.get('error')}"
    at_copy = b1["bytes_read"] / hbm_bandwidth
    text = (f"decode at batch 1 read {_gbs(b1['bandwidth_bytes_s'])}, {b1['hbm_fraction']:.0%} of the "
            f"{_gbs(hbm_bandwidth)} the HBM copies at: the step took {_ms(b1['step_s'])} where its "
            f"{b1['bytes_read'] / 1e9:.2f} GB take {_ms(at_copy)} at copy speed")
    g = b1.get("graphs_step_s")
    if g is not None:
        return text + (f"; replayed from a CUDA graph it took {_ms(g)} ({at_copy / g:.0%} of the copy bandwidth), "
                       f"so the CPU issuing kernels cost {_ms(max(0.0, b1['step_s'] - g))} of the eager step")
    return text + f"; no CUDA graph replay to compare ({b1.get('graphs_error', 'not captured')})"


def roofline_reason(roof: dict) -> str:
    """Why the measured step fell outside the roofline's band, by the prediction's parts."""
    if roof.get("ratio") is None:
        return f"the roofline was not compared: {roof.get('error')}"
    p, lo, hi = roof["parts"], *roof["band"]
    over = roof["measured_step_s"] / roof["overlapped_step_s"]
    return (f"measured {_ms(roof['measured_step_s'])} against a predicted {_ms(roof['predicted_step_s'])} "
            f"(ratio {roof['ratio']:.2f}, band {lo}-{hi}); the prediction adds {_ms(p['overhead_s'])} of overhead "
            f"measured in place to {_ms(p['matmul_s'])} of weight reads and {_ms(p['attention_s'])} of attention; "
            f"with the overhead overlapping the kernels it would be {_ms(roof['overlapped_step_s'])} "
            f"(ratio {over:.2f}), and the bare roofline {_ms(roof['bound_s'])}")


def targets(record: dict) -> list[dict]:
    """The issue's two targets on the 8B shape, each met or holding the measured reason."""
    shape = record["shapes"][TARGET_SHAPE]
    b1 = next(d for d in shape["decode"] if d["batch"] == 1)
    frac, roof = b1.get("hbm_fraction"), shape["roofline"]
    hbm_met = frac is not None and frac >= HBM_TARGET
    return [
        {"name": "decode_b1_hbm_fraction", "shape": TARGET_SHAPE, "value": frac, "target": HBM_TARGET,
         "met": hbm_met, "reason": None if hbm_met else decode_reason(b1, record["hbm"]["bandwidth_bytes_s"])},
        {"name": "roofline_within_band", "shape": TARGET_SHAPE, "value": roof.get("ratio"),
         "band": list(gb.ROOFLINE_BAND), "met": bool(roof.get("within")),
         "reason": None if roof.get("within") else roofline_reason(roof)},
    ]


def print_table(record: dict) -> None:
    """The record in a few lines: the machine, the suite, and per shape what the bench measured."""
    m, s, hbm = record["machine"], record["suite"], record["hbm"]
    print(f"\nGPU check ({record['mode']}): {m['gpu'] or m['device']}, driver {m['driver']}, CUDA {m['cuda']}, "
          f"torch {m['torch']}, {m['date']}")
    took = "" if s["seconds"] is None else f" in {s['seconds']:.0f} s"
    print(f"suite: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['errors']} errors{took}")
    spec = "" if hbm["spec_bytes_s"] is None else f" (spec sheet {_gbs(hbm['spec_bytes_s'])})"
    print(f"HBM copy: {_gbs(hbm['bandwidth_bytes_s'])}{spec}")
    for name, sh in record["shapes"].items():
        print(f"{name}:")
        for d in sh["decode"]:
            if d["step_s"] is not None:
                print(f"  decode B={d['batch']:<2} S={d['context']}: {_ms(d['step_s'])}, "
                      f"{_gbs(d['bandwidth_bytes_s'])}, {d['hbm_fraction']:.0%} of HBM; "
                      f"CUDA graph {_ms(d['graphs_step_s'])}")
        for a in sh["attention"]:
            if a["step_s"] is not None:
                print(f"  attention S={a['context']}: {a['backend']}, {_ms(a['step_s'])}, "
                      f"{_gbs(a['bandwidth_bytes_s'])}")
        p, f, r = sh["paged"], sh["prefill"], sh["roofline"]
        if p["ratio"] is not None:
            print(f"  paged / contiguous at S={p['context']}, B={p['batch']}: {p['ratio']:.2f}x")
        if f["flop_s"] is not None:
            print(f"  prefill {f['tokens']} tokens: {_ms(f['step_s'])}, {f['flop_s'] / 1e12:.1f} TFLOP/s")
        if r["ratio"] is not None:
            print(f"  roofline: predicted {_ms(r['predicted_step_s'])}, measured {_ms(r['measured_step_s'])}, "
                  f"ratio {r['ratio']:.2f} (band {r['band'][0]}-{r['band'][1]})")
    for t in record["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target {t['name']} ({t['shape']}): {value}, {'met' if t['met'] else 'NOT met: ' + t['reason']}")


def errors(record: dict) -> list[str]:
    """Every section of the record that failed, as ``where: error``."""
    found = []

    def walk(x: object, where: str) -> None:
        if isinstance(x, dict):
            if "error" in x:
                found.append(f"{where}: {x['error']}")
            for k, v in x.items():
                walk(v, f"{where}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    walk(record.get("shapes"), "shapes")
    return found


# -- the command line ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m kvbench --device ...``: 0 when the record is written whole, 1 if a section failed
    (the record is written with its errors), `NO_CUDA` when asked for CUDA on a machine without it."""
    p = argparse.ArgumentParser(prog="python -m kvbench", description="The one-shot GPU check's smoke test and "
                                "bench (stages 0 and 2 of `make gpucheck`); see book/checks.md, \"The GPU check\".")
    p.add_argument("--device", required=True, help="cuda (or cuda:N); cpu with --quick")
    p.add_argument("--smoke", action="store_true", help="stage 0 only: the machine, and kvlib's decode on it")
    p.add_argument("--quick", action="store_true", help="toy shapes and contexts (seconds on a CPU)")
    p.add_argument("--json", metavar="PATH", help="write the record (kv-bench-gpu/1) here")
    p.add_argument("--suite-xml", metavar="PATH", help="the unit suite's JUnit XML, counted into the record")
    p.add_argument("--suite-seconds", type=float, help="how long the suite ran")
    p.add_argument("--suite-status", type=int, help="the suite's exit status (124: stopped by its time box)")
    p.add_argument("--suite-command", help="the command that ran the suite")
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r} is not a torch device ({e}): use cuda, cuda:N or cpu")
    if args.smoke:
        return smoke(device)
    why = cuda_missing(device)
    if why:
        print(f"gpucheck: {why}", file=sys.stderr)
        return NO_CUDA
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and not args.quick):
        p.error(f"--device {args.device}: the check runs on cuda, or on cpu with --quick (the full shapes "
                f"need a GPU's memory: the 8B model alone is 16 GB)")
    suite = suite_counts(args.suite_xml, args.suite_seconds, args.suite_status, args.suite_command)
    record = json_ready(run(gb.QUICK if args.quick else gb.FULL, device, suite))
    check_gpu_record(record)
    print_table(record)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    failed = errors(record)
    for f in failed:
        print(f"!!! {f}", file=sys.stderr)
    return 1 if failed else 0


__all__ = ["NO_CUDA", "HBM_TARGET", "cuda_missing", "driver_version", "machine_info", "smoke_checks", "smoke",
           "suite_counts", "run", "targets", "print_table", "errors", "main"]
