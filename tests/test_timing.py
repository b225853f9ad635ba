import pytest
import torch

from kvlib import PRESETS, Transformer
from kvlib.timing import decode_stepper, matvec_bandwidth, timeit


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
