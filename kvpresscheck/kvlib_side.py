"""The kvlib half of the press check: kvlib's presses, and the brute-force reference, on kvlib's model.

* `reference_runs`: each run through `kvpresscheck.reference` (scores, kept positions),
  then greedy tokens from a `DynamicCache` pruned to those positions (`greedy_after`).
* `kvlib_runs`: each run through `kvlib.press` (``PRESSES[name]()``, ``prefill(model, ids,
  press, ratio)``, ``cache.kept_positions(layer)``), its scores caught by wrapping the press's
  ``score`` method, then greedy tokens by `kvlib.generate.decode_step` on its own cache.

Each returns, per run name, ``{"kept": [layer][head] -> positions, "scores": [layer] ->
(H_kv, S) tensor or None, "tokens": [...], "seconds": ...}``, or ``{"error": ...}``.
"""

from __future__ import annotations

import time

import torch

from kvlib.cache import DynamicCache
from kvlib.generate import decode_step
from kvlib.model import Transformer
from . import reference as ref


@torch.inference_mode()
def greedy_after(model: Transformer, ids: torch.Tensor, kept: list[list[list[int]]], new_tokens: int) -> list[int]:
    """Prefill ``ids`` ``(1, S)`` whole, prune each layer's cache to ``kept[layer][head]``, and decode
    greedily ``new_tokens`` tokens (the first from the prefill's logits), at positions S, S + 1, ..."""
    S = ids.shape[1]
    cache = DynamicCache(model.config.n_layer)
    logits = model(ids, cache, last_only=True)[0, -1]
    for layer, heads in enumerate(kept):
        idx = torch.tensor(heads)[None, :, :, None]  # (1, H_kv, n_kept, 1): one row of positions per head
        idx = idx.expand(-1, -1, -1, cache.keys[layer].shape[-1])  # (1, H_kv, n_kept, D)
        cache.keys[layer] = cache.keys[layer].gather(2, idx)
        cache.values[layer] = cache.values[layer].gather(2, idx)
    tokens = [int(logits.argmax())]
    for i in range(new_tokens - 1):
        logits = model(torch.tensor([[tokens[-1]]]), cache, positions=torch.tensor([[S + i]]), last_only=True)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def reference_runs(model: Transformer, ids: list[int], runs: list[dict], new_tokens: int,
                   options: dict | None = None) -> dict[str, dict]:
    """Every run through the brute-force reference. ``options``: press name -> keyword arguments
    for `reference.scores`/`reference.kept` (to switch one choice, e.g. ``{"snapkv": {"pool": "max"}}``)."""
    x = torch.tensor([ids])
    states = ref.layer_states(model, x)
    out, memo = {}, {}
    for r in runs:
        p, ratio = r["press"], r["ratio"]
        opts = (options or {}).get(p, {})
        t0 = time.perf_counter()
        family = "snapkv" if p == "pyramidkv" else p  # PyramidKV scores as SnapKV does
        key = (family, ratio if p == "streaming_llm" else None, tuple(sorted(opts.items())))
        if key not in memo:
            memo[key] = ref.scores(p, states, ratio, model.config.rope_base, **opts)
        scores = memo[key]
        kept = ref.kept(p, scores, ratio, **opts)
        t1 = time.perf_counter()
        out[r["name"]] = {"kept": kept, "scores": scores, "tokens": greedy_after(model, x, kept, new_tokens),
                          "seconds": t1 - t0}
    return out


@torch.inference_mode()
def kvlib_runs(model: Transformer, ids: list[int], runs: list[dict], new_tokens: int,
               overrides: dict | None = None) -> dict[str, dict]:
    """Every run through `kvlib.press`; ``overrides``: press name -> constructor keyword arguments."""
    try:
        from kvlib import press as kp
    except ImportError as e:
        return {r["name"]: {"error": f"kvlib.press is not here: {e}"} for r in runs}
    x = torch.tensor([ids])
    out = {}
    for r in runs:
        press = kp.PRESSES[r["press"]](**(overrides or {}).get(r["press"], {}))
        seen: list[torch.Tensor] = []
        original = press.score

        def score(*args, _original=original, **kwargs):
            s = _original(*args, **kwargs)
            seen.append(s.detach()[0].float().clone())  # (H_kv, S)
            return s

        press.score = score  # on the instance: the class is left alone
        t0 = time.perf_counter()
        cache, logits = kp.prefill(model, x, press, r["ratio"])
        t1 = time.perf_counter()
        kept = [cache.kept_positions(layer)[0].tolist() for layer in range(model.config.n_layer)]
        tokens = [int(logits.reshape(-1, logits.shape[-1])[-1].argmax())]
        for _ in range(new_tokens - 1):
            tokens.append(int(decode_step(model, torch.tensor([tokens[-1]]), cache)[0].argmax()))
        out[r["name"]] = {"kept": kept, "scores": seen if len(seen) == model.config.n_layer else None,
                          "tokens": tokens, "seconds": t1 - t0}
    return out
