"""The work both engines are given: request sets and the engine settings that go with them.

A *scenario* is one engine configuration and the requests it serves, in *phases*.
Each request has an arrival step: the driver adds it just before that step of the
engine (``LLMEngine.step()`` in vLLM, ``Engine.step()`` in kvlib), so both engines see
the same arrivals at the same steps. A phase ends when both engines are idle; the
next one starts on the same engine, so its prefix cache remembers the earlier phases.

Everything here is plain data (dicts, lists of ints): it is written to JSON and read
by `vllmcheck.vllm_side` inside vLLM's own environment.
"""

from __future__ import annotations

from kvlib.config import ModelConfig
from kvlib.memory import kv_bytes_per_token

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32 ("No common block size for 16")
MAX_MODEL_LEN = 1024
CAPACITY_GIB = 1  # the pool of the token check: 1 GiB, as VLLM_CPU_KVCACHE_SPACE=1 sets it
SMALL_POOL_BLOCKS = 16  # the pool of the preemption check (15 usable: vLLM keeps one as its null block)
SMALL_MAX_LEN = 448  # vLLM refuses a pool that cannot hold one request of max_model_len
SMALL_BUDGET = 128  # max_num_batched_tokens / token_budget of the chunked-prefill check
MAX_SEQS = 16  # max_num_seqs / max_batch everywhere


