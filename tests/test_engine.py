"""The serving engine's parts: Sequence (a state enum), Scheduler (no tensors), Engine (schedule, run, process)."""

import pytest
import torch

import kvlib
from kvlib import SamplingParams
from kvlib.blocks import OutOfBlocks
from kvlib.engine import Engine, EngineStats, Request, Scheduler, SeqState, Sequence
from kvlib.paged import PagedCache


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


def test_states_move_waiting_running_preempted_finished(tiny):
    """A pool so tight that the second sequence is preempted, then recomputed."""
    cache = PagedCache.for_model(tiny.config, num_blocks=5, block_size=2)
    eng = Engine(tiny, cache)
    eng.add([1, 2, 3], 4)
    eng.add([4, 5, 6], 4)
    first, second = (eng.requests[i].seqs[0] for i in range(2))
    assert first.state is second.state is SeqState.WAITING and first.block_table == []
    eng.prefill()
    assert first.state is second.state is SeqState.RUNNING
    assert len(first.block_table) == 2 and first.cached_tokens == 0
    seen = set()
    while not eng.finished:
        eng.step()
        seen.add(second.state)
    assert SeqState.PREEMPTED in seen and first.finished and second.finished
    assert eng.stats.preemptions > 0 and isinstance(eng.stats, EngineStats)
    for i, p in enumerate(([1, 2, 3], [4, 5, 6])):  # preemption changed no token
        want = kvlib.generate(tiny, torch.tensor([p]), max_new_tokens=4)[0, 3:].tolist()
        assert eng.requests[i].outputs == [want]
    assert cache.allocator.num_used == 0


def test_a_failure_after_the_forward_drops_the_step_and_the_engine_goes_on(tiny, monkeypatch):
    """Sampling raises once, mid-decode, after the model ran: nothing is committed or emitted,
    and the retried steps give exactly generate's tokens."""
    import kvlib.engine as engine_module

    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = [kvlib.generate(tiny, torch.tensor([p]), max_new_tokens=6)[0, len(p):].tolist() for p in prompts]
    cache = PagedCache.for_model(tiny.config, num_blocks=16, block_size=4)
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
    """Token ids reach the cache as host ints; the sampled ids come back in one tolist()."""
    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(tuple(self.shape))
        return real(self)

    cache = PagedCache.for_model(tiny.config, num_blocks=16, block_size=4)
    eng = Engine(tiny, cache)
    for p in ([1, 2, 3], [4, 5], [6]):
        eng.add(p, 3)
    eng.prefill()
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    eng.decode()
    monkeypatch.undo()
    assert reads == [(3,)]  # one read: the three sampled tokens
