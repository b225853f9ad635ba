"""The serving engine's parts: Sequence (a state enum), Scheduler (no tensors), Engine (schedule, run
ONE packed forward, process)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import SamplingParams
from kvlib.paged import OutOfBlocks
from kvlib.engine import Engine, EngineStats, Request, Scheduler, SeqState, Sequence
from kvlib.paged import PagedCache

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


def request(n=1, prompt=(1, 2, 3)):
    return Request(0, list(prompt), SamplingParams(max_new_tokens=4), n)


def test_bad_sequences_are_refused():
    cache = PagedCache(1, 1, 1, num_blocks=4, block_size=2)
    with pytest.raises(TypeError, match="belongs to a Request"):
        Sequence("not a request", 0, cache)
    with pytest.raises(IndexError, match="sample index 2 is outside the request's n=2 samples"):
        Sequence(request(n=2), 2, cache)
    with pytest.raises(TypeError, match="state must be a SeqState"):
        Sequence(request(), 0, cache, state="running")


def test_bad_scheduler_inputs_are_refused():
    cache = PagedCache(1, 1, 1, num_blocks=4, block_size=2)
    with pytest.raises(TypeError, match="needs a PagedCache"):
        Scheduler(kvlib.DynamicCache(1))
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        Scheduler(cache, max_batch=0)
    s = Scheduler(cache, max_batch=2)
    req = request(n=3)
    with pytest.raises(ValueError, match="n=3 samples cannot run at once with max_batch=2"):
        s.add([Sequence(req, i, cache) for i in range(3)])
    done = Sequence(request(), 0, cache, state=SeqState.FINISHED)
    with pytest.raises(ValueError, match="only new, waiting sequences"):
        s.add([done])
    with pytest.raises(ValueError, match="only new, waiting sequences"):
        s.add([])


def test_the_scheduler_admits_first_come_first_served_and_never_touches_a_tensor():
    """Block arithmetic only: a 5-token prompt needs ceil(6 / 2) = 3 blocks, forks one more each."""
    cache = PagedCache(1, 1, 1, num_blocks=4, block_size=2)
    s = Scheduler(cache)
    big, small = request(n=2, prompt=range(5)), request(prompt=[1])
    assert s.blocks_to_admit(5, 2) == 4 and s.blocks_to_admit(1, 1) == 1
    s.add([Sequence(big, i, cache) for i in range(2)])
    s.add([Sequence(small, 0, cache)])
    assert s.admit() is not None  # 4 blocks free: the head fits
    cache.add([0, 1, 2, 3, 4])  # pretend it runs: its blocks are not reserved yet, so take them by hand
    a = cache.allocator
    for _ in range(4):
        a.allocate()
    with pytest.raises(OutOfBlocks, match="needs 1 blocks"):
        s.admit()  # nothing running and no room: it can never fit
    seq = Sequence(small, 0, cache, state=SeqState.RUNNING)
    s.running.append(seq)
    assert s.admit() is None  # something runs: wait for it to finish


def test_states_move_waiting_running_preempted_finished(tiny, device):
    """A pool so tight that the second sequence is preempted, then recomputed."""
    cache = PagedCache.for_model(tiny, num_blocks=5, block_size=2)
    eng = Engine(tiny, cache)
    eng.add([1, 2, 3], 4)
    eng.add([4, 5, 6], 4)
    first, second = (eng.requests[i].seqs[0] for i in range(2))
    assert first.state is second.state is SeqState.WAITING and first.block_table == []
    eng.step()  # both prompts in one forward
    assert first.state is second.state is SeqState.RUNNING
    assert len(first.block_table) == 2 and first.cached_tokens == 0
    seen = set()
    while not eng.finished:
        eng.step()
        seen.add(second.state)
    assert SeqState.PREEMPTED in seen and first.finished and second.finished
    assert eng.stats.preemptions > 0 and isinstance(eng.stats, EngineStats)
    for i, p in enumerate(([1, 2, 3], [4, 5, 6])):  # preemption changed no token
        want = kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=4)[0, 3:].tolist()
        assert eng.requests[i].outputs == [want]
    assert cache.allocator.num_used == 0


def test_a_failure_after_the_forward_drops_the_step_and_the_engine_goes_on(tiny, monkeypatch, device):
    """Sampling raises once, mid-decode, after the model ran: nothing is committed or emitted,
    and the retried steps give exactly generate's tokens."""
    import kvlib.engine as engine_module

    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = [kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=6)[0, len(p):].tolist() for p in prompts]
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache)
    for p in prompts:
        eng.add(p, 6)
    eng.step()
    before = ([s.output[:] for r in eng.requests.values() for s in r.seqs],
              [cache.tokens(s.sid) for r in eng.requests.values() for s in r.seqs])
    real, calls = engine_module.sample, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("interrupted while sampling")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", flaky)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    after = ([s.output[:] for r in eng.requests.values() for s in r.seqs],
             [cache.tokens(s.sid) for r in eng.requests.values() for s in r.seqs])
    assert after == before  # no token emitted, none stored
    cache.check()
    out = eng.run()
    assert [out[0][0], out[1][0]] == want


