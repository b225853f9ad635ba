"""The GPU check's measurements: one model shape, random weights, bf16, on one device.

Each function measures one thing and returns it as the GPU record writes it
(`kvbench.gpurecord`; the format is ``kv-bench-gpu/1``): the HBM's copy bandwidth, a
decode step against it (eager, and replayed from a CUDA graph), attention over every
layer's cache with the SDPA backend that ran it, kvlib's paged read against a contiguous
cache, a prefill's FLOP/s, and the roofline's prediction (`kvlib.hardware.step_time` on a
`kvlib.hardware.measure` profile of this device) against the measured step.

Every byte and FLOP count is kvlib's (`kvlib.cost`, `kvlib.memory`), never inferred from
a timing; every time is the median of `GpuPlan.repeats` calls timed by
`kvlib.timing.timeit`, each call ending in a device synchronize, so a GPU's queued work
is inside the time. The weights are random (the GPU machine has no SmolLM2 file and the
record's shapes are 8B), so nothing here checks tokens: `kvbench.gpu.smoke` does that.
`kvbench.gpu` runs these in order and writes the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlib import cost, hardware, memory
from kvlib.attention import attend
from kvlib.cache import StaticCache
from kvlib.config import PRESETS, ModelConfig
from kvlib.generate import decode_step
from kvlib.model import Transformer
from kvlib.paged import gather
from kvlib.timing import timeit

#: The record's one dtype: what the two models are served in.
DTYPE = "bf16"
TORCH_DTYPE = hardware.TORCH_DTYPES[DTYPE]

#: The roofline's stated band: the measured step over `kvlib.hardware.step_time`'s prediction.
#: Within 25% either way (a factor of 1.25 up, 0.8 down) the model prices every part of the
#: step; further off, it misprices one, and the record says which part by its numbers.
ROOFLINE_BAND = (0.8, 1.25)

#: SDPA's backends by the names the record uses (`torch.nn.attention.SDPBackend`).
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


@dataclass(frozen=True)
class GpuPlan:
    """The sizes of one GPU check: which shapes, and every context, batch and repeat count."""

    shapes: tuple[tuple[str, ModelConfig], ...]  # (the record's name, the config run at it)
    batches: tuple[int, int] = (1, 32)  # decode batches (the record requires 1 and 32)
    context: int = 1024  # tokens cached at every decode step
    attention_contexts: tuple[int, ...] = (4096, 32768)
    paged_context: int = 4096
    paged_batch: int = 8
    block_size: int = 16
    prefill_tokens: int = 2048
    copy_bytes: int = 2 * 2**30  # the HBM copy's buffer (each copy reads it and writes as much)
    warmup: int = 3
    repeats: int = 20
    backend_repeats: int = 5  # each SDPA backend forced in turn
    measure_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # `kvlib.hardware.measure`'s
    measure_nbytes: int = 512 * 2**20
    quick: bool = False


def scaled_down(config: ModelConfig) -> ModelConfig:
    """``config`` at toy size for ``--quick``: 2 layers, head_dim 16, vocabulary 256, with its
    ratio of query to KV heads and its tied or untied embeddings kept."""
    group = config.n_head // config.n_kv_head
    return config.replace(n_layer=2, n_head=group, n_kv_head=1, head_dim=16, d_model=16 * group, d_ff=128,
                          vocab_size=256, max_seq_len=1024, name=f"{config.name}, scaled down (--quick)")


#: The check the GPU runs: SmolLM2-135M's shape and Llama-3.1-8B's (its 128k context covers 32k).
FULL = GpuPlan(shapes=(("smollm2-135m", PRESETS["smollm2-135m"]), ("llama-3.1-8b", PRESETS["llama-3.1-8b"])))
#: The same code at toy sizes, seconds on a CPU: what the tests run.
QUICK = GpuPlan(shapes=tuple((name, scaled_down(c)) for name, c in FULL.shapes), context=32,
                attention_contexts=(64, 256), paged_context=64, paged_batch=2, prefill_tokens=32,
                copy_bytes=8 * 2**20, warmup=1, repeats=3, backend_repeats=2, measure_rows=(1, 32),
                measure_nbytes=2**20, quick=True)


def median_time(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` by `kvlib.timing.timeit`, each call synchronized on ``device``."""
    return timeit(fn, warmup=warmup, repeats=repeats, device=device)["median"]


