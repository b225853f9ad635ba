"""Who runs in the next step: the serving engine's requests, sequences and scheduler. No tensors.

* `Request`: a prompt to continue ``n`` times; `Sequence`: one of its samples, with
  its state (`SeqState`), its tokens and its place in the cache (block table,
  cached-token count).
* `Scheduler`: ``schedule(token_budget)`` plans one step as vLLM's V1 scheduler does
  (vllm/v1/core/sched/scheduler.py): there is no prefill phase and decode phase, only
  tokens to schedule under one budget. The running sequences come first, one decode
  token each (the newest are preempted while the pool cannot hold them); what is left
  of the budget goes to the prompt that is part-way in, then to waiting groups, first
  come first served, the last of them cut to a chunk. The result, a `StepPlan`, is what
  one model forward runs. The scheduler does block arithmetic through the cache's
  bookkeeping (``add``, ``free``, ``blocks_needed``) and never touches a tensor.

`kvlib.engine` runs the plan; every name here is importable from there too.
"""

from __future__ import annotations

import enum
import sys
from collections import deque
from dataclasses import dataclass, field

import torch

from .paged import OutOfBlocks, PagedCache
from .sampling import SamplingParams
from .validate import positive_int


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
    times: list[float] = field(default_factory=list)  # time.perf_counter() of the step that emitted each token

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


@dataclass(eq=False)
class Prefill:
    """A group's prompt on its way into the cache: ``done`` tokens are there (prefix hits
    included), and this step runs the next ``n``. The group forks after its last chunk."""

    group: list[Sequence]
    sid: int
    done: int
    n: int = 0
    cached: int = 0  # prompt tokens its admission found in the prefix cache
    admitted: bool = True  # admitted in this step (False: a prompt part-way in since an earlier step)

    @property
    def tokens(self) -> list[int]:
        return self.group[0].tokens

    @property
    def chunk(self) -> list[int]:
        """The prompt tokens this step runs."""
        return self.tokens[self.done : self.done + self.n]

    @property
    def last(self) -> bool:
        """Does this step's chunk end the prompt? Then its logits give each sample's first token."""
        return self.done + self.n == len(self.tokens)


@dataclass(eq=False)
class StepPlan:
    """One step, as one forward runs it: a decode token for each of ``decodes``, then each
    prefill's chunk, laid end to end. ``preempted`` and ``abandoned`` went back to the queue."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # running sequences whose blocks were taken back
    abandoned: int = 0  # half-prefilled groups sent back because the running sequences needed their blocks

    @property
    def sids(self) -> list[int]:
        return [s.sid for s in self.decodes] + [p.sid for p in self.prefills]

    @property
    def rows(self) -> list[list[int]]:
        """Each sequence's new tokens, in the order of `sids`."""
        return [[s.pending] for s in self.decodes] + [p.chunk for p in self.prefills]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(p.n for p in self.prefills)

    def __bool__(self) -> bool:
        return self.num_tokens > 0


