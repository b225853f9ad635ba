"""A small serving engine: continuous batching over a `PagedCache`, one forward per step, in vLLM V1's shape.

vLLM's V1 engine has no prefill step and decode step. Its scheduler
(vllm/v1/core/sched/scheduler.py) gives each request the tokens it has not run yet,
under one per-step budget (``max_num_batched_tokens``): one for a sequence that
decodes, a chunk of the prompt for one that prefills. The model then runs every
token of the step in one forward, flattened end to end with no pads. This module
has that shape:

* `kvlib.scheduler` (no tensors): `Request`, `Sequence` (its state a `SeqState`), and
  the `Scheduler`, whose ``schedule()`` plans the step (`StepPlan`). Its names are
  importable from here too.
* `Engine`: ``step()`` is *schedule* (ask the scheduler), *run* (one model forward
  over a `kvlib.paged.PackedPagedBatch` holding the decode tokens and the prompt
  chunks, scoring only each sequence's last token) and *process* (sample, emit,
  finish; fork a group whose prompt is in, and emit its first tokens).

While a long prompt is chunked in, the running sequences still emit a token at every
step, and each of those steps is a single forward that reads the weights once.

**Host round-trips.** One per step that samples, inherent: the sampled tokens are read back at once (``_sample``),
because the host decides with them which sequences stop and grows their block tables before
the next step. Everything else (ids, tables, slots, positions) goes host to device only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .model import Transformer
from .paged import OutOfBlocks, PagedCache, PoolTrace
from .sampling import SamplingParams, sample, sampling_params
from .scheduler import Prefill, Request, Scheduler, SeqState, Sequence, StepPlan
from .validate import positive_int, token_ids

__all__ = ["Engine", "EngineStats", "OutOfBlocks", "Prefill", "Request", "Scheduler", "SeqState", "Sequence",
           "StepPlan"]


@dataclass
class EngineStats:
    """Counts over an engine's life, kept in one place."""

    steps: int = 0
    forwards: int = 0  # model forwards: one per step that ran anything
    prefill_tokens: int = 0  # prompt tokens run through the model (cache misses)
    prefill_chunks: int = 0  # prompt chunks run (one per group unless prompts are chunked)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    decode_tokens: int = 0
    preemptions: int = 0  # running sequences sent back, and half-prefilled prompts abandoned
    peak_blocks: int = 0
    peak_batch: int = 0  # most sequences decoding in one step
    kv_bytes_copied: int = 0  # cached K/V copied out of the pool to attend over (PackedPagedBatch.bytes_copied)


