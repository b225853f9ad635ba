import time

import pytest
import torch

from kvlib import PRESETS, Transformer
from kvlib.timing import decode_stepper, matvec_bandwidth, timeit

pytestmark = pytest.mark.cpu_only("about the CPU: threads, AMX, oneDNN")


def test_timeit_reports_the_median():
    calls = []
    t = timeit(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and len(t["all"]) == 5 and min(t["all"]) == t["min"] <= t["median"]
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        timeit(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        timeit(lambda: None, warmup=-1)


def test_matvec_bandwidth_measures_both_layouts():
    r = matvec_bandwidth(64, 32, count=3, repeats=2)
    assert set(r) == {"in_out", "out_in"} and all(v > 0 for v in r.values())
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        matvec_bandwidth(0, 3)


def test_decode_stepper_keeps_the_context_fixed():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    step = decode_stepper(model, torch.tensor([[1, 2, 3]]), 7)
    for _ in range(3):
        step()  # each call decodes one token and crops back to 7, so it never outgrows its 8-slot cache
    with pytest.raises(ValueError, match="context must be a positive int"):
        decode_stepper(model, torch.tensor([[1, 2, 3]]), 0)


def test_filled_decode_stepper_keeps_the_context_and_matches_a_real_step():
    import kvlib
    from kvlib import PRESETS, Transformer
    from kvlib.timing import filled_decode_stepper

    model = Transformer(PRESETS["tiny"]).eval()
    step = filled_decode_stepper(model, 3, 10)
    for _ in range(3):
        step()  # every call sees exactly 10 cached tokens
    cell = step.__closure__
    cache = next(c.cell_contents for c in cell if isinstance(c.cell_contents, kvlib.StaticCache))
    assert cache.get_seq_length() == 10 and cache.keys[0].shape[0] == 3
    assert torch.all(cache.keys[0][:, :, :10] == 0.5)  # the filler was really written


def test_round_robin_keeps_the_fastest_call_of_each():
    from kvlib.timing import round_robin

    calls = {"a": [], "b": []}
    waits = iter([0.02, 0.0, 0.0, 0.02, 0.01, 0.01])

    def make(k):
        def fn():
            calls[k].append(1)
            time.sleep(next(waits))
        return fn

    best = round_robin({"a": make("a"), "b": make("b")}, repeats=2, warmup=1)
    assert len(calls["a"]) == len(calls["b"]) == 3  # taking turns
    assert best["a"] < 0.009 and 0.009 < best["b"] < 0.05  # b's fastest timed call slept 10 ms
    with pytest.raises(ValueError, match="repeats"):
        round_robin({}, repeats=0)


# -- threads: a temporary thread count that always comes back ----------------------------------------
def test_threads_restores_the_count_after_the_block():
    from kvlib.timing import threads

    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before


def test_threads_restores_the_count_after_an_exception():
    from kvlib.timing import threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with threads(3):
            assert torch.get_num_threads() == 3
            raise RuntimeError("raised inside the block")
    assert torch.get_num_threads() == before


def test_threads_nest_and_each_restores_the_count_outside_it():
    from kvlib.timing import threads

    before = torch.get_num_threads()
    with threads(1):
        with threads(3):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 1  # the inner block put back the outer's count
        with threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad, error", [(1.5, TypeError), ("2", TypeError), (True, TypeError), (None, TypeError),
                                        (0, ValueError), (-1, ValueError)])
def test_threads_rejects_a_bad_count_before_changing_anything(bad, error):
    from kvlib.timing import threads

    before = torch.get_num_threads()
    with pytest.raises(error, match="n"):
        threads(bad)  # checked at the call, not only on entering the block
    with pytest.raises(error):
        with threads(bad):
            pass
    assert torch.get_num_threads() == before