def test_the_engine_reads_the_device_once_per_step(tiny, monkeypatch):
    """Token ids reach the cache as host ints; the sampled ids come back in one tolist(), in a
    prefill step, a decode step, and a step that mixes both (one forward each)."""
    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(tuple(self.shape))
        return real(self)

    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache)
    for p in ([1, 2, 3], [4, 5], [6]):
        eng.add(p, 3)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    eng.step()  # three prompts
    assert reads == [(3,)]
    eng.add([7, 8, 9, 10], 2, n=2)
    eng.step()  # three decodes and a prompt forked two ways
    assert reads == [(3,), (5,)]
    eng.step()  # five decodes
    monkeypatch.undo()
    assert reads == [(3,), (5,), (5,)] and eng.stats.forwards == eng.stats.steps == 3


# -- chunked prefill: a per-step token budget ---------------------------------------------------------
def _run_with_arrivals(model, cache, prompts, arrive, max_new, n=1, **engine_kwargs):
    """Each prompt is added at the step ``arrive[i]`` says; returns (outputs, engine), the
    outputs one list per sample when ``n > 1``."""
    eng = Engine(model, cache, **engine_kwargs)
    rids, step, budget = {}, 0, engine_kwargs.get("token_budget")
    while len(rids) < len(prompts) or not eng.finished:
        for i, a in enumerate(arrive):
            if a == step:
                rids[i] = eng.add(prompts[i], max_new, n=n)
        plan = eng.step()
        assert budget is None or plan.num_tokens <= budget  # one forward, under the budget, decodes included
        step += 1
        assert step < 1000
    out = eng.run()
    return [out[rids[i]] if n > 1 else out[rids[i]][0] for i in range(len(prompts))], eng


@settings(max_examples=25, deadline=None)
@given(
    budget=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    lengths=st.lists(st.integers(1, 45), min_size=1, max_size=4),
    arrive=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    prefix=st.booleans(),
    n=st.sampled_from([1, 2]),
)
def test_chunked_prefill_gives_the_tokens_of_unchunked_prefill(tiny, budget, block_size, lengths, arrive, prefix, n, device):
    """Any token budget, block size, arrival order, prefix caching and 1 or 2 samples (forked
    after the last chunk): the same greedy tokens as each prompt through `kvlib.generate`
    alone, every block returned at the end, and every prompt token run or found once."""
    rng = random.Random(sum(lengths) + budget)
    shared = [rng.randrange(50) for _ in range(8)]  # a common start, so prefix caching has hits
    prompts = [(shared + [rng.randrange(50) for _ in range(n)])[:n] for n in lengths]
    want = [kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=5)[0, len(p):].tolist() for p in prompts]
    cache = PagedCache.for_model(tiny, num_blocks=200 // block_size + 8, block_size=block_size,
                                 prefix_caching=prefix)
    got, eng = _run_with_arrivals(tiny, cache, prompts, arrive[: len(prompts)], 5, n=n, token_budget=budget)
    assert got == ([[w] * n for w in want] if n > 1 else want)
    assert cache.allocator.num_used == 0 and not cache.seqs
    cache.check()
    if eng.stats.preemptions == 0:  # nothing recomputed
        assert eng.stats.prefill_tokens + eng.stats.cached_tokens == sum(lengths)


