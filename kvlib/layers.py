"""What each layer's cache holds: the layer kinds of today's models.

Chapter 3's first cache had one tensor per layer, all of one shape, and for a Llama that
is the whole story. Many open models since mix kinds of layers, each with a cache of its
own size::

    full          every token so far                                 Llama, most layers of all
    window(W)     the W most recent tokens (the query's own included)  Mistral 7B v0.1, Gemma 2/3,
                  and optionally the first `sinks` tokens as well      gpt-oss (with sinks)
    chunked(C)    the tokens of the query's own chunk of C            Llama 4's local layers
    shared(i)     nothing new: this layer reads layer i's keys        CLA, YOCO, Character.AI,
                  and values                                          Gemma 3n
    latent(r)     one r-wide vector per token, not K and V            DeepSeek-V2/V3 (MLA)

A model's pattern is a tuple of these, one per layer (`ModelConfig.layers`; None means
every layer is full). `tokens_held` is what one layer stores after a text of ``n`` tokens,
and `visible` is the attention mask a kind implies; `kvlib.memory` sums the first over
layers and `kvlib.hybrid` runs the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validate import int_at_least, positive_int

KINDS = ("full", "window", "chunked", "shared", "latent")


@dataclass(frozen=True)
class LayerKind:
    """One layer's cache: its ``kind`` and the number that sizes it.

    ``size`` is the window W, the chunk C or the latent width r (0 for full and shared);
    ``sinks`` the first tokens a window layer keeps as well; ``source`` the earlier layer
    a shared layer reads (-1 otherwise). Build them with `full`, `window`, `chunked`,
    `shared` and `latent`, which check their arguments.

    Example

    >>> from kvlib.layers import full, repeat, tokens_held, window
    >>> [str(kind) for kind in repeat([window(4), full()], 4)]  # Gemma's pattern, in small
    ['window(4)', 'full', 'window(4)', 'full']
    >>> tokens_held(window(4), 10), tokens_held(full(), 10)  # after a 10-token text
    (4, 10)
    """

    kind: str
    size: int = 0
    sinks: int = 0
    source: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("size", "sinks", "source"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"LayerKind.{name} must be an int, got {type(v).__name__} ({v!r})")
        sized = self.kind in ("window", "chunked", "latent")
        if sized != (self.size > 0) or self.size < 0:
            raise ValueError(f"a {self.kind} layer needs size {'> 0' if sized else '0'}, got {self.size}")
        if self.sinks < 0 or (self.sinks and self.kind != "window"):
            raise ValueError(f"only a window layer keeps sinks (>= 0); got {self.sinks} on a {self.kind} layer")
        if (self.kind == "shared") != (self.source >= 0):
            raise ValueError(f"a shared layer names its source layer (>= 0), others none; got source={self.source}")

    def __str__(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "shared":
            return f"shared({self.source})"
        return f"{self.kind}({self.size}{f', sinks={self.sinks}' if self.sinks else ''})"


def full() -> LayerKind:
    """A layer that keeps every token."""
    return LayerKind("full")


def window(size: int, sinks: int = 0) -> LayerKind:
    """A sliding-window layer: a query sees the ``size`` most recent tokens, itself included,
    plus the first ``sinks`` tokens of the text."""
    return LayerKind("window", positive_int("size", size), int_at_least("sinks", sinks, 0))


def chunked(size: int) -> LayerKind:
    """Chunked attention: the text is cut into chunks of ``size`` and a query sees only the
    earlier tokens of its own chunk (Llama 4's local layers)."""
    return LayerKind("chunked", positive_int("size", size))


def shared(source: int) -> LayerKind:
    """A layer that computes no cache of its own: it attends to layer ``source``'s keys and values."""
    return LayerKind("shared", source=int_at_least("source", source, 0))


def latent(width: int) -> LayerKind:
    """An MLA layer: one ``width``-number latent per token stands for its keys and values."""
    return LayerKind("latent", positive_int("width", width))


def repeat(group: Sequence[LayerKind], n_layer: int) -> tuple[LayerKind, ...]:
    """``group`` repeated to ``n_layer`` layers (the last repetition cut short):
    ``repeat([window(512)] * 5 + [full()], 26)`` is Gemma 3 1B's 5:1 pattern."""
    positive_int("n_layer", n_layer)
    group = tuple(group)
    if not group:
        raise ValueError("repeat needs at least one layer kind")
    return tuple(group[i % len(group)] for i in range(n_layer))


def check_pattern(layers: Sequence[LayerKind], n_layer: int) -> tuple[LayerKind, ...]:
    """``layers`` as a tuple, if it is a valid pattern for ``n_layer`` layers; else a clear error.

    One kind per layer; a shared layer reads an earlier layer that keeps a cache of its own
    (sharing is not chained, as in CLA and YOCO)."""
    layers = tuple(layers)
    for i, kind in enumerate(layers):
        if not isinstance(kind, LayerKind):
            raise TypeError(f"layer {i}'s kind must be a LayerKind (kvlib.layers.full(), window(W), ...), "
                            f"got {type(kind).__name__}")
    if len(layers) != n_layer:
        raise ValueError(f"the pattern names {len(layers)} layers for a model of {n_layer}")
    for i, kind in enumerate(layers):
        if kind.kind == "shared":
            if kind.source >= i:
                raise ValueError(f"layer {i} shares layer {kind.source}'s cache: it must be an earlier layer")
            if layers[kind.source].kind == "shared":
                raise ValueError(f"layer {i} shares layer {kind.source}, which is itself shared: "
                                 f"name the layer that keeps the cache")
    return layers


def tokens_held(kind: LayerKind, n: int) -> int:
    """Tokens one layer of ``kind`` stores after a text of ``n`` tokens (shared: 0, it stores none).

    It is what the text's last query attended to, its own key included: a window keeps
    ``min(n, W)`` plus its sinks while they lie outside the window; a chunked layer keeps the
    tokens of the last token's chunk (at most C: a cache sized for the worst case holds C).
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind must be a LayerKind, got {type(kind).__name__}")
    int_at_least("n", n, 0)
    if kind.kind in ("full", "latent"):
        return n
    if kind.kind == "shared":
        return 0
    if kind.kind == "window":
        return min(n, kind.size + kind.sinks)
    return 0 if n == 0 else (n - 1) % kind.size + 1  # chunked: the last chunk's tokens


def visible(kind: LayerKind, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see in a layer of ``kind``: bool ``(T, S)`` for query positions
    ``q_pos`` ``(T,)`` and key positions ``k_pos`` ``(S,)`` (True = may attend).

    Causal for every kind (``k <= q``), and besides: a window sees ``k > q - W`` or ``k < sinks``;
    a chunk sees ``k // C == q // C``. A shared layer's mask is its source's: pass that kind.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind must be a LayerKind, got {type(kind).__name__}")
    if kind.kind == "shared":
        raise ValueError("a shared layer attends as its source layer does: pass the source's kind")
    q, k = q_pos[:, None], k_pos[None, :]  # (T, 1), (1, S)
    seen = k <= q
    if kind.kind == "window":
        seen = seen & ((k > q - kind.size) | (k < kind.sinks))
    elif kind.kind == "chunked":
        seen = seen & (k // kind.size == q // kind.size)
    return seen
