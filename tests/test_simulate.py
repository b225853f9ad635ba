"""The serving-pool simulator: worked-by-hand pools, every slot accounted for, and paging vs reservations."""

import numpy as np
import pytest

from kvlib.simulate import EXTERNAL, POLICIES, TraceRequest, request_trace, reservation, simulate

pytestmark = pytest.mark.cpu_only("pure Python: formulas, tables and simulations with no tensors on a device")


def test_simulate_by_hand():
    """Two requests of 2 + 2 tokens hold 8-slot reservations in a 16-slot pool while a third
    waits. Step 0: 2 tokens each held, 2 more to come, 4 never used; step 1: 3, 1, 4.
    Averaged over those two saturated steps: token states 5/16, reserved 3/16, internal 8/16."""
    trace = [TraceRequest(2, 2)] * 3
    r = simulate(trace, "max", memory_slots=16, max_len=8)
    assert r.saturated_steps == 2
    assert r.fractions == {"token states": 5 / 16, "reserved": 3 / 16, "internal fragmentation": 8 / 16,
                           "external fragmentation": 0.0, "free": 0.0}
    assert r.waste == pytest.approx(11 / 16)
    assert r.mean_batch == 2 and r.steps == 4


def test_external_fragmentation_by_hand():
    """Oracle reservations of 3, 3 and 2 slots fill 8 of 10 slots. The next request needs 4
    contiguous slots, so the 2 free slots at the end are unusable: external fragmentation.
    After one step the 2-slot request finishes, its gap joins them, and the waiter fits."""
    trace = [TraceRequest(1, 2), TraceRequest(1, 2), TraceRequest(1, 1), TraceRequest(2, 2)]
    r = simulate(trace, "oracle", memory_slots=10, max_len=8)
    # step 0: the first three are admitted (slots 0-2, 3-5, 6-7); gap 8-9 (2 slots) < 4 needed
    m = r.memory_map
    assert r.snapshot_step == 0
    assert (m[8:] == EXTERNAL).all() and (m[:8] != EXTERNAL).all()
    assert r.saturated_steps == 1 and r.fractions["external fragmentation"] == pytest.approx(2 / 10)


def test_a_pool_that_never_fills_is_averaged_over_every_step():
    trace = [TraceRequest(2, 2)] * 2  # both fit at once: nobody ever waits
    r = simulate(trace, "max", memory_slots=16, max_len=8)
    assert r.saturated_steps == 0 and r.steps == 2
    assert r.fractions["token states"] == pytest.approx((4 + 6) / 2 / 16) and r.fractions["free"] == 0
    assert r.mean_batch == 2


def test_paging_with_one_slot_blocks_wastes_nothing():
    trace = request_trace(60, seed=1, max_len=512)
    r = simulate(trace, "paged", memory_slots=4096, max_len=512, block_size=1)
    assert r.fractions["reserved"] == r.fractions["internal fragmentation"] == r.fractions["external fragmentation"] == 0
    assert r.waste == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_simulate_accounts_for_every_slot(policy):
    trace = request_trace(80, seed=2, max_len=512)
    r = simulate(trace, policy, memory_slots=4096, max_len=512, block_size=16)
    assert sum(r.fractions.values()) == pytest.approx(1.0)
    assert all(v >= 0 for v in r.fractions.values())
    assert r.memory_map.shape == (4096,) and set(np.unique(r.memory_map)) <= set(range(5))
    if policy == "oracle":
        assert r.fractions["internal fragmentation"] == 0  # it reserves exactly what each request will use
    if policy in ("max", "paged"):
        assert r.fractions["external fragmentation"] == 0  # equal-size reservations / blocks always fit
    if policy == "paged":
        # the last block of each request is the only slack: under one block per running request
        slack = r.fractions["reserved"] + r.fractions["internal fragmentation"]
        assert slack * 4096 < r.peak_batch * 16


def test_paging_beats_max_reservation_on_a_chat_trace():
    trace = request_trace(150, seed=0)
    contiguous = simulate(trace, "max", memory_slots=16384)
    paged = simulate(trace, "paged", memory_slots=16384, block_size=16)
    assert contiguous.waste > 0.6 and paged.waste < 0.04
    assert paged.mean_batch > 2 * contiguous.mean_batch


def test_a_watermark_trades_batch_size_for_fewer_preemptions():
    trace = request_trace(150, seed=0)
    greedy = simulate(trace, "paged", memory_slots=16384, watermark=0.0)
    careful = simulate(trace, "paged", memory_slots=16384, watermark=0.2)
    assert greedy.preemptions > careful.preemptions and greedy.mean_batch > careful.mean_batch
    # each preemption drops what its victim held: at least its prompt, less than its final length
    assert len(greedy.preempted_tokens) == greedy.preemptions > 0
    assert min(greedy.preempted_tokens) >= min(r.prompt for r in trace)
    assert max(greedy.preempted_tokens) < max(r.total for r in trace)
    with pytest.raises(ValueError, match="watermark must lie in"):
        simulate(trace, "paged", memory_slots=16384, watermark=1.0)


def test_request_trace():
    a = request_trace(2000, seed=3, max_len=1024)
    assert a == request_trace(2000, seed=3, max_len=1024)
    assert all(r.prompt >= 1 and r.output >= 1 and r.total <= 1024 for r in a)
    assert np.median([r.prompt for r in a]) == pytest.approx(160, rel=0.1)  # the stated median


def test_simulate_rejects_bad_input():
    trace = [TraceRequest(10, 10)]
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate(trace, "best", memory_slots=64)
    with pytest.raises(ValueError, match="exceed max_len=16"):
        simulate(trace, "max", memory_slots=64, max_len=16)
    with pytest.raises(ValueError, match="needs 2048 slots but the pool has 64"):
        simulate(trace, "max", memory_slots=64)
    with pytest.raises(ValueError, match="empty"):
        simulate([], "max", memory_slots=64)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        simulate(trace, "paged", memory_slots=64, block_size=0)
    with pytest.raises(ValueError, match="contiguous policy"):
        reservation("paged", trace[0], 64)
    with pytest.raises(ValueError, match="n must be a positive int"):
        request_trace(0)


def test_preempted_tokens_by_hand():
    """Two requests of 3-token prompts and 3-token outputs in a pool of two 4-slot blocks: both are
    admitted (one block each); at 4 tokens each needs a second block, none is free, so the newest
    is preempted holding 4 tokens, and recomputed after the first finishes."""
    trace = [TraceRequest(3, 3), TraceRequest(3, 3)]
    r = simulate(trace, "paged", memory_slots=8, max_len=8, block_size=4, watermark=0.0)
    assert r.preempted_tokens == (4,) and r.preemptions == 1
    assert simulate(trace, "max", memory_slots=16, max_len=8).preempted_tokens == ()  # contiguous never preempts
