"""How good is a model on a text, and how often do two models agree?

``score(model, ids, chunk)`` cuts a long token sequence into chunks of
``chunk`` tokens and runs each chunk from an empty context. Inside a chunk,
position ``t`` predicts token ``t + 1``; the first token of each chunk is only
context. It returns, for every predicted position, the negative log-likelihood
of the true next token and the model's greedy choice. From those:

* ``perplexity = exp(mean NLL)``: lower is better;
* ``agreement(a, b)``: the fraction of positions where two models' greedy
  next tokens coincide, a direct measure of how much a change alters behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import Cache
from .model import Transformer
from .validate import int_at_least, positive_int


@dataclass
class Score:
    nll: torch.Tensor  # (M,) negative log-likelihood of each true next token, in nats
    greedy: torch.Tensor  # (M,) the model's argmax at each position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())


def score(
    model: Transformer,
    ids: torch.Tensor | list[int],
    chunk: int = 256,
    max_chunks: int | None = None,
    cache_factory: Callable[[int], Cache] | None = None,
    step: int = 16,
) -> Score:
    """Score ``ids`` in non-overlapping chunks of ``chunk`` tokens (a short tail is dropped).

    With ``cache_factory`` (``n_layer -> Cache``), each chunk is fed through a
    fresh cache ``step`` tokens at a time, the way a decode loop fills it: every
    piece attends to what the cache returns for the earlier pieces (quantized,
    say) and to itself. Without it, each chunk is one plain forward pass.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    int_at_least("chunk", chunk, 2)  # one context token and one to predict
    n = ids.numel() // chunk if max_chunks is None else min(ids.numel() // chunk, max_chunks)
    positive_int("step", step)
    if n == 0:
        raise ValueError(f"need at least one chunk of {chunk} tokens, got {ids.numel()} tokens")
    rows = ids[: n * chunk].view(n, chunk).to(model.device)  # (n, chunk)
    nll, greedy = [], []
    with torch.inference_mode():
        for row in rows:  # one chunk at a time: memory stays at one chunk's logits
            if cache_factory is None:
                logits = model(row[None]).float()[0, :-1]  # (chunk - 1, vocab): predictions for tokens 1..chunk-1
            else:
                cache = cache_factory(model.config.n_layer)
                pieces = [model(row[None, i:i + step], cache) for i in range(0, chunk, step)]  # (1, <=step, vocab) each
                logits = torch.cat(pieces, dim=1).float()[0, :-1]
            nll.append(F.cross_entropy(logits, row[1:], reduction="none"))
            greedy.append(logits.argmax(-1))
    return Score(torch.cat(nll).cpu(), torch.cat(greedy).cpu())


def agreement(a: Score, b: Score) -> float:
    """Fraction of positions where the two greedy next tokens are the same."""
    if a.greedy.shape != b.greedy.shape:
        raise ValueError(f"scores cover different positions: {tuple(a.greedy.shape)} vs {tuple(b.greedy.shape)}")
    return (a.greedy == b.greedy).double().mean().item()