def random_model(config: ModelConfig, device: torch.device, seed: int = 0) -> Transformer:
    """A `kvlib.Transformer` of ``config`` in bf16 on ``device``, its weights drawn there
    (normal, std 0.02; norms at 1): an 8B model's 16 GB never pass through the host."""
    model = Transformer(config, device="meta", dtype=TORCH_DTYPE).to_empty(device=device).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def spec_bandwidth(gpu_name: str | None) -> float | None:
    """The spec sheet's memory bandwidth (bytes/s) of a GPU named as CUDA names it, from
    `kvlib.hardware.HARDWARE`; None for a GPU (or a variant, like the H100 PCIe) it lacks."""
    name = (gpu_name or "").upper()
    if "H200" in name:
        key = "h200"
    elif "H100" in name and ("SXM" in name or "HBM3" in name):  # the SXM part reports "H100 80GB HBM3"
        key = "h100"
    elif "A100" in name and "SXM" in name and "80GB" in name:
        key = "a100"
    else:
        key = {"NVIDIA L4": "l4", "TESLA T4": "t4", "NVIDIA GEFORCE RTX 4090": "rtx4090"}.get(name.strip())
    return hardware.HARDWARE[key].mem_bandwidth if key else None


def hbm_copy(nbytes: int, device: torch.device, warmup: int, repeats: int, gpu_name: str | None = None) -> dict:
    """The device memory's copy bandwidth: one buffer of ``nbytes`` copied into another.
    ``copy_bytes`` counts what a copy moves, read and written: ``2 * nbytes``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device, warmup, repeats)
    del src, dst
    return {"copy_bytes": 2 * nbytes, "bandwidth_bytes_s": 2 * nbytes / seconds,
            "spec_bytes_s": spec_bandwidth(gpu_name), "step_s": seconds}


def filled_cache(model: Transformer, batch: int, context: int) -> tuple[StaticCache, torch.Tensor]:
    """A `kvlib.StaticCache` holding ``context`` tokens of ``batch`` sequences (a constant: a step's
    time does not depend on the numbers) and room for one more, and the step's tokens ``(B,)``."""
    cache = StaticCache.for_model(model, batch, context + 1)
    for keys, values in zip(cache.keys, cache.values):
        keys.fill_(0.5)
        values.fill_(0.5)
    cache.lengths = [context] * model.config.n_layer
    return cache, torch.zeros(batch, dtype=torch.long, device=model.device)


def decode(model: Transformer, cache: StaticCache, tok: torch.Tensor, hbm_bandwidth: float,
           plan: GpuPlan) -> dict:
    """One decode step at the cache's context, timed, against the HBM's copy bandwidth.

    ``bytes_read`` is `kvlib.cost.step_bytes`'s total: every weight once, every cached key
    and value, the new ones written. The cache is cropped back after each step, so every
    call sees the same context.
    """
    context, batch = cache.get_seq_length(), tok.shape[0]

    def step() -> None:
        decode_step(model, tok, cache)
        cache.crop(context)

    seconds = median_time(step, model.device, plan.warmup, plan.repeats)
    nbytes = cost.step_bytes(model.config, batch, context, 1, DTYPE)["total"]
    return {"batch": batch, "context": context, "step_s": seconds, "bytes_read": nbytes,
            "bandwidth_bytes_s": nbytes / seconds, "hbm_fraction": nbytes / seconds / hbm_bandwidth,
            "graphs_step_s": None}


