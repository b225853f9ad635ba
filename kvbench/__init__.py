"""The book's performance claims, measured on this machine: ``python -m kvbench``.

    python -m kvbench [--json PATH] [--quick] [--threads N] [--compile] [--chunked] [--invariant]

One run loads SmolLM2-135M and measures twelve things (fifteen with the flags), each section in the module of its
idea:

======  ==========================================================  =====================
(a)     cached vs naive greedy generation                            `kvbench.generation`
(b)     per-token decode latency as the context grows                `kvbench.generation`
(c)     kvlib vs Hugging Face ``generate``, fp32, same weights       `kvbench.huggingface`
(d)     roofline: decode's bandwidth against a plain matvec's        `kvbench.roofline`
(e)     decode against bare matvecs over the model's own matrices    `kvbench.roofline`
(f)     precision ladder: fp32, bf16, packed bf16, int8, int4        `kvbench.precision`
(g)     kvlib vs Hugging Face ``generate``, bf16                     `kvbench.huggingface`
(h)     attention's bandwidth; split-KV vs PyTorch's fused kernel    `kvbench.split_kv`
(i)     ``torch.compile`` on the decode step (``--compile`` only)    `kvbench.compiled`
(j)     engine pauses in a chunked prefill (``--chunked`` only)      `kvbench.generation`
(k)     batch-invariant mode vs default (``--invariant`` only)       `kvbench.invariant`
(l)     the `Engine` on the vLLM cross-check's requests              `kvbench.serving`
(m)     decode at 1, 2, 4, 8 threads (up to the CPU's count)         `kvbench.roofline`
(n)     paged decode attention: gather, block loops, flex            `kvbench.paged_read`
        (flex compiled: ``--compile`` only); K/V bytes each copies
======  ==========================================================  =====================

`kvbench.plan` holds the sizes (`FULL`, the book's run; `QUICK`, a smoke test) and the
prompt; `kvbench.report` the table, the targets and the JSON; `kvbench.cli` the
command line that runs the sections in order. The timing helpers are `kvlib.timing`'s.

``python -m kvbench --device cuda`` runs the GPU check instead, stage 2 of ``make gpucheck``: random
weights at SmolLM2-135M's and Llama-3.1-8B's shapes in bf16, decode against the HBM's copy bandwidth
(eager and from a CUDA graph), attention at 4k and 32k tokens by SDPA backend, paged against
contiguous, prefill FLOP/s and the roofline's prediction, written as ``kvbench/data/bench_gpu.json``.
Its driver and smoke test are `kvbench.gpu`, its measurements `kvbench.gpubench`, its record's
format `kvbench.gpurecord` (`load_gpu_record` is None until a GPU has run it); ``--device cpu
--quick`` runs the same code at toy sizes in seconds.

CPUs are noisy, so read ratios, not absolute numbers: wherever two things are compared
they are timed taking turns, so that load from other processes hits both alike. The
stored run the chapters quote is `kvbench.load_record`. ``import kvbench``
imports torch but not transformers (only (c) and (g) load it).
"""

from .cli import main
from .compiled import compiled_step, operator_calls
from .gpurecord import check_gpu_record, load_gpu_record
from .generation import bench_chunked_prefill, bench_decode, bench_generation, pauses_while_prefilling
from .invariant import invariant_cost
from .huggingface import hf_bf16, hf_vs_kvlib, load_hf_smollm2, race_hf
from .plan import FULL, PROMPT_TEXT, QUICK, Plan, prompt_ids
from .precision import BATCH, ladder_models, precision_ladder, scored
from .report import (header, json_ready, load_average, load_record, machine_info, print_report, table_rows,
                     targets)
from .roofline import (MATVEC_BIG, MATVEC_COUNT, MATVEC_SMALL, bare_matvecs, bench_roofline, kernel_sweep, same_bytes,
                       thread_scaling)
from .paged_read import decode_rows, paged_read_candidates
from .serving import engine_vs_vllm
from .split_kv import attention_bandwidth, split_vs_sdpa

__all__ = [
    # sizes and inputs
    "Plan", "FULL", "QUICK", "PROMPT_TEXT", "prompt_ids",
    # (a), (b)
    "bench_generation", "bench_decode",
    # (c), (g)
    "load_hf_smollm2", "race_hf", "hf_vs_kvlib", "hf_bf16",
    # (d), (e)
    "MATVEC_BIG", "MATVEC_SMALL", "MATVEC_COUNT", "bench_roofline", "bare_matvecs", "same_bytes",
    "kernel_sweep",
    # (f)
    "scored", "BATCH", "ladder_models", "precision_ladder",
    # (h)
    "attention_bandwidth", "split_vs_sdpa",
    # (i)
    "compiled_step", "operator_calls",
    # (j)
    "bench_chunked_prefill", "pauses_while_prefilling",
    # (k)
    "invariant_cost",
    # (l), (m)
    "engine_vs_vllm", "thread_scaling",
    # (n)
    "decode_rows", "paged_read_candidates",
    # the report and the command line
    "load_average", "machine_info", "header", "table_rows", "targets", "print_report", "json_ready", "main",
    # the stored run the chapters quote, and the GPU's (None until `make gpucheck` has run on one)
    "load_record", "load_gpu_record", "check_gpu_record",
]
