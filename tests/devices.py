"""Tolerances by device, stated once, for tests that compare one fp32 result computed two ways
(cached against full recompute, a kernel against SDPA, a batch against its rows alone).

On the CPU each test keeps its own tolerance. On CUDA, conftest turns TF32 off
(``torch.backends.cuda.matmul.allow_tf32 = False``, ``torch.backends.cudnn.allow_tf32 = False``), so
matmuls run in true fp32; what remains is summation order, which cuBLAS and the SDPA backends pick by
shape (a (1, d) row against a (T, d) block, a split-K kernel): a few units in the 6th digit at these
sizes. ``tol`` widens a test's own fp32 tolerance to that floor on CUDA and never narrows it. Exact
comparisons (``rtol=0, atol=0``) of one computation repeated stay exact on every device, and token
equality holds where logits are sharp (``reset_parameters(seed, std=0.2)``: no near-ties to flip).
"""

import torch

FP32_FLOOR = {"cpu": (0.0, 0.0), "cuda": (1e-5, 1e-5)}  # (rtol, atol) below which no fp32 check goes


def tol(device: torch.device | str, rtol: float, atol: float) -> dict[str, float]:
    """``dict(rtol=..., atol=...)`` for ``torch.testing.assert_close`` on ``device``: the test's own
    tolerance, raised to the device's fp32 floor."""
    floor_r, floor_a = FP32_FLOOR[torch.device(device).type]
    return dict(rtol=max(rtol, floor_r), atol=max(atol, floor_a))