def graphed_decode(model: Transformer, cache: StaticCache, tok: torch.Tensor, plan: GpuPlan) -> dict:
    """The same decode step captured once in a CUDA graph (``torch.cuda.CUDAGraph``) and replayed:
    ``{"graphs_step_s": s}``, or ``{"graphs_step_s": None, "graphs_error": why}``.

    A `kvlib.StaticCache` keeps its buffers' addresses, which a replay needs: the captured step
    writes slot ``context`` and reads the first ``context + 1`` keys, as every eager step here
    does, so replaying it is that step without the CPU issuing its kernels.
    """
    device = model.device
    if device.type != "cuda":
        return {"graphs_step_s": None, "graphs_error": f"CUDA graphs need a CUDA device; this run is on {device}"}
    context = cache.get_seq_length()
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                decode_step(model, tok, cache)
                cache.crop(context)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            decode_step(model, tok, cache)
        cache.crop(context)  # the lengths are the host's: each replay writes and reads the captured slots
        return {"graphs_step_s": median_time(graph.replay, device, plan.warmup, plan.repeats)}
    except Exception as e:  # the record holds why capture failed, and the check goes on
        cache.crop(context)
        return {"graphs_step_s": None, "graphs_error": f"{type(e).__name__}: {e}"[:400]}


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """The backend ``F.scaled_dot_product_attention`` picks for these inputs (GQA on), by its
    dispatcher's own choice (``torch._fused_sdp_choice``): flash, efficient, cudnn or math."""
    gqa = q.shape[1] != k.shape[1]
    try:
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa))
    except (AttributeError, TypeError, RuntimeError, ValueError) as e:  # a private API: say so, not guess
        return f"unknown ({type(e).__name__})"
    return {b: n for n, b in BACKENDS.items()}.get(choice, choice.name.lower())


def _kv(config: ModelConfig, batch: int, context: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Every layer's keys or values, ``(n_layer, B, H_kv, S, D)``, random."""
    shape = (config.n_layer, batch, config.n_kv_head, context, config.head_dim)
    return torch.empty(shape, dtype=TORCH_DTYPE, device=device).normal_(generator=g)


def attention(config: ModelConfig, batch: int, context: int, device: torch.device, plan: GpuPlan) -> dict:
    """One decode token's attention over every layer's cache of ``context`` tokens, through
    `kvlib.attention.attend` (the model's own call: SDPA, GQA on), and each SDPA backend forced
    in turn (``backends``: seconds, or None where it refuses these inputs)."""
    g = torch.Generator(device=device).manual_seed(1)
    k, v = _kv(config, batch, context, device, g), _kv(config, batch, context, device, g)
    q = torch.empty(batch, config.n_head, 1, config.head_dim, dtype=TORCH_DTYPE, device=device).normal_(generator=g)

    def step() -> None:
        for i in range(config.n_layer):
            attend(q, k[i], v[i], None)  # (B, H, 1, D)

    seconds = median_time(step, device, plan.warmup, plan.repeats)
    backends, refused = {}, {}
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                backends[name] = median_time(step, device, 1, plan.backend_repeats)
        except RuntimeError as e:  # this backend does not take these inputs here
            backends[name], refused[name] = None, str(e).strip().splitlines()[0][:200]
    nbytes = memory.kv_cache_bytes(config, context, batch, DTYPE)
    out = {"context": context, "batch": batch, "backend": sdpa_backend(q, k[0], v[0]), "step_s": seconds,
           "bytes_read": nbytes, "bandwidth_bytes_s": nbytes / seconds, "backends": backends}
    return out | ({"backends_refused": refused} if refused else {})


def paged(config: ModelConfig, device: torch.device, plan: GpuPlan) -> dict:
    """kvlib's paged read against a contiguous cache, same keys, one decode token, every layer.

    Paged is what a `kvlib.paged.PagedBatch` step does per layer: `kvlib.paged.gather` copies
    each sequence's blocks out of the pool through its block table (shuffled here, as a busy
    pool leaves them), then `attend` runs with the batch's padding mask. Contiguous is
    `attend` over a ``(B, H_kv, S, D)`` cache holding the same keys. ``gather_step_s`` times
    the copies alone; ``max_abs_diff`` is between the two outputs (the same attention).
    """
    B, S, bs = plan.paged_batch, plan.paged_context, plan.block_size
    n = -(-S // bs)  # blocks per sequence
    g = torch.Generator(device=device).manual_seed(2)
    shape = (config.n_layer, B * n, bs, config.n_kv_head, config.head_dim)  # every layer's pool
    k_pool = torch.empty(shape, dtype=TORCH_DTYPE, device=device).normal_(generator=g)
    v_pool = torch.empty(shape, dtype=TORCH_DTYPE, device=device).normal_(generator=g)
    tables = torch.randperm(B * n, generator=torch.Generator().manual_seed(3)).view(B, n).to(device)  # (B, n)
    k = torch.stack([gather(k_pool[i], tables, S) for i in range(config.n_layer)])  # (L, B, H_kv, S, D)
    v = torch.stack([gather(v_pool[i], tables, S) for i in range(config.n_layer)])
    q = torch.empty(B, config.n_head, 1, config.head_dim, dtype=TORCH_DTYPE, device=device).normal_(generator=g)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=device)  # PagedBatch.mask() at equal lengths

    def contiguous() -> list:
        return [attend(q, k[i], v[i], None) for i in range(config.n_layer)]

    def paged_read() -> list:
        return [attend(q, gather(k_pool[i], tables, S), gather(v_pool[i], tables, S), mask)
                for i in range(config.n_layer)]

    def copies() -> list:
        return [(gather(k_pool[i], tables, S), gather(v_pool[i], tables, S)) for i in range(config.n_layer)]

    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(contiguous(), paged_read()))
    t = {name: median_time(fn, device, plan.warmup, plan.repeats)
         for name, fn in (("contiguous", contiguous), ("paged", paged_read), ("gather", copies))}
    return {"context": S, "batch": B, "block_size": bs, "contiguous_step_s": t["contiguous"],
            "paged_step_s": t["paged"], "ratio": t["paged"] / t["contiguous"], "gather_step_s": t["gather"],
            "paged_backend": sdpa_backend(q, k[0], v[0], mask), "max_abs_diff": diff}


