"""How the next token is picked: one validated `SamplingParams`, `probabilities` and `sample`.

``temperature=0`` is greedy (argmax). Otherwise the logits are divided by the
temperature, cut to the ``top_k`` largest and to the smallest set whose
probability reaches ``top_p`` (nucleus sampling), and sampled. `generate`,
`stream`, `generate_naive` and the paged `Engine` all take the same object (or
its fields as keyword arguments), so every loop samples the same way.
`probabilities` returns the distribution `sample` draws from (speculative sampling
compares the draft's and the target's), with greedy as its one-hot limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from .validate import int_at_least


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to pick each token; checked once, here.

    - max_new_tokens: how many tokens to generate at most (None: the caller must say).
    - temperature: 0 for greedy; larger flattens the distribution.
    - top_k, top_p: keep only the ``top_k`` most likely tokens / the smallest set
      reaching probability ``top_p``. None turns a cut off.
    - stop: token ids that end a sequence (the stop token is emitted, then it ends).
    - seed, generator: where the randomness comes from; give at most one.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> params = kvlib.SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=0)
    >>> out = kvlib.generate(model, [1, 2, 3], sampling=params)
    >>> torch.equal(out, kvlib.generate(model, [1, 2, 3], sampling=params))  # the same seed, the same tokens
    True
    >>> kvlib.SamplingParams(temperature=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: temperature must be a number >= 0 ...
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop: tuple[int, ...] = ()
    seed: int | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            int_at_least("max_new_tokens", self.max_new_tokens, 0)
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (t == 0 or 1e-6 <= t < math.inf):
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy; else finite, >= 1e-6), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {p!r}")
        object.__setattr__(self, "stop", _stop_ids(self.stop))
        if self.seed is not None and self.generator is not None:
            raise ValueError("give either seed or generator, not both")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(self.generator).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The generator to draw from: ``generator``, a fresh one seeded with ``seed``, or None (torch's global)."""
        if self.seed is None:
            return self.generator
        return torch.Generator(device=device).manual_seed(self.seed)

    def need_max_new_tokens(self) -> int:
        """``max_new_tokens``, which every generation loop needs."""
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens is required: say how many tokens to generate at most")
        return self.max_new_tokens


def _stop_ids(stop: int | Iterable[int] | None) -> tuple[int, ...]:
    if stop is None:
        return ()
    ids = (stop,) if isinstance(stop, int) and not isinstance(stop, bool) else tuple(stop)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"stop must be an int or an iterable of ints, got {stop!r}")
    return ids


def sampling_params(
    sampling: SamplingParams | None = None, max_new_tokens: int | None = None, **kwargs
) -> SamplingParams:
    """One `SamplingParams` from either an object or keyword arguments (the thin layer the loops share).

    ``max_new_tokens``, when given, overrides the object's. Unknown keywords raise ``TypeError``.
    """
    if sampling is None:
        return SamplingParams(max_new_tokens=max_new_tokens, **kwargs)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if kwargs:
        raise ValueError(f"pass either sampling=SamplingParams(...) or keyword arguments, not both: {sorted(kwargs)}")
    return sampling if max_new_tokens is None else replace(sampling, max_new_tokens=max_new_tokens)


def sample(
    logits: torch.Tensor,
    temperature: float | SamplingParams = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``(B, vocab)``; returns ``(B,)``.

    Pass the cuts as arguments, or one `SamplingParams` in place of ``temperature``.
    A ``generator`` argument wins over the params' own (a loop draws from one
    generator for all its steps); without one, the params' ``generator`` or ``seed`` is used.
    """
    if isinstance(temperature, SamplingParams):
        params = temperature
        if top_k is not None or top_p is not None:
            raise ValueError("pass top_k and top_p inside the SamplingParams, not beside it")
        if generator is None:
            generator = params.make_generator(logits.device)
    else:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return _sample(logits, params, generator)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: ``(..., vocab)`` logits -> float32 rows that sum to 1.

    Temperature, then ``top_k``, then ``top_p``, then softmax. Greedy (``temperature=0``)
    gives the one-hot of ``argmax``: the limit of the softmax as the temperature goes to 0.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {type(logits).__name__} {getattr(logits, 'dtype', '')}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (..., vocab) with vocab >= 1, got shape {tuple(logits.shape)}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1): the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= params.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if p.greedy:
        return logits.argmax(dim=-1)  # the one-hot's draw, without touching the generator
    return torch.multinomial(probabilities(logits, p), 1, generator=generator).squeeze(-1)