def test_chunked_prefill_keeps_the_running_sequences_decoding(tiny, device):
    """A 60-token prompt arrives while two sequences run. Whole, it is one step and the two
    wait for it; with a budget of 12 tokens a step, each step runs the two decode tokens and 10
    prompt tokens in ONE forward, so the prompt takes ceil(60 / 10) = 6 steps and the two emit
    at each."""
    short, long = [[1, 2, 3], [4, 5]], [(7 * i) % 50 for i in range(60)]
    for budget, chunks in ((None, 1), (12, 6)):
        cache = PagedCache.for_model(tiny, num_blocks=64, block_size=4)
        eng = Engine(tiny, cache, token_budget=budget)
        for p in short:
            eng.add(p, 20)
        eng.step()  # both prompts, in one forward
        eng.step()  # both decode
        rid = eng.add(long, 3)
        seq = eng.requests[rid].seqs[0]
        steps, sizes = 0, []
        emitted = [len(eng.requests[i].seqs[0].output) for i in range(2)]
        while not seq.output:
            plan = eng.step()
            sizes.append((len(plan.decodes), [p.n for p in plan.prefills]))
            steps += 1
        assert steps == chunks and eng.stats.prefill_chunks == 2 + chunks
        assert eng.stats.forwards == eng.stats.steps == 2 + chunks  # one forward per step
        assert sizes == ([(2, [60])] if budget is None else [(2, [10])] * 6)
        assert [len(eng.requests[i].seqs[0].output) for i in range(2)] == [e + steps for e in emitted]
        assert eng.run()[rid][0] == kvlib.generate(tiny, torch.tensor([long], device=device), max_new_tokens=3)[0, 60:].tolist()


def test_a_budget_below_the_running_count_decodes_the_oldest_and_still_finishes(tiny, device):
    """token_budget=2 with three samples running: each step is one forward of at most two tokens,
    the two oldest decode and the third waits (no prompt is admitted meanwhile); the tokens are
    still generate's, and everything finishes."""
    want = [kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=4)[0, len(p):].tolist() for p in ([1, 2, 3], [4, 5])]
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=32, block_size=4), token_budget=2)
    eng.add([1, 2, 3], 4, n=3)  # greedy: three identical samples
    eng.add([4, 5], 4)
    seen = []
    while not eng.finished:
        running = list(eng.scheduler.running)
        plan = eng.step()
        seen.append((len(running), [s.index for s in plan.decodes], len(plan.prefills)))
        assert plan.num_tokens <= 2 and len(seen) < 100
    assert (3, [0, 1], 0) in seen  # three running: the oldest two decode, the third waits
    assert eng.run() == {0: [want[0]] * 3, 1: [want[1]]}
    assert eng.stats.forwards == eng.stats.steps == len(seen)


def test_a_prefill_that_runs_out_of_blocks_is_put_back_and_recomputed(tiny, monkeypatch, device):
    """A 16-token prompt is admitted (9 of 20 blocks of 2 are needed, 14 are free) while two
    sequences run; at 2 prompt tokens a step, their growth takes the blocks it still needs.
    The half-prefilled prompt gives its blocks back, waits, and its tokens are still exact."""
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], list(range(10, 26))]
    want = [kvlib.generate(tiny, torch.tensor([p], device=device), max_new_tokens=16)[0, len(p):].tolist() for p in prompts]
    abandoned = []
    real = Engine.step

    def step(self):
        plan = real(self)
        abandoned.extend([1] * plan.abandoned)
        return plan

    monkeypatch.setattr(Engine, "step", step)
    cache = PagedCache.for_model(tiny, num_blocks=20, block_size=2, prefix_caching=False)
    got, eng = _run_with_arrivals(tiny, cache, prompts, [0, 0, 2], 16, token_budget=4)
    assert got == want and abandoned and eng.stats.preemptions >= len(abandoned)
    assert cache.allocator.num_used == 0
    cache.check()


def test_token_times_are_recorded_per_emitted_token(tiny):
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=16, block_size=4), token_budget=8)
    eng.add([1, 2, 3], 5)
    eng.run()
    seq = eng.requests[0].seqs[0]
    assert len(seq.times) == len(seq.output) == 5 and seq.times == sorted(seq.times)


