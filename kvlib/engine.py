"""A small serving engine: continuous batching over a `PagedCache`, split the way vLLM's is.

* `Sequence`: one sample of one request, with its state (`SeqState`), its
  tokens, its place in the cache (block table, cached-token count).
* `Scheduler`: decides which sequences join (first come, first served, while
  blocks and batch slots last) and which are preempted when the pool runs short.
  It does block arithmetic and never touches a tensor.
* `Engine`: ``step()`` is *schedule* (ask the scheduler), *run* (one model
  forward over a `PagedBatch`) and *process* (sample, emit, finish), for the
  admitted prompts and then for one decode step of every running sequence.
  With a ``token_budget`` (vLLM's ``max_num_batched_tokens`` with chunked
  prefill) a step decodes first and spends what is left of the budget on
  prompt chunks, so a long prompt no longer stalls the sequences that run.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .paged import OutOfBlocks
from .model import Transformer
from .paged import PagedCache
from .sampling import SamplingParams, sample, sampling_params
from .validate import int_at_least, positive_int, token_ids


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued, never run
    RUNNING = "running"  # holds blocks; decodes every step
    PREEMPTED = "preempted"  # its blocks were taken back; queued to be recomputed
    FINISHED = "finished"  # emitted a stop token or its last token


@dataclass(eq=False)  # identity, not field equality: requests are compared by who they are
class Request:
    """A prompt to continue ``n`` times (parallel sampling shares the prompt's blocks)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    n: int = 1
    seqs: list["Sequence"] = field(default_factory=list)
    generator: torch.Generator | None = None  # from params.seed or params.generator, else the engine's

    @property
    def outputs(self) -> list[list[int]]:
        """One token list per sample."""
        return [s.output for s in self.seqs]

    @property
    def done(self) -> list[bool]:
        return [s.state is SeqState.FINISHED for s in self.seqs]


@dataclass(eq=False)
class Sequence:
    """One sample of a request, from waiting to finished."""

    request: Request
    index: int  # which of the request's n samples
    cache: PagedCache
    state: SeqState = SeqState.WAITING
    output: list[int] = field(default_factory=list)  # tokens emitted so far
    sid: int | None = None  # its id in the cache while it holds blocks
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    times: list[float] = field(default_factory=list)  # time.perf_counter() at each emitted token

    def __post_init__(self) -> None:
        if not isinstance(self.request, Request):
            raise TypeError(f"a Sequence belongs to a Request, got {type(self.request).__name__}")
        if not isinstance(self.index, int) or not 0 <= self.index < self.request.n:
            raise IndexError(f"sample index {self.index!r} is outside the request's n={self.request.n} samples")
        if not isinstance(self.state, SeqState):
            raise TypeError(f"state must be a SeqState, got {self.state!r}")

    @property
    def tokens(self) -> list[int]:
        """What a (re)admission must prefill: the prompt and every token emitted so far."""
        return self.request.prompt + self.output

    @property
    def pending(self) -> int:
        """The last emitted token: the input of the next decode step."""
        return self.output[-1]

    @property
    def block_table(self) -> list[int]:
        """Physical blocks holding this sequence's K/V (empty unless running)."""
        return [] if self.sid is None else self.cache.block_table(self.sid)

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED


class Scheduler:
    """Who runs next. First come, first served: a request waits until its blocks fit.

    ``admit()`` hands out the next group to prefill (a new request's ``n`` samples,
    or one preempted sequence), or None to wait. ``schedule_decode()`` returns the
    running sequences, after preempting the newest ones while a decode step for
    all of them would need more blocks than are free.
    """

    def __init__(self, cache: PagedCache, max_batch: int = 64) -> None:
        if not isinstance(cache, PagedCache):
            raise TypeError(f"Scheduler needs a PagedCache for its block counts, got {type(cache).__name__}")
        self.cache = cache
        self.max_batch = positive_int("max_batch", max_batch)
        self.waiting: deque[list[Sequence]] = deque()  # groups, each prefilled together
        self.running: list[Sequence] = []

    def add(self, group: list[Sequence]) -> None:
        if not group or any(s.state is not SeqState.WAITING for s in group):
            raise ValueError(f"only new, waiting sequences can be added, got {[s.state.value for s in group]}")
        if len(group) > self.max_batch:
            raise ValueError(f"n={len(group)} samples cannot run at once with max_batch={self.max_batch}")
        self.waiting.append(group)

    def blocks_to_admit(self, n_tokens: int, n_samples: int) -> int:
        """The prompt, one decode step's growth, and one copy of the last block per extra fork."""
        return -(-(n_tokens + 1) // self.cache.block_size) + n_samples - 1

    def admit(self) -> list[Sequence] | None:
        """The next group to prefill, taken off the queue; None when the head must wait."""
        if not self.waiting:
            return None
        group = self.waiting[0]
        need = self.blocks_to_admit(len(group[0].tokens), len(group))
        free = self.cache.allocator.num_free
        if need > free or len(self.running) + len(group) > self.max_batch:
            if not self.running and need > free:
                raise OutOfBlocks(f"a request of {len(group[0].tokens)} tokens needs {need} blocks; "
                                  f"the pool has {self.cache.num_blocks}")
            return None
        return self.waiting.popleft()

    def requeue(self, group: list[Sequence]) -> None:
        """Put back a group whose prefill failed: nothing was emitted, so it can simply be retried."""
        self.waiting.appendleft(group)

    def start(self, seq: Sequence) -> None:
        seq.state = SeqState.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.cache.free(seq.sid)
        seq.sid, seq.state = None, SeqState.FINISHED
        if seq in self.running:
            self.running.remove(seq)

    def schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        """``(to run, preempted)``: the running sequences that fit one decode step, and those sent back."""
        preempted = []
        while self.running and self.cache.blocks_needed([s.sid for s in self.running], 1) > self.cache.allocator.num_free:
            victim = self.running.pop()  # the newest sequence
            self.cache.free(victim.sid)
            victim.sid, victim.state = None, SeqState.PREEMPTED
            self.waiting.appendleft([victim])  # recompute it later, first in line
            preempted.append(victim)
        return list(self.running), preempted

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


@dataclass(eq=False)
class _Prefill:
    """A group part-way through its prefill: ``done`` of its tokens are in the cache."""

    group: list[Sequence]
    sid: int
    done: int


@dataclass
class EngineStats:
    """Counts over an engine's life, kept in one place."""

    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (cache misses)
    prefill_chunks: int = 0  # prefill forwards (one per group unless prompts are chunked)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    decode_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    peak_batch: int = 0


class Engine:
    """Continuous batching over a `PagedCache`, in the shape of vLLM's engine.

    Each ``step()`` prefills the waiting requests the scheduler admits (each on its
    own, then forked ``n`` ways), then runs one decode step for every running
    sequence together, whatever their lengths. When the pool runs short, the newest
    sequence is *preempted*: its blocks are freed and it is queued again with its
    tokens so far, to be recomputed (prefix caching often makes that cheap).

    ``token_budget=None`` prefills each admitted prompt whole, in one forward. With an
    int, a step decodes every running sequence (one token each), then spends what is
    left of the budget on chunks of waiting prompts (chunked prefill); keep the budget
    above ``max_batch`` (vLLM requires it) so that the decode tokens alone never use it up. A prompt may then
    take several steps to prefill, and the sequences already running emit a token at
    every one of them; the tokens are the same either way.
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
        self.model, self.cache = model, cache
        self.scheduler = Scheduler(cache, max_batch)
        self.token_budget = None if token_budget is None else positive_int("token_budget", token_budget)
        self._prefilling: _Prefill | None = None  # the group whose prompt is part-way into the cache
        self.stop = {int(t) for t in stop}
        self.generator = generator
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()

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
    def step(self) -> None:
        """Prefill what the scheduler admits, then one decode step for every running sequence;
        with a ``token_budget``, decode first and prefill chunks with the rest of the budget."""
        if self.token_budget is None:
            self.prefill()
            self.decode()
        else:
            self.prefill(max(0, self.token_budget - self.decode()))
        self.stats.steps += 1

    def prefill(self, budget: int | None = None) -> None:
        """Admit waiting groups while they fit, and run their prompts through the model, at most
        ``budget`` tokens in all (None: every admitted prompt whole). A group whose prompt is
        done is forked once per sample; one that is not goes on at the next call."""
        if budget is not None:
            int_at_least("budget", budget, 0)
        while budget is None or budget > 0:
            if self._prefilling is None:
                group = self.scheduler.admit()
                if group is None:
                    return
                try:
                    sid, cached = self.cache.add(group[0].tokens)  # prefix-cache hits are not run again
                except BaseException:
                    self.scheduler.requeue(group)
                    raise
                self._prefilling = _Prefill(group, sid, cached)
                self.stats.cached_tokens += cached
                for seq in group:
                    seq.cached_tokens = cached
            p = self._prefilling
            left = len(p.group[0].tokens) - p.done
            n = left if budget is None else min(budget, left)
            if self.cache.blocks_needed([p.sid], n) > self.cache.allocator.num_free:
                self._abandon_prefill()  # running sequences took the blocks: recompute it later
                self.stats.preemptions += 1
                return
            try:
                picks = self._run_prefill(p, n)
            except BaseException:
                self._abandon_prefill()
                raise
            if budget is not None:
                budget -= n
            if picks is not None:  # the prompt is in: fork per sample and emit each first token
                self._prefilling = None
                sids = [p.sid] + [self.cache.fork(p.sid) for _ in p.group[1:]]  # forks share the prompt's blocks
                for seq, sid, token in zip(p.group, sids, picks):
                    seq.sid = sid
                    self.scheduler.start(seq)
                    self._emit(seq, token)

    def _abandon_prefill(self) -> None:
        """Drop a half-prefilled group's blocks and queue it first in line: nothing was emitted."""
        p, self._prefilling = self._prefilling, None
        self.cache.free(p.sid)
        self.scheduler.requeue(p.group)

    def decode(self) -> int:
        """One batched decode step for every running sequence (preempting if blocks run short).
        Returns how many tokens it ran."""
        seqs, preempted = self.scheduler.schedule_decode()
        self.stats.preemptions += len(preempted)
        if not seqs:
            return 0
        tokens = self._run_decode(seqs)
        self.stats.decode_tokens += len(seqs)
        self.stats.peak_batch = max(self.stats.peak_batch, len(seqs))
        for seq, token in zip(seqs, tokens):
            self._emit(seq, token)
        return len(seqs)

    @torch.inference_mode()
    def _run_prefill(self, p: _Prefill, n: int) -> list[int] | None:
        """The group's next ``n`` prompt tokens through the model; after the last chunk, one
        sampled token per sample (None before it)."""
        tokens = p.group[0].tokens
        chunk = tokens[p.done : p.done + n]
        last = p.done + n == len(tokens)
        picks = None
        with self.cache.step([p.sid], [chunk]) as batch:  # token ids stay on the host for the cache
            logits = self.model(torch.tensor([chunk], device=self.model.device), batch, last_only=True)[0, -1]
            if last:
                picks = self._sample(p.group, [logits] * len(p.group))  # before the commit: an error drops the step
        self._note_peak()
        p.done += n
        self.stats.prefill_tokens += n
        self.stats.prefill_chunks += 1
        return picks

    @torch.inference_mode()
    def _run_decode(self, seqs: list[Sequence]) -> list[int]:
        ids = [[s.pending] for s in seqs]  # (B, 1) as host ints
        with self.cache.step([s.sid for s in seqs], ids) as batch:
            logits = self.model(torch.tensor(ids, device=self.model.device), batch, last_only=True)[:, -1]
            picks = self._sample(seqs, logits)  # (B, vocab) -> B tokens, before the commit
        self._note_peak()
        return picks

    @staticmethod
    def _sample(seqs: list[Sequence], logits: list[torch.Tensor] | torch.Tensor) -> list[int]:
        """One token per sequence, each with its request's sampling, read back from the device once.

        That one read per step is the engine's only sync: stop checks and block sealing run on the host.
        """
        picks = [sample(row[None], s.request.params, generator=s.request.generator)[0] for s, row in zip(seqs, logits)]
        return torch.stack(picks).tolist()

    def _emit(self, seq: Sequence, token: int) -> None:
        """Record the sequence's next token, and finish the sequence if it is done."""
        req = seq.request
        seq.output.append(token)
        seq.times.append(time.perf_counter())
        if token in self.stop or token in req.params.stop or len(seq.output) >= req.params.max_new_tokens:
            self.scheduler.finish(seq)

    def _note_peak(self) -> None:
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.cache.allocator.num_used)

    @property
    def finished(self) -> bool:
        return self.scheduler.idle and self._prefilling is None

    def run(self) -> dict[int, list[list[int]]]:
        """Step until every request is done; returns ``{request id: [tokens of each sample]}``."""
        while not self.finished:
            self.step()
        return {rid: [list(o) for o in req.outputs] for rid, req in self.requests.items()}
