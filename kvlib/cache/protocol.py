"""The cache protocol: what every kvlib cache does, and the bookkeeping they share.

Every cache speaks the protocol of Hugging Face's ``Cache`` (transformers 5.x)::

    keys, values = cache.update(key_states, value_states, layer_idx)  # append, return all
    cache.get_seq_length()                                            # tokens held (layer 0)
    cache.crop(n); cache.reset()

HF's ``update`` takes the same three arguments first, then extras (a ``cache_kwargs``
dict in transformers 4.x, ``**kwargs`` in 5.x) that kvlib does not need.
``key_states`` and ``value_states`` are ``(batch, kv_heads, new_tokens, head_dim)``. The model
calls ``update`` once per layer per forward pass, in layer order.

A cache's length has two names, one meaning each:

* ``cache.tokens_seen``: tokens of text the cache has been given, so the index in the text of the
  next token (and, for every cache but `kvlib.evict.SinkCache`, its RoPE position);
* ``cache.tokens_held`` (also ``cache.seq_len`` and ``get_seq_length(0)``): what layer 0 stores.

They are equal until a cache evicts (`kvlib.evict`, a `kvlib.hybrid.HybridCache` with window or
chunked layers, `kvlib.press.PressCache`): then ``tokens_held`` stays at the budget while
``tokens_seen`` counts on. Hugging Face's sliding-window layers report tokens seen from
``get_seq_length``; kvlib's ``get_seq_length`` keeps meaning "held", and ``crop(n)`` takes a length of
*text* (``n <= tokens_seen``), refusing when the tokens it would have to keep are already evicted.

A cache also says *where* a step's tokens sit and *what they may see*:
``cache.positions(tokens)`` gives their RoPE positions and ``cache.mask(tokens)``
their attention mask (None: plain bottom-right causal). The defaults below
continue after what the cache holds; caches that lay keys out their own way
(`kvlib.padding.PaddedBatch`, `kvlib.paged.PagedBatch`) override them, so
``model(tokens, cache)`` is right with no extra arguments.
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass

import torch

from ..attention import attend
from ..config import ModelConfig
from ..validate import positive_int

#: The legacy cache format: one ``(keys, values)`` pair per layer, as old Hugging Face code passes it.
Legacy = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # ((k_0, v_0), (k_1, v_1), ...)


@dataclass(frozen=True)
class CacheSpec:
    """What every ``update`` of one cache must match: keys ``(batch, kv_heads, T, head_dim)``,
    values ``(batch, kv_heads, T, value_dim)`` (``value_dim=None``: as wide as the keys), one
    dtype, one device. Fixed by the constructor (a preallocated cache) or by the first update."""

    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    value_dim: int | None = None  # MLA's latent cache stores values of another width

    @property
    def value_width(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim


def model_layout(
    model_or_config: object, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[ModelConfig, torch.dtype, torch.device]:
    """What every ``for_model`` needs: ``(config, dtype, device)`` of a `kvlib.Transformer` or a
    `kvlib.ModelConfig`. ``dtype``/``device`` default to the model's (a config has none: fp32 on
    the CPU, as a fresh `kvlib.Transformer` is), so a cache built this way matches its model."""
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"for_model takes a kvlib.Transformer or a kvlib.ModelConfig, got "
                        f"{type(model_or_config).__name__}")
    is_model = config is not model_or_config
    if dtype is None:
        dtype = model_or_config.dtype if is_model else torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (torch.float32, torch.bfloat16 ...), got {dtype!r}")
    if device is None:
        device = model_or_config.device if is_model else torch.device("cpu")
    return config, dtype, torch.device(device)


def check_uniform(config: ModelConfig, name: str) -> None:
    """A ``ValueError`` if ``config``'s layers differ (a hybrid model), which a cache that treats
    every layer alike cannot serve: such a model runs with `kvlib.hybrid.HybridCache`."""
    if config.hybrid:
        kinds = ", ".join(sorted({str(k) for k in config.layer_kinds()}))
        raise ValueError(f"{name} keeps every layer alike, but this model's layers differ ({kinds}): use "
                         f"kvlib.hybrid.HybridCache.for_model(model)")


def nbytes_of(*stores: object) -> int:
    """Bytes of every tensor (or object with ``nbytes``, like `kvlib.quant.QTensor`) in
    ``stores``: tensors, None (skipped), and lists or tuples of them, as caches hold them."""
    total = 0
    for x in stores:
        if x is None:
            continue
        if isinstance(x, (list, tuple)):
            total += nbytes_of(*x)
        else:
            total += x.nbytes
    return total


class Cache(abc.ABC):
    """The protocol every kvlib cache follows, and the bookkeeping every cache shares.

    To write your own cache, call ``super().__init__(n_layer)`` in ``__init__`` and
    implement the six abstract members: ``update``, ``get_seq_length(layer_idx=0)``
    (keep the default), ``nbytes`` (a ``@property``), ``reset``, ``crop`` and ``layer_kv``.
    Start ``update`` with ``self.validate_update(k, v, layer_idx)`` (shapes, dtype, device,
    layer index, consistency with earlier updates), and ``crop`` with
    ``keep = self.crop_length(n)``. Then run `kvlib.check.check_cache` on it.

    The contract of the numbers a learner measures with:

    * ``nbytes`` is every byte of storage the cache holds for its keys and values (their
      scales and minimums included), each storage counted once; bookkeeping tensors kept
      beside them (positions, scores) are named in ``beside_kv`` and left out. Store a
      *copy* of what an update gives you (`own`): the model's keys are often views into a
      larger activation (the fused projection), and keeping a view keeps all of it alive.
    * ``bytes_written`` is the bytes the cache has really written into its storage, all
      layers, keys and values, re-copies included (a ``torch.cat`` rewrites the whole
      cache). Report each write with `count_written` (`own` does it for you).
    * ``spec`` is what every update must match. A cache that allocates for one shape
      passes it to ``__init__`` and it never changes; otherwise the first update into an
      empty cache sets it, so after ``reset`` (or ``crop(0)``) a new batch size is fine.

    How it differs from Hugging Face's ``Cache``: the argument order and names of
    ``update(key_states, value_states, layer_idx)``, ``get_seq_length``, ``crop``
    and ``reset`` are the same. kvlib's ``update`` takes no ``cache_kwargs`` dict
    (RoPE is applied before the cache, and positions come from ``positions``), it
    returns only the valid keys (never a padded static buffer), and the per-step
    ``positions``/``mask`` stand where HF passes ``cache_position`` and builds
    masks from ``get_mask_sizes``.
    """

    same_width = True  # keys and values are equally wide; a cache that stores two widths says False
    evicts = False  # True for a cache that may drop tokens it was given (a budget, a window, a press)
    beside_kv: tuple[str, ...] = ()  # attributes holding tensors kept beside K/V (positions, scores),
    # which nbytes and bytes_written leave out; `kvlib.check.storage_bytes` skips them too

    def __init__(self, n_layer: int, spec: CacheSpec | None = None) -> None:
        self.n_layer = positive_int("n_layer", n_layer)
        self.bytes_written = 0  # bytes this cache has written into its storage, all layers, K and V
        if spec is not None and not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a CacheSpec or None, got {type(spec).__name__}")
        self._spec = spec  # what updates must match
        self._spec_fixed = spec is not None  # given by the constructor: never re-derived

    @classmethod
    def for_model(cls, model_or_config: object, *args, **kwargs) -> "Cache":
        """A cache for a `kvlib.Transformer` or a `kvlib.ModelConfig`: one layer per model layer,
        then the class's own settings, ``cls(config.n_layer, *args, **kwargs)``. A class that takes
        ``rope_base`` (`kvlib.evict.SinkCache`, `kvlib.press.PressCache`) gets the model's unless
        given one.

        This cache makes its tensors at the first ``update``, from the K/V the model writes, so it
        takes the model's dtype and device with nothing to pass. Caches that allocate up front
        (`StaticCache`, `kvlib.paged.PagedCache`) take ``dtype`` and ``device`` here, the model's by
        default.

        >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
        >>> kvlib.evict.WindowCache.for_model(model, 16).n_layer == model.config.n_layer
        True
        """
        config, _, _ = model_layout(model_or_config)
        check_uniform(config, cls.__name__)
        params = inspect.signature(cls.__init__).parameters
        for name in ("dtype", "device"):
            if name in kwargs and name not in params:
                raise TypeError(f"{cls.__name__}.for_model takes no {name}: the cache makes its tensors at the "
                                f"first update, in the dtype and on the device of the K/V the model writes. Move the "
                                f"model (model.to(...)), or store another dtype with kvlib.quant.CastCache")
        if "rope_base" in params and "rope_base" not in inspect.signature(cls).bind_partial(
                config.n_layer, *args, **kwargs).arguments:
            kwargs["rope_base"] = config.rope_base
        return cls(config.n_layer, *args, **kwargs)

    # -- the protocol: what a subclass implements -------------------------------------------------
    @abc.abstractmethod
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H_kv, T, D)`` keys and values to ``layer_idx``; return all of that layer's keys and values."""

    @abc.abstractmethod
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held in ``layer_idx``."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of storage the cache holds for keys and values (see the class docstring)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every token (the storage may be kept for reuse)."""

    @abc.abstractmethod
    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens of the text; a negative value drops ``-max_length`` tokens
        from the end. ``crop(0)`` empties the cache, as `reset` does."""

    @abc.abstractmethod
    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The valid ``(keys, values)`` of one layer, or None if it is empty."""

    # -- where a step's tokens sit and what they may see -------------------------------------------
    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` RoPE positions of a step's new ``tokens`` ``(B, T)``: right after what is cached."""
        past, (B, T) = self.tokens_seen, tokens.shape
        return torch.arange(past, past + T, device=tokens.device).expand(B, T)

    def position_end(self, new_tokens: int) -> int:
        """One past the largest RoPE position the next ``new_tokens`` tokens take: what a model's
        ``max_seq_len`` must cover. ``tokens_seen + new_tokens`` unless positions count slots in the
        cache (`kvlib.evict.SinkCache`)."""
        return self.tokens_seen + new_tokens

    def mask(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The step's attention mask ``(B or 1, 1, T, past + T)``, True = may attend.

        None means "bottom-right causal over everything held, nothing padded", which
        lets `kvlib.attention.attend` take SDPA's fastest path.
        """
        return None

    def layer_mask(self, layer_idx: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask layer ``layer_idx`` attends with, given the step's ``mask``, right after its
        ``update``: the step's mask itself, unless the cache gives its layers keys of their own
        shapes (`kvlib.hybrid.HybridCache`: a window layer's band over what it holds)."""
        return mask

    def update_and_attend(self, q: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                          layer_idx: int, mask: torch.Tensor | None, impl: object = "sdpa") -> torch.Tensor:
        """One layer's attention over this cache: store the step's keys, then attend. ``(B, H, T, D)``.

        The model calls this once per layer (``q`` ``(B, H, T, D)``, the step's new keys and
        values ``(B, H_kv, T, D)``, the step's ``mask`` and the layer's kernel ``impl``). By
        default it is `update`, `layer_mask` and `kvlib.attention.attend`, so a cache that
        only stores keys needs nothing else. A cache that knows a faster way to attend over
        what it holds overrides it, as vLLM's attention backends do: a packed paged step
        (`kvlib.paged.PackedPagedBatch`) attends sequence by sequence, never across two.
        """
        k, v = self.update(key_states, value_states, layer_idx)  # (B, H_kv, S, D)
        return attend(q, k, v, self.layer_mask(layer_idx, mask), impl)

    # -- helpers for subclasses -------------------------------------------------------------------
    @property
    def tokens_held(self) -> int:
        """Tokens stored in layer 0 (updated first in every forward): at most the budget of a cache that evicts."""
        return self.get_seq_length(0)

    @property
    def seq_len(self) -> int:
        """Tokens held, as `tokens_held` (kept for Hugging Face's and earlier kvlib's name)."""
        return self.tokens_held

    @property
    def tokens_seen(self) -> int:
        """Tokens of text given to the cache so far, evicted or not: the next token's index in the text.
        Equal to `tokens_held` for a cache that keeps everything; a cache that evicts overrides it."""
        return self.tokens_held

    @property
    def spec(self) -> CacheSpec | None:
        """What every update must match; None while an empty cache has no fixed shape."""
        if not self._spec_fixed and self._empty():
            return None
        return self._spec

    def _empty(self) -> bool:
        return all(self.get_seq_length(layer) == 0 for layer in range(self.n_layer))

    def count_written(self, *tensors: torch.Tensor) -> None:
        """Add the bytes of ``tensors`` (what this step wrote into storage) to `bytes_written`."""
        self.bytes_written += nbytes_of(*tensors)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in storage of its own, counted in `bytes_written`.

        An update's keys are often a view into the model's activations (a slice of the
        fused QKV projection): storing the view would keep the whole activation alive.
        """
        copy = t.clone(memory_format=torch.contiguous_format)
        self.count_written(copy)
        return copy

    def check_layer(self, layer_idx: object) -> int:
        """``layer_idx`` if it is an int in ``[0, n_layer)``; else ``IndexError`` (``TypeError`` for a non-int)."""
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
            raise TypeError(
                f"layer_idx must be an int, got {type(layer_idx).__name__}; kvlib 0.2 follows Hugging Face's "
                f"argument order: update(key_states, value_states, layer_idx)"
            )
        if not 0 <= layer_idx < self.n_layer:
            raise IndexError(f"layer {layer_idx} is out of range for a cache of {self.n_layer} layers")
        return layer_idx

    def validate_update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> None:
        """Check one ``update``'s arguments against `spec`; an empty cache's first update sets it."""
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            hint = " (the layer index goes last: update(k, v, layer_idx))" if isinstance(k, int) else ""
            raise TypeError(f"k and v must be tensors, got {type(k).__name__} and {type(v).__name__}{hint}")
        self.check_layer(layer_idx)
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or (self.same_width and k.shape != v.shape):
            want = "the same (batch, kv_heads, new_tokens)" if not self.same_width else "(batch, kv_heads, new_tokens, head_dim)"
            raise ValueError(f"k and v must both be {want}; got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise TypeError(f"k and v differ: {k.dtype} on {k.device} vs {v.dtype} on {v.device}")
        if k.shape[2] == 0:
            raise ValueError(f"update with zero new tokens: k has shape {tuple(k.shape)}")
        s = self.spec
        if s is None:
            value_dim = None if self.same_width else v.shape[3]
            self._spec = CacheSpec(k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device, value_dim)
            return
        for what, want, got in (("batch", s.batch, k.shape[0]), ("kv_heads", s.kv_heads, k.shape[1]),
                                ("head_dim", s.head_dim, k.shape[3]), ("value width", s.value_width, v.shape[3])):
            if want != got:
                raise ValueError(
                    f"{type(self).__name__} holds {what}={want} but update(layer={layer_idx}) got {what}={got} "
                    f"(k shape {tuple(k.shape)}, expected ({s.batch}, {s.kv_heads}, T, {s.head_dim}))"
                )
        if k.dtype != s.dtype:
            raise TypeError(f"{type(self).__name__} holds {s.dtype} but update(layer={layer_idx}) got {k.dtype}")
        if k.device != s.device:
            raise TypeError(
                f"{type(self).__name__} lives on {s.device} but update(layer={layer_idx}) got a tensor on {k.device}"
            )

    def crop_length(self, max_length: int) -> int:
        """How many tokens of text ``crop(max_length)`` keeps: ``max_length`` (at most `tokens_seen`),
        or ``tokens_seen + max_length`` if negative."""
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"crop takes an int, got {type(max_length).__name__}")
        have = self.tokens_seen
        keep = max_length if max_length >= 0 else have + max_length
        if keep < 0:
            raise IndexError(f"cannot drop {-max_length} tokens from a cache that has seen {have}")
        return min(keep, have)

    def to_legacy(self) -> Legacy:
        """The old ``past_key_values`` format: a tuple of ``(k, v)`` per layer."""
        out = []
        for layer in range(self.n_layer):
            kv = self.layer_kv(layer)
            if kv is None:
                raise ValueError(f"layer {layer} is empty; only a filled cache has a legacy form")
            out.append(kv)
        return tuple(out)

    def __repr__(self) -> str:
        seen = f", tokens_seen={self.tokens_seen}" if self.tokens_seen != self.tokens_held else ""
        return f"{type(self).__name__}(n_layer={self.n_layer}, seq_len={self.seq_len}{seen}, nbytes={self.nbytes})"


def _check_legacy(past: Legacy) -> None:
    if not isinstance(past, (tuple, list)) or len(past) == 0:
        raise TypeError("past_key_values must be a non-empty tuple of (k, v) pairs, one per layer")
    for i, kv in enumerate(past):
        if not isinstance(kv, (tuple, list)) or len(kv) != 2:
            raise TypeError(f"past_key_values[{i}] must be a (k, v) pair, got {type(kv).__name__}")