@pytest.mark.parametrize("budget, error, match", [
    (0, ValueError, "must be a positive int"), (-3, ValueError, "must be a positive int"),
    (2.5, TypeError, "must be an int, got float"), (True, TypeError, "must be an int, got bool")])
def test_a_token_budget_must_be_a_positive_int(tiny, budget, error, match):
    with pytest.raises(error, match="token_budget " + match):
        Engine(tiny, PagedCache.for_model(tiny, num_blocks=4, block_size=4), token_budget=budget)


def test_a_prompt_whose_cache_add_fails_is_put_back(tiny, monkeypatch, device):
    """The group left the queue when it was admitted; if the cache refuses it, it must go back."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache, token_budget=8)
    eng.add([1, 2, 3, 4, 5], 3)
    real, calls = cache.add, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt("interrupted while adding")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "add", failing)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert len(eng.scheduler.waiting) == 1 and not eng.finished
    ref = kvlib.generate(tiny, torch.tensor([[1, 2, 3, 4, 5]], device=device), max_new_tokens=3)[0, 5:].tolist()
    assert eng.run()[0][0] == ref


@pytest.mark.parametrize("budget, error, match", [
    (0, ValueError, "token_budget must be a positive int, got 0"),
    (2.5, TypeError, "token_budget must be an int, got float"),
    (True, TypeError, "token_budget must be an int, got bool")])
def test_a_schedule_budget_must_be_a_positive_int(tiny, budget, error, match):
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=4, block_size=4))
    eng.add([1, 2], 2)
    with pytest.raises(error, match=match):
        eng.scheduler.schedule(budget)
    assert len(eng.scheduler.waiting) == 1  # nothing was admitted


def test_prompt_ids_must_be_integers(tiny):
    eng = Engine(tiny, PagedCache.for_model(tiny, num_blocks=4, block_size=4))
    with pytest.raises(TypeError, match="token ids are integers, got float 1.5"):
        eng.add([1, 1.5], 2)
    with pytest.raises(TypeError, match="got str"):
        eng.add("hi", 2)


# -- issue 45 ---------------------------------------------------------------------------------------
def test_a_group_already_queued_or_running_is_refused(tiny):
    """0.4: Scheduler.add took a group that was already queued; after run() 2 blocks and
    1 cache sequence leaked (it was prefilled twice, and only one copy was ever freed)."""
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache)
    rid = eng.add([1, 2, 3, 4, 5], max_new_tokens=3)
    group = list(eng.requests[rid].seqs)
    with pytest.raises(ValueError, match=r"request 0's group is already queued .* added once"):
        eng.scheduler.add(group)
    eng.step()  # prefilled: now running
    with pytest.raises(ValueError, match="already running"):
        eng.scheduler.add(group)
    eng.run()
    assert cache.allocator.num_used == 0 and not cache.seqs  # nothing leaked
    cache.check()


def test_a_group_part_way_into_the_cache_is_refused(tiny):
    cache = PagedCache.for_model(tiny, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache, token_budget=2)
    rid = eng.add([1, 2, 3, 4, 5], max_new_tokens=2)
    eng.step()  # the first chunk of 2 ran; the prompt is part-way in
    with pytest.raises(ValueError, match="already prefilling"):
        eng.scheduler.add(list(eng.requests[rid].seqs))
    with pytest.raises(TypeError, match=r"list of Sequences, got \['list'\]"):
        eng.scheduler.add([[1, 2]])
    eng.run()
    assert cache.allocator.num_used == 0 and not cache.seqs


def test_a_pool_of_another_dtype_is_refused_at_construction(tiny):
    """0.4: Engine took a bf16 model with an fp32 pool and failed inside run()."""
    half = kvlib.Transformer(tiny.config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"torch.float32 on cpu but the model runs in torch.bfloat16 .*"
                                         r"PagedCache.for_model\(model"):
        Engine(half, PagedCache.for_model(tiny, num_blocks=16, block_size=4))
    eng = Engine(half, PagedCache.for_model(half, num_blocks=16, block_size=4))  # the fix the message names
    rid = eng.add([1, 2, 3], max_new_tokens=2)
    assert len(eng.run()[rid][0]) == 2