def prefill(model: Transformer, plan: GpuPlan) -> dict:
    """A prefill of ``plan.prefill_tokens`` tokens (one sequence, no cache, logits of the last
    only, as `kvlib.prefill` runs it), in FLOP/s by `kvlib.cost.step_flops`'s count."""
    T = plan.prefill_tokens
    g = torch.Generator(device=model.device).manual_seed(4)
    ids = torch.randint(model.config.vocab_size, (1, T), generator=g, device=model.device)  # (1, T)

    @torch.inference_mode()
    def step() -> None:
        model(ids, last_only=True)

    seconds = median_time(step, model.device, plan.warmup, max(3, plan.repeats // 4))
    flops = cost.step_flops(model.config, 1, 0, T)["total"]
    return {"tokens": T, "step_s": seconds, "flops": flops, "flop_s": flops / seconds}


def roofline(config: ModelConfig, device: torch.device, measured: dict, plan: GpuPlan) -> dict:
    """The roofline chapter's model against the measured batch-1 step: `kvlib.hardware.step_time`
    on a `kvlib.hardware.measure` profile of this device, and its parts.

    ``overlapped_step_s`` is the same parts with the overhead overlapping the kernels instead of
    added to them (``max(overhead, matmul + attention)``): on a GPU the CPU issues kernels while
    earlier ones run (chapter 5, "Measuring on a GPU"), which the CPU-built model does not assume.
    """
    hw = hardware.measure(config, DTYPE, device, rows=plan.measure_rows, nbytes=plan.measure_nbytes)
    p = hardware.step_time(config, hw, batch=measured["batch"], context=measured["context"], dtype=DTYPE)
    ratio = measured["step_s"] / p.total
    return {"predicted_step_s": p.total, "measured_step_s": measured["step_s"], "ratio": ratio,
            "band": list(ROOFLINE_BAND), "within": ROOFLINE_BAND[0] <= ratio <= ROOFLINE_BAND[1],
            "hardware": "measured", "batch": measured["batch"], "context": measured["context"],
            "parts": {"overhead_s": p.overhead, "matmul_s": p.matmul, "attention_s": p.attention},
            "bound_s": p.bound, "overlapped_step_s": max(p.overhead, p.matmul + p.attention),
            "profile": {"mem_bandwidth_bytes_s": hw.mem_bandwidth, "peak_flop_s": hw.peak(DTYPE),
                        "overhead_s": hw.overhead, "overhead_per_row_s": hw.overhead_per_row}}


__all__ = ["BACKENDS", "DTYPE", "FULL", "GpuPlan", "QUICK", "ROOFLINE_BAND", "attention", "decode", "filled_cache",
           "graphed_decode", "hbm_copy", "median_time", "paged", "prefill", "random_model", "roofline",
           "scaled_down", "sdpa_backend", "spec_bandwidth"]
