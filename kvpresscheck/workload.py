"""What both sides are given: one passage, five presses, two compression ratios.

Everything here is plain data (names, ints, floats): the driver writes it to JSON and
`kvpresscheck.kvpress_side` reads it inside kvpress's own environment.

A *run* is one press at one compression ratio. Each side prefills the same token ids
with the press, so that every layer's cache is pruned once, after its attention, and
then continues greedily for `NEW_TOKENS` tokens from the pruned cache. The first
continuation token comes from the prefill's own logits, which every layer computed
before it was pruned; the others see only what was kept.
"""

from __future__ import annotations

N_TOKENS = 512  # the passage: Tiny Shakespeare's held-out split, its first 512 tokens
NEW_TOKENS = 24  # greedy tokens after the prefill
RATIOS = (0.5, 0.25)  # compression_ratio: the fraction of the cache a press removes

# kvlib's name of each press -> kvpress's class (kvpress.presses), with kvpress's defaults
KVPRESS_CLASS = {
    "snapkv": "SnapKVPress",  # window_size=64, kernel_size=5
    "pyramidkv": "PyramidKVPress",  # window_size=64, kernel_size=5, beta=20
    "tova": "TOVAPress",
    "expected_attention": "ExpectedAttentionPress",  # n_future_positions=512, n_sink=4
    "streaming_llm": "StreamingLLMPress",  # n_sink=4
}
PRESSES = tuple(KVPRESS_CLASS)

# The hyper-parameters kvpress 0.5.5 gives each press by default: the brute-force reference
# (`kvpresscheck.reference`) takes the same, and the kvpress side records the ones it ran with.
DEFAULTS = {
    "snapkv": {"window_size": 64, "kernel_size": 5},
    "pyramidkv": {"window_size": 64, "kernel_size": 5, "beta": 20},
    "tova": {},
    "expected_attention": {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True,
                           "epsilon": 0.0},
    "streaming_llm": {"n_sink": 4},
}


def runs(presses: tuple[str, ...] = PRESSES, ratios: tuple[float, ...] = RATIOS) -> list[dict]:
    """Every (press, ratio) pair, as ``{"name": "snapkv@0.5", "press": "snapkv", "ratio": 0.5}``."""
    unknown = [p for p in presses if p not in KVPRESS_CLASS]
    if unknown:
        raise ValueError(f"unknown presses {unknown}; kvpresscheck knows {list(KVPRESS_CLASS)}")
    bad = [r for r in ratios if not 0 < r < 1]
    if bad:
        raise ValueError(f"compression ratios must lie in (0, 1), got {bad}")
    return [{"name": f"{p}@{r:g}", "press": p, "ratio": float(r)} for p in presses for r in ratios]


def passage_ids(tok, n_tokens: int = N_TOKENS) -> list[int]:
    """The passage both sides compress: the first ``n_tokens`` tokens of Tiny Shakespeare's
    held-out split (it ends, at 512, on Petruchio's "I would fain be doing.")."""
    from kvlib.data import tiny_shakespeare

    ids = tok.encode(tiny_shakespeare("val"))
    if not 0 < n_tokens <= len(ids):
        raise ValueError(f"n_tokens must be in [1, {len(ids)}], got {n_tokens}")
    return [int(t) for t in ids[:n_tokens]]
