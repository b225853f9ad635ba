"""The kvpress half of the press check. It runs inside kvpress's own environment (``make kvpress``):

    .venv-kvpress/bin/python -m kvpresscheck.kvpress_side spec.json out.pt

It loads SmolLM2 in Hugging Face format (``LlamaForCausalLM``, fp32, its default ``sdpa``
attention), and for each run of the spec (`kvpresscheck.workload`) builds kvpress's
press with its defaults, prefills the passage inside ``with press(model):`` as kvpress's
own pipeline does, and then decodes greedily from the pruned ``DynamicCache`` with
explicit positions (``position_ids`` = passage length + step, as kvpress's
``generate_answer`` does: the cache is shorter than the text).

What kvpress keeps is read from the pruned cache itself, checked against the keys the
layer held before pruning (RoPE makes every position's key different), so the
positions are kvpress's, not a re-derivation. Its scores are
caught by wrapping the press's ``score`` method on the instance (every press here is a
``ScorerPress``, whose ``compress`` calls ``score`` once per layer). When the pruned keys
are exactly the pre-pruning keys gathered at ``scores.topk(n_kept)`` (kvpress's own
call), those are the kept positions; otherwise each kept key row is searched for
(`kept_rows`) and the run says its kept set is not the top-k of its scores.

Writes a ``torch.save`` file: the versions, and per run the kept positions and scores
per layer, ``(H_kv, n_kept)`` and ``(H_kv, S)``, the greedy tokens and the seconds.
Of kvlib it needs only `kvpresscheck.workload`, so it runs with kvpress's pinned
transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from .workload import DEFAULTS, KVPRESS_CLASS


def kept_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Which rows of ``before`` ``(B, H, S, D)`` each head kept in ``after`` ``(B, H, n, D)``:
    ``(B, H, n)`` ascending positions. Every kept row must match exactly one row of ``before``."""
    B, H, n, _ = after.shape
    out = torch.empty(B, H, n, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            same = (after[b, h, :, None, :] == before[b, h, None, :, :]).all(-1)  # (n, S)
            hits = same.sum(-1)
            if not bool((hits == 1).all()):
                raise RuntimeError(f"head {h}: {int((hits != 1).sum())} kept keys match no single earlier key")
            out[b, h] = same.long().argmax(-1).sort().values
    return out


def _with_recorder(press, store: dict):
    """Wrap ``press.score`` so each layer's scores and pre-pruning keys land in ``store[layer]``."""
    original = press.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = original(module, hidden_states, keys, values, attentions, kwargs)
        store[module.layer_idx] = {"scores": s.detach().clone(), "keys": keys.detach().clone()}
        return s

    press.score = score  # an instance attribute: the dataclass's own method is left alone
    return press


@torch.no_grad()
def run_one(model, ids: list[int], press_name: str, ratio: float, new_tokens: int) -> dict:
    import kvpress
    from transformers import DynamicCache

    cls = getattr(kvpress, KVPRESS_CLASS[press_name])
    press = cls(compression_ratio=ratio)
    params = {k: getattr(press, k) for k in DEFAULTS[press_name]}
    if params != DEFAULTS[press_name]:
        raise RuntimeError(f"{cls.__name__}'s defaults are {params}, the check expects {DEFAULTS[press_name]}")
    store: dict = {}
    _with_recorder(press, store)
    x = torch.tensor([ids])  # (1, S)
    S = x.shape[1]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model):
        out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
    t1 = time.perf_counter()
    tokens = [int(out.logits[0, -1].argmax())]
    for i in range(new_tokens - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[S + i]]))
        tokens.append(int(out.logits[0, -1].argmax()))
    t2 = time.perf_counter()

    kept, scores, topk_agrees = [], [], True
    for layer in range(len(cache.layers)):
        rec = store[layer]
        pruned = cache.layers[layer].keys[:, :, :-(new_tokens - 1)] if new_tokens > 1 else cache.layers[layer].keys
        # kvpress's own call on its own scores gives its order; the gather must give its pruned keys
        top = rec["scores"].topk(pruned.shape[2], dim=-1).indices  # (1, H_kv, n_kept)
        if torch.equal(rec["keys"].gather(2, top[..., None].expand(-1, -1, -1, pruned.shape[-1])), pruned):
            k = top[0].sort(-1).values  # (H_kv, n_kept)
        else:  # not the top-k of the scores seen: find every kept key among the earlier ones
            topk_agrees = False
            k = kept_rows(rec["keys"], pruned)[0]
        kept.append(k)
        scores.append(rec["scores"][0].float())  # (H_kv, S)
    return {"kept": kept, "scores": scores, "tokens": tokens, "params": params, "topk_agrees": topk_agrees,
            "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "seq_len": S}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    result = {"versions": {"kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                           "transformers": transformers.__version__, "torch": str(torch.__version__)},
              "attn_implementation": model.config._attn_implementation, "load_seconds": time.perf_counter() - t0,
              "runs": {}}
    for r in spec["runs"]:
        result["runs"][r["name"]] = run_one(model, spec["ids"], r["press"], r["ratio"], spec["new_tokens"])
    torch.save(result, argv[1])
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