class Engine:
    """Continuous batching over a `PagedCache`, in the shape of vLLM's V1 engine.

    Each ``step()`` runs one forward: a decode token for every running sequence and,
    with what is left of the token budget, chunks of waiting prompts; a prompt whose
    last chunk ran is forked ``n`` ways and emits its first tokens. When the pool runs
    short, the newest sequence is *preempted*: its blocks are freed and it is queued
    again with its tokens so far, to be recomputed (prefix caching often makes that cheap).

    ``token_budget`` is vLLM's ``max_num_batched_tokens``: the most tokens one step
    runs, decode tokens included. None runs every admitted prompt whole (still in the
    step's one forward). Keep it above ``max_batch`` (vLLM requires it), so that the
    decode tokens alone never use it up: with fewer, the oldest running sequences decode
    and the rest wait a step, and no prompt is admitted meanwhile. A prompt may take
    several steps to prefill; the tokens are the same either way.

    The pool must hold the model's dtype on the model's device (build it with
    ``PagedCache.for_model(model, num_blocks, block_size)``): any other is refused here,
    not halfway through a step.

    ``varlen=True`` (the default) attends each sequence over its own keys only
    (`kvlib.paged.varlen`); ``varlen=False`` runs the step's row through the model's kernel
    under a block-diagonal mask, computing every score between two sequences (to compare).

    ``trace=PoolTrace()`` records every block event of the run, step by step
    (`kvlib.paged.trace`); the pool must be fresh, and the trace is ``engine.trace``.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> model.reset_parameters(seed=0, std=0.2)
    >>> engine = kvlib.Engine(model, kvlib.PagedCache.for_model(model, num_blocks=16, block_size=4))
    >>> a, b = engine.add([1, 2, 3], max_new_tokens=4), engine.add([4, 5], max_new_tokens=4)
    >>> out = engine.run()  # {request id: [tokens of each sample]}
    >>> out[a][0] == kvlib.generate(model, [1, 2, 3], 4)[0, 3:].tolist()  # as if it ran alone
    True
    """

    def __init__(
        self,
        model: Transformer,
        cache: PagedCache,
        *,
        max_batch: int = 64,
        token_budget: int | None = None,
        stop: Iterable[int] = (),
        generator: torch.Generator | None = None,
        trace: PoolTrace | None = None,
        varlen: bool = True,
    ) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"Engine needs a kvlib Transformer, got {type(model).__name__}")
        if not isinstance(cache, PagedCache):
            raise TypeError(f"Engine needs a PagedCache, got {type(cache).__name__}")
        c = model.config
        if (cache.n_layer, cache.n_kv_head, cache.head_dim) != (c.n_layer, c.n_kv_head, c.head_dim):
            raise ValueError(
                f"cache is shaped (layers, kv_heads, head_dim)={(cache.n_layer, cache.n_kv_head, cache.head_dim)} "
                f"but the model needs {(c.n_layer, c.n_kv_head, c.head_dim)}"
            )
        if (cache.dtype, cache.device) != (model.dtype, model.device):
            raise ValueError(
                f"the pool holds {cache.dtype} on {cache.device} but the model runs in {model.dtype} on "
                f"{model.device}: build the pool for the model, PagedCache.for_model(model, num_blocks, block_size)"
            )
        if not isinstance(varlen, bool):
            raise TypeError(f"varlen must be True or False, got {varlen!r}")
        self.model, self.cache, self.varlen = model, cache, varlen
        self.scheduler = Scheduler(cache, max_batch)
        self.token_budget = None if token_budget is None else positive_int("token_budget", token_budget)
        self.stop = {int(t) for t in stop}
        self.generator = generator
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()
        if trace is not None and not isinstance(trace, PoolTrace):
            raise TypeError(f"trace must be a kvlib.paged.PoolTrace (or None), got {type(trace).__name__}")
        self.trace = trace
        if trace is not None:
            trace._attach(self)

    def add(
        self,
        prompt: Iterable[int],
        max_new_tokens: int | None = None,
        *,
        n: int = 1,
        sampling: SamplingParams | None = None,
        **sampling_kwargs,
    ) -> int:
        """Queue a request; returns its id. ``run()`` or ``step()`` moves it along.

        Sampling as in `kvlib.generate`: ``sampling=SamplingParams(...)`` or its fields as keywords.
        """
        prompt = token_ids("a request", prompt, self.model.config.vocab_size)
        params = sampling_params(sampling, max_new_tokens, **sampling_kwargs)
        positive_int("max_new_tokens", params.need_max_new_tokens())
        positive_int("n", n)
        if n > self.scheduler.max_batch:
            raise ValueError(f"n={n} samples cannot run at once with max_batch={self.scheduler.max_batch}")
        total = len(prompt) + params.max_new_tokens
        if total > self.model.config.max_seq_len:
            raise ValueError(f"{len(prompt)} prompt + {params.max_new_tokens} new tokens exceeds "
                             f"max_seq_len={self.model.config.max_seq_len}")
        stored = total - 1  # the last token is emitted, never fed back
        need = max(-(-stored // self.cache.block_size), self.scheduler.blocks_to_admit(len(prompt), n))
        if need > self.cache.num_blocks:
            raise ValueError(
                f"{len(prompt)} prompt + {params.max_new_tokens} new tokens, {n} samples, need {need} blocks: "
                f"more than the pool's {self.cache.num_blocks} blocks of {self.cache.block_size}"
            )
        rid = len(self.requests)
        req = Request(rid, prompt, params, n, generator=params.make_generator(self.model.device) or self.generator)
        req.seqs = [Sequence(req, i, self.cache) for i in range(n)]
        self.requests[rid] = req
        self.scheduler.add(list(req.seqs))
        return rid

    # -- one iteration: schedule, run, process --------------------------------------------------------
    def step(self) -> StepPlan:
        """Schedule, run the step's tokens in one forward, and process what it sampled. Returns the plan.

        If the forward or the sampling fails, nothing is committed or emitted: the step's
        prompts go back first in line and its decodes simply run again next step.
        """
        self._note("begin")
        try:
            plan = self.scheduler.schedule(self.token_budget)
        except BaseException:
            self._note("failed")
            raise
        self._note("scheduled", plan)
        self.stats.preemptions += len(plan.preempted) + plan.abandoned
        if plan:
            try:
                picks = iter(self._run(plan))
            except BaseException:
                self.scheduler.unschedule(plan)
                self._note("failed", plan)
                raise
            self._note("committed", plan)
            self._process(plan, picks, time.perf_counter())  # one time: the step's tokens came back in one read
        self.stats.steps += 1
        self._note("ended", plan)
        return plan

    def _note(self, phase: str, plan: StepPlan | None = None) -> None:
        """Tell the trace, if any, that a phase of the step ended (it diffs the pool into events)."""
        if self.trace is not None:
            self.trace._observe(self, phase, plan)

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> list[int]:
        """The plan's tokens through the model as one packed row; one sampled token for each decode
        and for each sample of a group whose prompt ends in this step, in that order."""
        rows = plan.rows  # host ints: the cache's tables and prefix index live on the host
        ends, end = [], -1
        for row in rows:
            end += len(row)
            ends.append(end)  # each sequence's last token in the row
        at, seqs, which = [], [], []  # positions to score; who samples, and from which scored position
        for seq, end in zip(plan.decodes, ends):
            seqs.append(seq)
            which.append(len(at))
            at.append(end)
        for p, end in zip(plan.prefills, ends[len(plan.decodes):]):
            if p.last:  # a group's samples all sample from its prompt's last logits
                seqs += p.group
                which += [len(at)] * len(p.group)
                at.append(end)
        ids = torch.tensor([[t for row in rows for t in row]], device=self.model.device)  # (1, N)
        with self.cache.step(plan.sids, rows, packed=True, varlen=self.varlen) as batch:
            logits = self.model(ids, batch, logits_at=at)[0]  # (K, vocab): the scored positions only
            picks = self._sample(seqs, [logits[k] for k in which])  # before the commit: an error drops the step
        self.stats.kv_bytes_copied += batch.bytes_copied
        return picks

    def _process(self, plan: StepPlan, picks: Iterator[int], now: float) -> None:
        """Emit each decode's token; advance each prompt, and fork and start a group whose prompt is in."""
        self.stats.forwards += 1
        self.stats.decode_tokens += len(plan.decodes)
        self.stats.peak_batch = max(self.stats.peak_batch, len(plan.decodes))
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.cache.allocator.num_used)
        for seq in plan.decodes:
            self._emit(seq, next(picks), now)
        for p in plan.prefills:
            last, p.done = p.last, p.done + p.n
            self.stats.prefill_tokens += p.n
            self.stats.prefill_chunks += 1
            self.stats.cached_tokens += p.cached if p.admitted else 0
            if last:  # the prompt is in: fork per sample and emit each first token
                sids = [p.sid] + [self.cache.fork(p.sid) for _ in p.group[1:]]  # forks share the prompt's blocks
                for seq, sid in zip(p.group, sids):
                    seq.sid = sid
                    self.scheduler.start(seq)
                    self._emit(seq, next(picks), now)

    @staticmethod
    def _sample(seqs: list[Sequence], logits: list[torch.Tensor]) -> list[int]:
        """One token per sequence, each with its request's sampling, read back from the device once.

        That one read per step is the engine's only sync: stop checks and block sealing run on the host.
        """
        if not seqs:
            return []  # a step that only ran a prompt chunk samples nothing
        picks = [sample(row[None], s.request.params, generator=s.request.generator)[0] for s, row in zip(seqs, logits)]
        return torch.stack(picks).tolist()

    def _emit(self, seq: Sequence, token: int, now: float) -> None:
        """Record the sequence's next token, and finish the sequence if it is done."""
        req = seq.request
        seq.output.append(token)
        seq.times.append(now)
        if token in self.stop or token in req.params.stop or len(seq.output) >= req.params.max_new_tokens:
            self.scheduler.finish(seq)

    @property
    def finished(self) -> bool:
        return self.scheduler.idle

    def run(self) -> dict[int, list[list[int]]]:
        """Step until every request is done; returns ``{request id: [tokens of each sample]}``."""
        while not self.finished:
            self.step()
        return {rid: [list(o) for o in req.outputs] for rid, req in self.requests.items()}