def _request(rid: str, prompt: list[int], max_tokens: int, arrive: int = 0) -> dict:
    return {"id": rid, "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens), "arrive": int(arrive)}


WARMUP = _request("warmup", range(1, 33), 4)  # served, then forgotten, before a timed scenario


def prompt_of(request: dict, done: dict) -> list[int]:
    """The tokens a request sends: its own, after the earlier turn it follows (that turn's prompt
    and the reply this engine gave it, from ``done``: request id -> record) if it is a follow-up."""
    prompt = list(request["prompt"])
    if "follow" in request:
        prev = done[request["follow"]]
        prompt = prev["prompt"] + prev["tokens"] + prompt
    return prompt


def mixed(text_ids: list[int], n: int = 16, new: int = 64) -> list[dict]:
    """``n`` prompts of 16 to 160 tokens, cut from different places of the text, all at step 0."""
    out = []
    for i in range(n):
        length = 16 + (144 * i) // max(n - 1, 1)
        start = 997 * i
        out.append(_request(f"mixed-{i}", text_ids[start : start + length], new))
    return out


def prefix_phases(text_ids: list[int], system: int = 100, new: int = 24) -> list[list[dict]]:
    """A system prompt shared by four questions, the same request twice, and a follow-up turn.

    Phase 1 runs the first question alone, so its blocks are cached before the others
    arrive; phase 2 sends three more questions and the first one again; phase 3 sends
    the first question's follow-up, whose prompt is the first turn, its reply (filled in
    by the driver from each engine's own output: ``"follow": request id``) and more text.
    """
    sys_ids = text_ids[50_000 : 50_000 + system]
    q = [text_ids[60_000 + 200 * i : 60_000 + 200 * i + 20 + 7 * i] for i in range(4)]
    first = _request("prefix-0", sys_ids + q[0], new)
    return [
        [first],
        [_request(f"prefix-{i}", sys_ids + q[i], new) for i in (1, 2, 3)] + [dict(first, id="prefix-0-again")],
        [dict(_request("prefix-followup", text_ids[61_000:61_030], new), follow="prefix-0")],
    ]


def chunked(text_ids: list[int]) -> list[dict]:
    """Two short requests decoding, then a 300-token prompt arriving at step 3."""
    return [
        _request("chunk-short-0", text_ids[70_000:70_012], 40),
        _request("chunk-short-1", text_ids[71_000:71_020], 40),
        _request("chunk-long", text_ids[72_000:72_300], 8, arrive=3),
    ]


def preempting(text_ids: list[int], n: int = 8, prompt: int = 48, new: int = 64) -> list[dict]:
    """``n`` requests that need ``ceil((prompt + new) / 32)`` = 4 blocks each: 32 for all, in a pool of 15."""
    return [_request(f"preempt-{i}", text_ids[80_000 + 500 * i : 80_000 + 500 * i + prompt], new) for i in range(n)]


def block_bytes(config: ModelConfig, block_size: int = BLOCK_SIZE, dtype: str = "fp32") -> int:
    """Bytes of one block across every layer: what vLLM divides its KV memory by."""
    return block_size * kv_bytes_per_token(config, dtype)


def scenarios(config: ModelConfig, text_ids: list[int], spec_prompts: dict[str, list[int]],
              serving_prompts_ids: list[list[int]]) -> list[dict]:
    """Every scenario of the cross-check, each with vLLM's ``LLM(...)`` settings and kvlib's.

    ``spec_prompts``: name -> token ids, the prompts of the speculative-decoding check;
    ``serving_prompts_ids``: the requests of chapter 12's side-by-side run (`serving`).
    """
    common = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
              "max_num_seqs": MAX_SEQS, "enforce_eager": True, "seed": 0}
    big = {**common, "kv_cache_memory_bytes": CAPACITY_GIB * 2**30, "max_num_batched_tokens": 4096}
    small = {**common, "kv_cache_memory_bytes": SMALL_POOL_BLOCKS * block_bytes(config), "max_model_len": SMALL_MAX_LEN,
             "max_num_batched_tokens": SMALL_BUDGET}
    mix = mixed(text_ids)
    spec = [_request(f"spec-{name}", ids, 32) for name, ids in spec_prompts.items()]
    return [
        {"name": "mixed", "llm": big, "phases": [mix] + prefix_phases(text_ids), "timed": True,
         "kvlib": {"token_budget": 4096}},
        {"name": "small", "llm": small, "phases": [chunked(text_ids), preempting(text_ids)],
         "kvlib": {"token_budget": SMALL_BUDGET}},
        {"name": "fp8", "llm": {**big, "kv_cache_dtype": "fp8"}, "phases": [mix[:8]], "kvlib": None},
        {"name": "ngram", "llm": {**big, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
         "phases": [[r] for r in spec], "kvlib": None},  # one phase each: its metrics are that prompt's
        {"name": "compiled", "llm": {**big, "enforce_eager": False}, "phases": [mix], "timed": True, "kvlib": None},
        serving(config, serving_prompts_ids),
    ]


FUNCTION = '''def mean(values):
    """Return the arithmetic mean of values."""
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''


def spec_prompts(tok) -> dict[str, list[int]]:
    """Chapter 12's three prompts for speculative decoding, as token ids: text that quotes
    itself, code to edit (which repeats the function), and a story (which repeats little)."""
    return {
        "quote a passage": tok.encode(
            "The KV cache stores the keys and values of every token that came before, so "
            "that each decode step computes attention for one new token only. Without it, "
            "every step recomputes the whole prefix.\n\nQuestion: What does the KV cache "
            "store?\nAnswer: The KV cache stores"),
        "edit code": tok.apply_chat_template([{"role": "user", "content":
            "Rename the variable `total` to `acc` in this function and show the new "
            "version:\n\n" + FUNCTION}]),
        "write a story": tok.apply_chat_template([{"role": "user", "content":
            "Write a short story about a lighthouse keeper."}]),
    }


SERVING_TEXTS = (  # chapter 12's requests for vLLM: short, so that their replies fill the pool
    "The history of the Roman Empire began when",
    "def fibonacci(n):",
    "A key-value cache speeds up transformer inference because",
    "Once upon a time, in a small village by the sea, there lived",
)


def serving_prompts(tok) -> list[list[int]]:
    """`SERVING_TEXTS` as token ids."""
    return [tok.encode(t) for t in SERVING_TEXTS]


def serving(config: ModelConfig, prompts: list[list[int]], new: int = 48, pool_blocks: int = 8, max_model_len: int = 192,
            budget: int = 128) -> dict:
    """A small scenario around a reader's own prompts: tokens, cached tokens and preemptions at once.

    Phase 1 serves the prompts together from a pool of ``pool_blocks`` blocks of 32 (one
    of them vLLM's null block), too few for all of them to finish without a preemption
    when they are long enough. Phase 2 sends each one's follow-up turn (its prompt, its
    reply, and a newline), whose first full blocks the prefix cache still holds. The cross-check
    also records both engines' pools on it, step by step (`vllmcheck.run`'s ``trace``), compared
    by `vllmcheck.traces`.
    """
    if not prompts or any(len(p) + new > max_model_len for p in prompts):
        raise ValueError(f"every prompt plus {new} new tokens must fit max_model_len={max_model_len}, "
                         f"got prompt lengths {[len(p) for p in prompts]}")
    first = [_request(f"request-{i}", p, new) for i, p in enumerate(prompts)]
    follow = [dict(_request(f"follow-up-{i}", [198], new // 2), follow=f"request-{i}") for i in range(len(prompts))]
    llm = {"dtype": "float32", "max_model_len": max_model_len, "block_size": BLOCK_SIZE, "max_num_seqs": MAX_SEQS,
           "enforce_eager": True, "seed": 0, "max_num_batched_tokens": budget,
           "kv_cache_memory_bytes": pool_blocks * block_bytes(config)}
    return {"name": "serving", "llm": llm, "phases": [first, follow], "kvlib": {"token_budget": budget}}
