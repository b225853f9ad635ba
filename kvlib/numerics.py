"""When two correct ways of running a model disagree: how far, and whether it flips a token.

A cached decode step and a full recompute compute the same function, but not the same
sequence of floating-point operations: a one-row matrix product against a many-row one,
SDPA with or without a mask, keys split into other blocks. Float addition is not
associative, so the last bits differ, and a greedy token flips wherever the two best
logits are closer than that difference. This module runs one sequence several ways,
always feeding the same tokens (teacher forcing), and measures the gap:

* `recomputed`: one forward over the whole sequence (what the naive loop computes);
* `cached`: a prefill, then one decode step per token;
* `chunked`: the sequence fed in chunks through a cache (chunked prefill);
* `batched`: `cached`, with other sequences of the same length in the batch;
* `paged`: `cached`, through a `kvlib.PagedCache`.

Each returns logits ``(n, vocab)`` for positions ``start .. T-1`` of ``ids`` ``(1, T)``
(the logits at position ``p`` choose token ``p + 1``). `drift` compares two of them, and
`drift_table` every way with the recompute. `divergence` runs the two greedy loops,
`kvlib.generate` and `kvlib.generate_naive`, and finds where they part.
`kvlib.invariant` is the cure: with ``model.set_batch_invariant(True)`` all five agree bit
for bit.

In bfloat16 on a CPU without bf16 matrix instructions (``kvlib.hardware.fast_dtype()``
answers fp32), PyTorch's fallback kernels are some 40 times slower than float32, too slow
for a chapter. `load_bf16_record` holds the bfloat16 study as the build machine ran it
(``python -m kvlib.numerics --record``), for such a machine to read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .cache import DynamicCache
from .generate import generate, generate_naive
from .model import Transformer
from .validate import int_at_least, int_in_range


def _check(model: Transformer, ids: torch.Tensor, start: int) -> int:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be one sequence, (1, T), got {getattr(ids, 'shape', type(ids).__name__)}")
    T = ids.shape[1]
    int_in_range("start", start, 0, T - 1)
    return T


@torch.inference_mode()
def recomputed(model: Transformer, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """One forward over all of ``ids``: logits ``(T - start, vocab)`` at positions ``start..T-1``."""
    _check(model, ids, start)
    return model(ids)[0, start:]


def _stepwise(model: Transformer, batch: torch.Tensor, start: int) -> torch.Tensor:
    """Prefill ``batch[:, :start + 1]``, then one decode step per later token; row 0's logits."""
    cache = DynamicCache(model.config.n_layer)
    rows = [model(batch[:, : start + 1], cache, last_only=True)[0]]  # (1, vocab)
    rows += [model(batch[:, p : p + 1], cache)[0] for p in range(start + 1, batch.shape[1])]
    return torch.cat(rows)


