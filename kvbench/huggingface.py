"""Sections (c) and (g): kvlib against Hugging Face ``generate`` on the same weights.

Both libraries load the same SmolLM2 GGUF file and decode greedily from the same
prompt, so any gap in tokens/s is the code around the matrix products: Python overhead
per step, how the cache is stored and grown, which kernels are called. (c) runs both in
fp32, where greedy decoding should give identical tokens (the run
fails if not); (g) runs both in bf16, where the
two libraries round differently and the outputs agree only for a prefix, which is
reported.

``transformers`` is imported only inside `load_hf_smollm2`, so ``import kvbench``
stays cheap.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time

import torch

from kvlib.generate import generate
from kvlib.model import Transformer
from kvlib.pretrained import load_smollm2, smollm2_gguf_path


def load_hf_smollm2():
    """The same GGUF weights in transformers, fp32, with its logging and progress bars off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = smollm2_gguf_path()
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF dequantizer's own tqdm bar
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return hf.eval()


def race_hf(model: Transformer, hf, ids: torch.Tensor, n: int, repeats: int = 3) -> tuple[dict, dict]:
    """Greedy generation of ``n`` tokens after ``ids`` ``(1, T)`` by HF and by kvlib, runs alternated
    so noise hits both: (median tokens/s of each, the last output of each, ``(1, T + n)``).
    The first round is warmup."""
    mask = torch.ones_like(ids)  # (1, T): no padding
    runs = {"hf": lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False),
            "kvlib": lambda: generate(model, ids, n)}
    times, outs = {k: [] for k in runs}, {}
    for _ in range(1 + repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            outs[name] = run()
            times[name].append(time.perf_counter() - t0)
    return {k: n / statistics.median(t[1:]) for k, t in times.items()}, outs


def hf_vs_kvlib(model: Transformer, hf, ids: torch.Tensor, n: int, repeats: int = 3) -> dict:
    """(c) Tokens/s of HF and kvlib greedy generation in fp32, and whether the tokens are identical."""
    tps, outs = race_hf(model, hf, ids, n, repeats)
    return {"new_tokens": n, "hf_tok_s": tps["hf"], "kvlib_tok_s": tps["kvlib"], "ratio": tps["kvlib"] / tps["hf"],
            "identical": torch.equal(outs["hf"], outs["kvlib"])}


def hf_bf16(hf, ids: torch.Tensor, n: int, repeats: int = 3) -> dict:
    """(g) kvlib and HF greedy generation in bf16: tokens/s (runs alternated) and the identical prefix.

    Converts ``hf`` to bf16 in place, so call it after (c)'s fp32 run.
    """
    tps, outs = race_hf(load_smollm2(dtype=torch.bfloat16)[0], hf.to(torch.bfloat16), ids, n, repeats)
    a, b = outs["hf"][0, ids.shape[1]:], outs["kvlib"][0, ids.shape[1]:]  # (n,) each: the new tokens
    differ = (a != b).nonzero()  # (k, 1): positions where they part
    prefix = int(differ[0, 0]) if len(differ) else n
    return {"new_tokens": n, "hf_tok_s": tps["hf"], "kvlib_tok_s": tps["kvlib"], "ratio": tps["kvlib"] / tps["hf"],
            "identical_prefix": prefix}