class Scheduler:
    """Who runs next. First come, first served: a request waits until its blocks fit.

    ``schedule(token_budget)`` plans a step (see the module docstring). Its parts are
    public: ``admit()`` hands out the next group to prefill (a new request's ``n``
    samples, or one preempted sequence), or None to wait; ``requeue`` puts a group back
    first in line; ``start`` and ``finish`` move a sequence in and out of ``running``.
    """

    def __init__(self, cache: PagedCache, max_batch: int = 64) -> None:
        if not isinstance(cache, PagedCache):
            raise TypeError(f"Scheduler needs a PagedCache for its block counts, got {type(cache).__name__}")
        self.cache = cache
        self.max_batch = positive_int("max_batch", max_batch)
        self.waiting: deque[list[Sequence]] = deque()  # groups, each prefilled together
        self.running: list[Sequence] = []  # oldest first
        self.prefilling: Prefill | None = None  # a prompt part-way into the cache (at most one)

    def add(self, group: list[Sequence]) -> None:
        """Queue a new group (a request's ``n`` samples, prefilled together), last in line.

        A group is added once: one already queued, part-way into the cache or running is
        refused, since queueing it twice would prefill it twice and leak the first copy's blocks.
        """
        group = list(group)
        if not group:
            raise ValueError("only new, waiting sequences can be added, got an empty group")
        if not all(isinstance(s, Sequence) for s in group):
            raise TypeError(f"a group is a list of Sequences, got {[type(s).__name__ for s in group]}")
        where = self._where(group)
        if where:
            raise ValueError(
                f"request {group[0].request.rid}'s group is already {where} in this scheduler: a group is added "
                "once (Engine.add queues a new request; a preempted sequence is requeued by the scheduler itself)"
            )
        if any(s.state is not SeqState.WAITING for s in group):
            raise ValueError(f"only new, waiting sequences can be added, got {[s.state.value for s in group]}")
        if len({id(s) for s in group}) != len(group):
            raise ValueError(f"a sequence appears twice in one group of request {group[0].request.rid}")
        if len(group) > self.max_batch:
            raise ValueError(f"n={len(group)} samples cannot run at once with max_batch={self.max_batch}")
        self.waiting.append(group)

    def _where(self, group: list[Sequence]) -> str | None:
        """Where any sequence of ``group`` already is: "queued", "prefilling", "running" or None."""
        mine = {id(s) for s in group}
        if any(id(s) in mine for g in self.waiting for s in g):
            return "queued"
        if self.prefilling is not None and any(id(s) in mine for s in self.prefilling.group):
            return "prefilling"
        if any(id(s) in mine for s in self.running):
            return "running"
        return None

    def blocks_to_admit(self, n_tokens: int, n_samples: int) -> int:
        """The prompt, one decode step's growth, and one copy of the last block per extra fork."""
        return -(-(n_tokens + 1) // self.cache.block_size) + n_samples - 1

    def admit(self, reserved: int = 0, starting: int = 0) -> list[Sequence] | None:
        """The next group to prefill, taken off the queue; None when the head must wait.

        ``reserved``: blocks this step has already promised; ``starting``: sequences this
        step starts (prompts it finishes). Both count against the group, as running ones do.
        """
        if not self.waiting:
            return None
        group = self.waiting[0]
        need = self.blocks_to_admit(len(group[0].tokens), len(group))
        free = self.cache.allocator.num_free - reserved
        if need > free or len(self.running) + starting + len(group) > self.max_batch:
            if not self.running and not starting and not reserved and need > free:
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

    # -- planning a step ------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> StepPlan:
        """Plan one step of at most ``token_budget`` tokens (None: no limit, every admitted prompt whole).

        Decode tokens come first, oldest sequence first; with a budget below the number of
        running sequences only the oldest ``token_budget`` decode and the rest wait a step
        (keep the budget above ``max_batch``, as vLLM requires, so that never happens).
        A prompt whose prefix another prompt of this step is computing waits for the next
        step, and reads those blocks from the prefix cache instead of computing them twice.
        """
        if token_budget is not None:
            positive_int("token_budget", token_budget)
        left = sys.maxsize if token_budget is None else token_budget
        plan = StepPlan()
        try:
            left = self._schedule_decodes(plan, left)
            left = self._schedule_prefills(plan, left)
        except BaseException:
            self.unschedule(plan)  # e.g. the cache refused an admission: put back what this plan took
            raise
        return plan

    def _schedule_decodes(self, plan: StepPlan, left: int) -> int:
        """The oldest running sequences, one token each, preempting the newest while the pool is short."""
        decodes = self.running[:left]
        while decodes and self.cache.blocks_needed([s.sid for s in decodes], 1) > self.cache.allocator.num_free:
            victim = self.running.pop()  # the newest sequence
            self.cache.free(victim.sid)
            victim.sid, victim.state = None, SeqState.PREEMPTED
            self.waiting.appendleft([victim])  # recompute it later, first in line
            plan.preempted.append(victim)
            decodes = self.running[:left]
        plan.decodes = decodes
        return left - len(decodes)

    def _fits(self, plan: StepPlan, p: Prefill) -> bool:
        """Can the pool hold the plan with ``p``'s chunk added?"""
        counts = [1] * len(plan.decodes) + [q.n for q in plan.prefills] + [p.n]
        return self.cache.blocks_needed(plan.sids + [p.sid], counts) <= self.cache.allocator.num_free

    def _schedule_prefills(self, plan: StepPlan, left: int) -> int:
        """The prompt part-way in, then waiting groups, while the budget and the pool last."""
        p, self.prefilling = self.prefilling, None
        if p is not None:
            p.admitted, p.cached, p.n = False, 0, min(left, len(p.tokens) - p.done)
            if p.n == 0:
                self.prefilling = p  # no budget left for it: it goes on next step
                return left
            if not self._fits(plan, p):  # the running sequences took the blocks it needs
                self.cache.free(p.sid)
                self.requeue(p.group)  # nothing was emitted: recompute it later, first in line
                plan.abandoned += 1
                return left
            plan.prefills.append(p)
            left -= p.n
            if not p.last:
                self.prefilling = p
                return left
        while left > 0 and self.waiting and not self._waits_for_this_step(self.waiting[0], plan):
            reserved = self.cache.blocks_needed(plan.sids, [1] * len(plan.decodes) + [q.n for q in plan.prefills])
            group = self.admit(reserved, starting=sum(len(q.group) for q in plan.prefills))
            if group is None:
                break
            try:
                sid, cached = self.cache.add(group[0].tokens)  # prefix-cache hits are not run again
            except BaseException:
                self.requeue(group)
                raise
            p = Prefill(group, sid, cached, min(left, len(group[0].tokens) - cached), cached)
            if not self._fits(plan, p):  # its prefix hits revived free blocks the plan counted on: wait
                self.cache.free(sid)
                self.requeue(group)
                break
            for seq in group:
                seq.cached_tokens = cached
            plan.prefills.append(p)
            left -= p.n
            if not p.last:
                self.prefilling = p  # the budget ran out inside this prompt: the rest goes on next step
                break
        return left

    def _waits_for_this_step(self, group: list[Sequence], plan: StepPlan) -> bool:
        """Does a prompt of this step fill a block that ``group``'s prompt starts with (same tokens
        from the first on)? Then that block is in the prefix cache after this step, not now."""
        if not self.cache.prefix_caching:
            return False
        bs, mine = self.cache.block_size, group[0].tokens
        for p in plan.prefills:
            theirs = p.tokens
            common = 0
            while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
                common += 1
            if p.done // bs < min(common, p.done + p.n) // bs:  # a shared block it fills in this step
                return True
        return False

    def unschedule(self, plan: StepPlan) -> None:
        """A planned step did not run: its prompts give their blocks back and go first in line, in order.
        Its decodes need nothing: they are still running and run again next step."""
        for p in reversed(plan.prefills):
            self.cache.free(p.sid)
            self.requeue(p.group)
        if self.prefilling in plan.prefills:
            self.prefilling = None
        plan.prefills = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self.prefilling is None