@torch.inference_mode()
def cached(model: Transformer, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Prefill ``ids[:, :start + 1]``, then one decode step per later token: ``(T - start, vocab)``."""
    _check(model, ids, start)
    return _stepwise(model, ids, start)


@torch.inference_mode()
def chunked(model: Transformer, ids: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
    """``ids`` fed ``chunk`` tokens at a time through one cache, every position scored."""
    T = _check(model, ids, start)
    int_at_least("chunk", chunk, 1)
    cache = DynamicCache(model.config.n_layer)
    return torch.cat([model(ids[:, s : s + chunk], cache)[0] for s in range(0, T, chunk)])[start:]


@torch.inference_mode()
def batched(model: Transformer, ids: torch.Tensor, others: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`cached`, run as row 0 of a batch with ``others`` ``(B - 1, T)`` beside it."""
    T = _check(model, ids, start)
    if not isinstance(others, torch.Tensor) or others.dim() != 2 or others.shape[1] != T:
        raise ValueError(f"others must be (B - 1, {T}) token ids, got {getattr(others, 'shape', others)!r}")
    return _stepwise(model, torch.cat([ids, others.to(ids.device)]), start)  # (B, T): ours is row 0


@torch.inference_mode()
def paged(model: Transformer, ids: torch.Tensor, start: int = 0, block_size: int = 16) -> torch.Tensor:
    """`cached` through a `kvlib.PagedCache` with ``block_size``-token blocks (keys gathered, masked)."""
    from .paged import PagedCache

    T = _check(model, ids, start)
    cache = PagedCache.for_model(model.config, num_blocks=-(-T // block_size), block_size=block_size,
                                 dtype=model.dtype, device=model.device)
    sid, _ = cache.add()
    rows = []
    for lo, hi in [(0, start + 1)] + [(p, p + 1) for p in range(start + 1, T)]:
        with cache.step([sid], ids[:, lo:hi]) as batch:
            rows.append(model(ids[:, lo:hi], batch, last_only=True)[0])
    return torch.cat(rows)


@dataclass(frozen=True)
class Drift:
    """How far ``other`` logits are from ``reference`` ones, and what that does to greedy tokens.

    - max_diff: the largest ``|reference - other|`` over every position and vocabulary entry.
    - near_ties: positions whose reference top-1 minus top-2 margin is below ``2 * max_diff``,
      where a difference that large *could* flip the greedy token (each of the two logits
      may move by up to ``max_diff``, in opposite directions).
    - flips: positions where the two argmaxes differ; first_flip the first (None: none).
    """

    positions: int
    max_diff: float
    min_margin: float
    near_ties: int
    flips: int
    first_flip: int | None

    @property
    def identical(self) -> bool:
        return self.max_diff == 0.0


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row, ``(n, vocab) -> (n,)``: how close each greedy choice is to a tie."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def drift(reference: torch.Tensor, other: torch.Tensor) -> Drift:
    """Compare two ``(n, vocab)`` logit tensors for the same positions (see `Drift`)."""
    if reference.shape != other.shape or reference.dim() != 2:
        raise ValueError(f"need two (n, vocab) tensors of one shape, got {tuple(reference.shape)} and {tuple(other.shape)}")
    diff = float((reference.float() - other.float()).abs().max())
    m = margins(reference)
    flipped = (reference.argmax(-1) != other.argmax(-1)).nonzero().flatten().tolist()
    return Drift(positions=len(m), max_diff=diff, min_margin=float(m.min()), near_ties=int((m < 2 * diff).sum()),
                 flips=len(flipped), first_flip=flipped[0] if flipped else None)


def first_difference(a: torch.Tensor | list[int], b: torch.Tensor | list[int]) -> int | None:
    """The first index where two token sequences differ (a length difference counts), or None."""
    a = a.flatten().tolist() if isinstance(a, torch.Tensor) else list(a)
    b = b.flatten().tolist() if isinstance(b, torch.Tensor) else list(b)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def drift_table(model: Transformer, ids: torch.Tensor, start: int, chunk: int, others: torch.Tensor) -> dict[str, Drift]:
    """Each way against `recomputed`: ``{"cached", "chunked", "batched", "paged"} -> Drift``."""
    ref = recomputed(model, ids, start)
    ways = {"cached": lambda: cached(model, ids, start), "chunked": lambda: chunked(model, ids, chunk, start),
            "batched": lambda: batched(model, ids, others, start), "paged": lambda: paged(model, ids, start)}
    return {name: drift(ref, way()) for name, way in ways.items()}


@dataclass(frozen=True)
class Divergence:
    """Where greedy `generate` (cached) and `generate_naive` (recompute) part, and why.

    cached, naive: the new tokens of each loop. first: the first index where they differ
    (None: they did not). logits: at that step, each loop's logits of the two tokens
    (``{"cached": [l_cached_token, l_naive_token], "naive": [...]}``), recomputed the way
    that loop computes them; empty when they did not part.
    """

    cached: list[int]
    naive: list[int]
    first: int | None
    logits: dict[str, list[float]]


@torch.inference_mode()
def divergence(model: Transformer, prompt: list[int], n_new: int) -> Divergence:
    """Run both greedy loops for ``n_new`` tokens after ``prompt`` and compare them."""
    a = generate(model, prompt, n_new)[0, len(prompt):].tolist()
    b = generate_naive(model, prompt, n_new)[0, len(prompt):].tolist()
    first = first_difference(a, b)
    logits: dict[str, list[float]] = {}
    if first is not None and first < min(len(a), len(b)):
        context = torch.tensor([prompt + a[:first]], device=model.device)  # what both loops had seen
        rows = {"cached": cached(model, context, len(prompt) - 1)[-1],  # prefill, then decode steps
                "naive": model(context, last_only=True)[0, -1]}  # one forward over everything
        logits = {name: [float(row[a[first]]), float(row[b[first]])] for name, row in rows.items()}
    return Divergence(a, b, first, logits)


BF16_RECORD = Path(__file__).parent / "data" / "numerics_bf16.json"
# The inputs of the study (the chapter "When cached and uncached disagree" uses the same ones).
STUDY_TEXT = ("Lighthouses were once kept by hand. Every evening the keeper climbed the tower, "
              "trimmed the wick, polished the lens and wound the clockwork that turned it, "
              "then sat up through the night to make sure the light never failed.")
STUDY_CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
STUDY = {"start": 20, "chunk": 16, "others": 3, "others_seed": 0, "n_new": 40}


def study_inputs(tok, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(ids (1, T), others (3, T), chat prompt)``: the text, the batch beside it, the chat."""
    ids = torch.tensor([tok.encode(STUDY_TEXT)])
    g = torch.Generator().manual_seed(STUDY["others_seed"])
    others = torch.randint(0, vocab_size, (STUDY["others"], ids.shape[1]), generator=g)
    return ids, others, tok.apply_chat_template(STUDY_CHAT)


def load_bf16_record(path: str | Path | None = None) -> dict:
    """The stored bfloat16 study: ``{"machine", "inputs", "table": {way: Drift}, "divergence": Divergence}``."""
    p = Path(path) if path is not None else BF16_RECORD
    if not p.is_file():
        raise FileNotFoundError(f"no bf16 record at {p}: run `python -m kvlib.numerics --record` on a CPU with bf16")
    r = json.loads(p.read_text())
    return {**r, "table": {k: Drift(**v) for k, v in r["table"].items()}, "divergence": Divergence(**r["divergence"])}


def record_json(machine: dict, inputs: dict, table: dict[str, Drift], div: Divergence) -> str:
    """The study as the JSON `load_bf16_record` reads."""
    return json.dumps({"machine": machine, "inputs": inputs, "table": {k: asdict(v) for k, v in table.items()},
                       "divergence": asdict(div)}, indent=1) + "\n"


def machine() -> dict:
    """The CPU's name, torch's version, ATen's vector capability and the thread count: what a bf16 result
    depends on (on the build machine, one thread and two gave bf16 logits up to 0.1 apart)."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:  # Linux names the model
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def _record(path: Path) -> None:
    """Run the bfloat16 study on SmolLM2 and write it to ``path`` (``python -m kvlib.numerics --record``)."""
    from .native import fast_dtype
    from .pretrained import load_smollm2

    if fast_dtype() != torch.bfloat16:
        raise SystemExit("this CPU has no bf16 matrix instructions: the study would take an hour here")
    model, tok = load_smollm2(dtype=torch.bfloat16, prepack=False)  # the plain layout the record was made with
    ids, others, prompt = study_inputs(tok, model.config.vocab_size)
    table = drift_table(model, ids, STUDY["start"], STUDY["chunk"], others)
    div = divergence(model, prompt, STUDY["n_new"])
    path.write_text(record_json(machine(), dict(STUDY), table, div))
    print(f"wrote {path}: parted at {div.first}; " + ", ".join(f"{k} {v.max_diff:.3f}" for k, v in table.items()))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvlib.numerics", description="the bfloat16 study's stored record")
    ap.add_argument("--record", metavar="PATH", nargs="?", const=str(BF16_RECORD), help="run it and write the record")
    args = ap.parse_args()
    if args.record:
        _record(Path(args.record))
    else:
        ap.print_help()
