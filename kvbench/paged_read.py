"""Section (n): paged decode attention that reads through the block table, candidates side by side.

A paged cache keeps each layer's keys and values in a pool ``(num_blocks, block_size,
H_kv, D)`` and each sequence's blocks in a block table. Attention of a decode step must
read every sequence's keys through its table, and there are three ways to do it:

* **gather** (kvlib's default, `kvlib.paged.paged_varlen_attention`): copy the keys the
  step reads into a ``(B, S, H_kv, D)`` tensor padded to the longest sequence
  (``index_select`` over flat pool slots), then one SDPA call under a padding mask.
  It copies ``B x S x 2 x H_kv x D`` numbers per layer and step.
* **block loop** (`kvlib.paged.paged_attention_loop`, the readable reference): per
  sequence, walk its table and fold each block into a running softmax where it lies;
  nothing is copied, but it makes one small call per block. **batched block loop**: the
  same recurrence over the whole batch at once, step ``i`` reading block ``i`` of every
  sequence with one ``index_select`` (one block per sequence copied at a time; over the
  steps that is as many bytes as the gather, never more than ``B`` blocks alive).
* **flex** (PyTorch's paged-attention pattern, ``torch.nn.attention.experimental
  ._paged_attention``): FlexAttention over the pool viewed as one long row of slots,
  with a `BlockMask` whose KV block indices *are* the page table, so the compiled kernel
  visits only each sequence's own blocks, and a ``mask_mod`` that hides the slots past a
  sequence's length. On a CPU it runs through ``torch.compile`` (inductor's C++ template):
  the first call compiles, and the next step (one more token each) must not recompile. The
  generated kernel takes the pool's strides and reads it in place (in fp32 it packs nothing).

`paged_read_candidates` times one layer's decode attention of a batch at SmolLM2-135M's
shapes (random pool contents), every candidate taking turns, and checks each against
SDPA over each sequence's own contiguous keys.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

from kvlib.config import PRESETS, ModelConfig
from kvlib.kernels import online_softmax_step
from kvlib.paged import VarlenPlan, paged_attention_loop, paged_varlen_attention

ATOL = 1e-5  # fp32: every candidate against the reference, elementwise


def decode_rows(cfg: ModelConfig, lengths: list[int], block_size: int, seed: int = 0) -> dict:
    """A batch of decode rows over a scattered pool: sequence ``b`` holds ``lengths[b]`` keys
    (its new token's included) in blocks drawn at random from a pool twice as big as needed."""
    g = torch.Generator().manual_seed(seed)
    H, H_kv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    need = [-(-n // block_size) for n in lengths]  # blocks per sequence
    ids = list(range(2 * sum(need)))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    shape = (len(ids), block_size, H_kv, D)
    return {"q": torch.randn(len(lengths), H, D, generator=g), "tables": tables, "lengths": list(lengths),
            "k_pool": torch.randn(shape, generator=g), "v_pool": torch.randn(shape, generator=g)}


def reference(rows: dict) -> torch.Tensor:
    """``(B, H, D)``: SDPA over each sequence's keys, read slot by slot into a contiguous tensor."""
    kp, vp, bs = rows["k_pool"], rows["v_pool"], rows["k_pool"].shape[1]
    out = []
    for q, table, n in zip(rows["q"], rows["tables"], rows["lengths"]):
        slots = [table[t // bs] * bs + t % bs for t in range(n)]
        k = kp.flatten(0, 1)[slots].transpose(0, 1)[None]  # (1, H_kv, n, D)
        v = vp.flatten(0, 1)[slots].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)  # (B, H, D)


# -- the candidates: each a setup (once per step, shared by every layer) and an attention -------
def gather_path(rows: dict) -> tuple:
    """(c) kvlib's varlen decode: `VarlenPlan` (the step's setup), then `paged_varlen_attention`.
    The pool holds each sequence's new key already; it is passed as the step's new key too."""
    kp, vp, (B, H, D) = rows["k_pool"], rows["v_pool"], rows["q"].shape
    bs, H_kv = kp.shape[1], kp.shape[2]
    last = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(rows["tables"], rows["lengths"])])
    k_new = kp.flatten(0, 1)[last].transpose(0, 1)[None]  # (1, H_kv, B, D)
    v_new = vp.flatten(0, 1)[last].transpose(0, 1)[None]
    q = rows["q"].transpose(0, 1)[None]  # (1, H, B, D): the packed row of B decode tokens

    def setup():
        return VarlenPlan.build(rows["tables"], [n - 1 for n in rows["lengths"]], [1] * B, bs,
                                2 * H_kv * D * kp.element_size(), kp.device)

    def attn(plan):
        return paged_varlen_attention(q, k_new, v_new, kp, vp, plan)[0].transpose(0, 1)  # (B, H, D)
    return setup, attn, lambda plan: plan.bytes_copied_per_layer


def loop_path(rows: dict) -> tuple:
    """(b) the readable loop, one sequence at a time: blocks read where they lie, nothing copied."""
    def attn(_):
        return torch.stack([paged_attention_loop(q, rows["k_pool"], rows["v_pool"], t, n)
                            for q, t, n in zip(rows["q"], rows["tables"], rows["lengths"])])
    return lambda: None, attn, lambda _: 0


def batched_loop_path(rows: dict) -> tuple:
    """(b') the loop's recurrence over the whole batch: step ``i`` copies block ``i`` of every
    sequence (``index_select`` of ``B`` blocks), masks slots past a sequence's length."""
    kp, vp, (B, H, D) = rows["k_pool"], rows["v_pool"], rows["q"].shape
    bs, H_kv = kp.shape[1], kp.shape[2]
    G, n_steps = H // H_kv, -(-max(rows["lengths"]) // bs)
    qg = rows["q"].view(B, H_kv, G, D) * D**-0.5  # (B, H_kv, G, D)

    def setup():
        tables = torch.tensor([t + [0] * (n_steps - len(t)) for t in rows["tables"]])  # (B, n_steps): pad 0
        lengths = torch.tensor(rows["lengths"])
        return tables, lengths

    def attn(s):
        tables, lengths = s
        m = torch.full((B, H_kv, G, 1), float("-inf"))
        l = torch.zeros(B, H_kv, G, 1)  # noqa: E741
        acc = torch.zeros(B, H_kv, G, D)
        for i in range(n_steps):
            k = kp.index_select(0, tables[:, i])  # (B, bs, H_kv, D): one block of each sequence, copied
            v = vp.index_select(0, tables[:, i])
            sc = torch.einsum("bhgd,bnhd->bhgn", qg, k)  # (B, H_kv, G, bs)
            live = (i * bs + torch.arange(bs)) < lengths[:, None]  # (B, bs): slots a sequence holds
            sc = sc.masked_fill(~live[:, None, None], float("-inf"))
            m, l, p, alpha = online_softmax_step(m, l, sc)  # noqa: E741
            acc = alpha * acc + torch.einsum("bhgn,bnhd->bhgd", p, v)
        return (acc / l).reshape(B, H, D)
    per_block = bs * 2 * H_kv * D * kp.element_size()
    return setup, attn, lambda _: B * n_steps * per_block


def flex_path(rows: dict) -> tuple:
    """(a) FlexAttention through the page table, compiled (PyTorch's paged-attention pattern).
    The pool is viewed (no copy) as one row of ``num_blocks x block_size`` slots; the
    `BlockMask`'s full blocks are each sequence's full pages, its partial block the last page."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kp, vp, (B, H, D) = rows["k_pool"], rows["v_pool"], rows["q"].shape
    NB, bs, H_kv, _ = kp.shape
    k = kp.view(1, NB * bs, H_kv, D).transpose(1, 2)  # (1, H_kv, slots, D): a view of the pool
    v = vp.view(1, NB * bs, H_kv, D).transpose(1, 2)
    q = rows["q"][:, :, None]  # (B, H, 1, D)
    width = max(len(t) for t in rows["tables"]) + 1  # room for the next step's block
    logical = torch.full((B, NB + 1), -1, dtype=torch.long)  # physical block -> its place in the sequence
    lengths = torch.tensor(rows["lengths"])  # read by mask_mod; updated in place for the next step

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx: a slot of the pool; valid if it holds one of b's keys
        at = logical[b, kv_idx // bs]
        return (at >= 0) & (at * bs + kv_idx % bs < lengths[b])

    def setup():  # mask_mod's two tensors are filled in place: compiled once, read at each call
        lengths.copy_(torch.tensor(rows["lengths"]))
        table = torch.tensor([t + [NB] * (width - len(t)) for t in rows["tables"]])  # (B, width), pad NB
        logical.fill_(-1).scatter_(1, table, torch.arange(width).expand(B, width))  # column NB: never read
        full = lengths // bs  # pages every slot of which is a key: no mask_mod needed there
        idx = torch.zeros(B, 1, 1, NB, dtype=torch.int32)
        idx[:, 0, 0, :width] = table.clamp(max=NB - 1)  # past a sequence's count: never visited
        part = torch.zeros(B, 1, 1, NB, dtype=torch.int32)  # the last, partly filled page
        part[:, 0, 0, 0] = idx[:, 0, 0].gather(1, full[:, None]).view(B)
        return BlockMask.from_kv_blocks((lengths % bs > 0).int().view(B, 1, 1), part,
                                        full.int().view(B, 1, 1), idx, BLOCK_SIZE=(1, bs),
                                        mask_mod=mask_mod, seq_lengths=(1, NB * bs),
                                        compute_q_blocks=False)  # the backward's, not needed

    compiled = torch.compile(flex_attention, dynamic=False)

    def attn(block_mask):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)[:, :, 0]  # (B, H, D)
    return setup, attn, lambda _: 0


NOTES = {  # what ``bytes_copied`` counts, per candidate
    "gather (kvlib varlen)": "every key the step reads, padded to the longest, copied into one tensor",
    "block loop (per sequence)": "none: each block is a view of the pool; one small call per block",
    "block loop (batched)": "one block of each sequence per step of the loop (B blocks alive at a time)",
    "flex (compiled)": "none: the kernel reads the pool's slots in place through the BlockMask's page table"}
CANDIDATES = {"gather (kvlib varlen)": gather_path, "block loop (per sequence)": loop_path,
              "block loop (batched)": batched_loop_path, "flex (compiled)": flex_path}


def paged_read_candidates(cfg: ModelConfig | None = None, batch: int = 16, lengths: list[int] | None = None,
                          block_size: int = 16, repeats: int = 15, flex: bool = True, seed: int = 0) -> dict:
    """(n) One layer's decode attention of ``batch`` paged sequences, each candidate's row:
    ``ms_per_layer`` (median of ``repeats``, taking turns), ``setup_ms_per_step`` (once per
    step, shared by the layers), ``bytes_copied`` (cached K/V copied per layer and step),
    ``max_abs_err`` against `reference`, ``ok`` (within `ATOL`); flex also ``compile_s``
    (its first call: seconds cold, less with inductor's disk cache warm, nothing if this
    process compiled the same shapes before), ``next_step_s`` and ``recompiles_on_next_step``
    (every sequence one token longer). ``lengths`` given sets the batch."""
    cfg = PRESETS["smollm2-135m"] if cfg is None else cfg
    if lengths is None:  # spread over 100..250, like the cross-check's decode rows
        lengths = [100 + (150 * i) // max(batch - 1, 1) for i in range(batch)]
    batch = len(lengths)
    rows = decode_rows(cfg, lengths, block_size, seed)
    ref = reference(rows)
    names = [n for n in CANDIDATES if flex or not n.startswith("flex")]
    paths = {n: CANDIDATES[n](rows) for n in names}
    out = {}
    with torch.inference_mode():
        for name, (setup, attn, nbytes) in paths.items():
            t0 = time.perf_counter()
            y = attn(setup())  # the first call: flex compiles here
            out[name] = {"first_call_s": time.perf_counter() - t0, "max_abs_err": (y - ref).abs().max().item(),
                         "bytes_copied": nbytes(setup())}
        times = {n: [] for n in names}
        setups = {n: [] for n in names}
        for _ in range(repeats):  # taking turns: load from other processes hits them alike
            for name, (setup, attn, _) in paths.items():
                t0 = time.perf_counter()
                s = setup()
                t1 = time.perf_counter()
                attn(s)
                setups[name].append(t1 - t0)
                times[name].append(time.perf_counter() - t1)
        for name in names:
            r = out[name]
            r |= {"ms_per_layer": 1e3 * statistics.median(times[name]),
                  "setup_ms_per_step": 1e3 * statistics.median(setups[name]), "ok": r["max_abs_err"] <= ATOL}
        for name in names:
            out[name]["note"] = NOTES[name]
        if flex:
            out["flex (compiled)"]["compile_s"] = out["flex (compiled)"]["first_call_s"]
            out["flex (compiled)"] |= _next_step(rows, paths["flex (compiled)"])
    return {"shapes": {"batch": batch, "heads": cfg.n_head, "kv_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
                       "block_size": block_size, "lengths": lengths, "atol": ATOL}, "candidates": out}


def _next_step(rows: dict, path: tuple) -> dict:
    """Flex at the next decode step (every sequence one token longer): its time, whether
    dynamo compiled again, and its error against the reference at the new lengths."""
    from torch._dynamo.utils import counters

    setup, attn, _ = path
    before = counters["stats"]["unique_graphs"]
    bs = rows["k_pool"].shape[1]
    saved = [list(t) for t in rows["tables"]], list(rows["lengths"])
    free = sorted(set(range(rows["k_pool"].shape[0])) - {i for t in saved[0] for i in t})
    rows["lengths"][:] = [n + 1 for n in rows["lengths"]]  # the pool already holds random keys there
    for t, n in zip(rows["tables"], rows["lengths"]):
        if n > len(t) * bs:  # a new block, as the allocator would give
            t.append(free.pop())
    t0 = time.perf_counter()
    y = attn(setup())
    dt = time.perf_counter() - t0
    err = (y - reference(rows)).abs().max().item()
    rows["tables"][:], rows["lengths"][:] = saved
    return {"next_step_s": dt, "recompiles_on_next_step": counters["stats"]["unique_graphs"] - before,
            "next_step_max_abs_err": err}
