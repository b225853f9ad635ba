"""Measure the book's performance claims on this machine, all in one run.

    python -m kvbench [--json PATH] [--quick] [--threads N] [--compile] [--chunked] [--invariant]
    python -m kvbench --device cuda [--smoke] [--json PATH] ...   # the GPU check: `kvbench.gpu`

`main` is the driver: it loads SmolLM2 once, runs the sections in order (each in its
module, named in `kvbench`), prints the report (`kvbench.report`) and optionally
writes it as JSON. Hugging Face's model is loaded for (c) and (g) only, and dropped
before the rest. The exit status is 1 if any token sequences that must agree did not
(cached vs naive, kvlib vs HF in fp32), else 0: a slow run is not a failure, a wrong one is.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

from kvlib.data import tiny_shakespeare
from kvlib.prepack import available as prepack_available, prepack_weights
from kvlib.pretrained import load_smollm2
from kvlib.validate import positive_int
from .compiled import compiled_step
from .generation import bench_chunked_prefill, bench_decode, bench_generation
from .invariant import invariant_cost
from .paged_read import paged_read_candidates
from .huggingface import hf_bf16, hf_vs_kvlib, load_hf_smollm2
from .plan import FULL, QUICK, prompt_ids
from .precision import precision_ladder
from .report import json_ready, load_average, machine_info, print_report, targets
from .roofline import bench_roofline, same_bytes, thread_scaling
from .serving import engine_vs_vllm
from .split_kv import attention_bandwidth, split_vs_sdpa


def _threads(s: str) -> int:
    """``--threads``: a positive int, or argparse's usage error naming it."""
    try:
        return positive_int("--threads", int(s))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """Run every section at `FULL` sizes (`QUICK` with ``--quick``) and report; 0 if all tokens agreed.

    With ``--device`` it runs the GPU check instead (`kvbench.gpu.main`: random weights at two
    models' shapes, no SmolLM2 file, no Hugging Face), which takes its own arguments.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--device" or a.startswith("--device=") for a in argv):
        from .gpu import main as gpu_main  # imported here: the CPU report never needs it

        return gpu_main(argv)
    p = argparse.ArgumentParser(prog="python -m kvbench", description=__doc__.splitlines()[0],
                                epilog="--device DEVICE runs the GPU check instead (`make gpucheck`'s bench): "
                                       "python -m kvbench --device cuda --help")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--threads", type=_threads, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile on the decode step, compiled FlexAttention in (n) and the "
                   "Engine compiled piecewise in (l) (slow)")
    p.add_argument("--chunked", action="store_true",
                   help="also time the engine's pauses while a 1,000-token prompt is chunked in")
    p.add_argument("--invariant", action="store_true",
                   help="also time the batch-invariant mode against the default kernels")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    print(f"torch.set_num_threads({args.threads}); mode {'quick' if args.quick else 'full'}", flush=True)

    r = {"machine": machine_info(torch.get_num_threads())}
    with torch.inference_mode():
        model, tok = load_smollm2()
        ids = prompt_ids(tok, plan.prompt_len)  # (1, prompt_len)
        print("(a) cached vs naive generation ...", flush=True)
        r["generation"] = bench_generation(model, ids, plan)
        print("(b) decode latency vs context ...", flush=True)
        r["decode"] = bench_decode(model, ids, plan)
        print("(c) kvlib vs Hugging Face generate, fp32 and bf16 ...", flush=True)
        hf = load_hf_smollm2()
        r["hf"] = hf_vs_kvlib(model, hf, ids, plan.hf_tokens)
        r["hf_bf16"] = hf_bf16(hf, ids, plan.hf_tokens)  # (g): converts hf to bf16, so after the fp32 run
        del hf
        print("(d) matvec bandwidth and roofline ...", flush=True)
        r["roofline"] = bench_roofline(model, r["decode"], plan)
        print("(e) decode against matvecs over the same matrices ...", flush=True)
        r["same_bytes"] = same_bytes(model, ids, plan.contexts[0], plan.decode_steps)
        print("(f) precision ladder: fp32, bf16, int8, int4 weights ...", flush=True)
        text = torch.tensor([tok.encode(tiny_shakespeare("val"))[: plan.text_tokens]])  # (1, text_tokens)
        r["precision"] = precision_ladder(ids, text, plan.contexts[0], plan.decode_steps)
        print("(h) attention's bandwidth, and split-KV against fused attention ...", flush=True)
        r["attention"] = attention_bandwidth(model, plan.attention_contexts, plan.matvec_repeats // 4 or 1)
        r["split_kv"] = split_vs_sdpa(model, plan.split_context, plan.splits, plan.matvec_repeats)
        print("(n) paged decode attention: gather, block loops" + (", flex (compiling)" if args.compile else "")
              + " ...", flush=True)
        r["paged_read"] = paged_read_candidates(model.config, plan.paged_read_batch,
                                                repeats=plan.paged_read_repeats, flex=args.compile)
        if plan.serving:
            print("(l) the Engine on the vLLM cross-check's requests ...", flush=True)
            r["serving"] = engine_vs_vllm(model, compiled=args.compile)
        counts = tuple(n for n in (1, 2, 4, 8) if n <= (os.cpu_count() or 1))
        print(f"(m) decode at {', '.join(map(str, counts))} threads ...", flush=True)
        r["threads"] = thread_scaling(model, ids, plan.contexts[0], counts, plan.decode_steps // 2 or 1)
        if args.compile:
            print("(i) torch.compile on the decode step ...", flush=True)
            r["compile"] = compiled_step(model, ids, plan.contexts[0], plan.decode_steps)
        if args.chunked:
            print("(j) chunked prefill: pauses of running sequences ...", flush=True)
            text_ids = tok.encode(tiny_shakespeare("val"))
            r["chunked_masked"] = bench_chunked_prefill(model, text_ids, varlen=False)  # the row under a mask
            r["chunked"] = bench_chunked_prefill(model, text_ids)  # varlen attention, the Engine's default
            if model.dtype == torch.float32 and prepack_available(torch.float32):  # and fp32 packed, as vLLM runs
                r["chunked_packed"] = bench_chunked_prefill(prepack_weights(copy.deepcopy(model)), text_ids)
        if args.invariant:
            print("(k) batch-invariant mode against the default kernels ...", flush=True)
            r["invariant"] = invariant_cost(model, ids, plan.contexts[0], plan.decode_steps // 4 or 1)
        print(flush=True)
    r["machine"]["loadavg_end"] = load_average()
    r["targets"] = targets(r, plan)
    print_report(r, plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_ready(r), f, indent=1)
        print(f"\nwrote {args.json}")
    bad = [f"cached vs naive at {n} new tokens" for n, g in r["generation"].items() if not g["identical"]]
    bad += [] if r["hf"]["identical"] else [f"kvlib vs HF at {plan.hf_tokens} new tokens"]
    if "serving" in r and r["serving"]["identical_requests"] != r["serving"]["requests"]:
        bad.append("the Engine against vLLM's stored tokens")
    for what in bad:
        print(f"!!! TOKENS DIFFER: {what} !!!", file=sys.stderr)
    return 1 if bad else 0
