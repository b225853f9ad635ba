"""A preallocated cache: ``(batch, kv_heads, max_len, head_dim)`` per layer, written in place.

`StaticCache` writes new tokens into the next free slots; with ``grow=True`` it doubles
its capacity when full instead of failing (amortised O(1) copying per token).
"""

from __future__ import annotations

import torch

from ..validate import positive_int
from .protocol import Cache, CacheSpec, Legacy, _check_legacy, check_uniform, model_layout, nbytes_of

class StaticCache(Cache):
    """Preallocated buffers, written in place, as in gpt-fast and Hugging Face's ``StaticCache``.

    Fixed shapes and fixed storage addresses are what ``torch.compile`` and CUDA graphs
    need to replay a decode step without recompiling; a ``torch.cat`` cache changes both.

    Shape per layer: ``(batch, kv_heads, max_len, head_dim)``, in ``keys[layer]``
    and ``values[layer]``. ``update`` writes the new tokens into the next free
    slots and returns a view of the filled prefix. Overflow raises ``IndexError``
    unless ``grow=True``, in which case the capacity doubles (amortised O(1)
    copying per token).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.StaticCache.for_model(model.config, batch=1, max_len=16)
    >>> cache.nbytes  # allocated up front: 2 (K, V) x 2 layers x 2 heads x 16 slots x 16 dims x 4 bytes
    8192
    >>> logits = model(torch.tensor([[1, 2, 3]]), cache)
    >>> cache.seq_len, cache.capacity
    (3, 16)
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        grow: bool = False,
    ) -> None:
        for name, val in (("batch", batch), ("n_kv_head", n_kv_head), ("max_len", max_len), ("head_dim", head_dim)):
            positive_int(f"StaticCache {name}", val)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        shape = (batch, n_kv_head, max_len, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(positive_int("n_layer", n_layer))]
        super().__init__(n_layer, CacheSpec(batch, n_kv_head, head_dim, dtype, keys[0].device))  # allocated: fixed
        self.keys = keys
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.lengths = [0] * n_layer  # filled slots per layer
        self.grow = grow

    @classmethod
    def for_model(
        cls,
        model_or_config: object,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        grow: bool = False,
    ) -> "StaticCache":
        """A cache shaped for a `kvlib.Transformer` or a `kvlib.ModelConfig`: its layers, KV heads
        and head_dim, in the model's dtype and on its device unless ``dtype``/``device`` say
        otherwise (a config has neither: fp32 on the CPU)."""
        config, dtype, device = model_layout(model_or_config, dtype, device)
        check_uniform(config, cls.__name__)
        return cls(config.n_layer, batch, config.n_kv_head, max_len, config.head_dim, dtype=dtype, device=device,
                   grow=grow)

    @property
    def capacity(self) -> int:
        """Slots per layer (layer 0's: with ``grow=True`` every layer doubles on its own update)."""
        return self.keys[0].shape[2]

    def _reserve(self, layer: int, needed: int) -> None:
        """Double ``layer``'s capacity until it holds ``needed`` tokens (each layer grows on its own update)."""
        cap = self.keys[layer].shape[2]
        while cap < needed:
            cap *= 2
        n = self.lengths[layer]
        for buf in (self.keys, self.values):
            old = buf[layer]
            B, H, _, D = old.shape
            new = old.new_empty(B, H, cap, D)  # not zeroed: slots past the length are never read
            new[:, :, :n] = old[:, :, :n]  # the one copy a doubling costs
            self.count_written(new[:, :, :n])
            buf[layer] = new

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        layer, T = layer_idx, key_states.shape[2]
        start = self.lengths[layer]
        end = start + T
        if end > self.keys[layer].shape[2]:
            if not self.grow:
                raise IndexError(
                    f"StaticCache overflow in layer {layer}: {start} tokens cached + {T} new "
                    f"> max_len={self.capacity}; allocate a larger cache or pass grow=True"
                )
            self._reserve(layer, end)
        self.keys[layer][:, :, start:end] = key_states
        self.values[layer][:, :, start:end] = value_states
        self.count_written(key_states, value_states)  # only the new tokens
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes allocated: the whole ``max_len`` capacity, used or not."""
        return nbytes_of(self.keys, self.values)

    def reset(self) -> None:
        self.lengths = [0] * self.n_layer  # old contents are simply overwritten later

    def crop(self, max_length: int) -> None:
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()
        self.lengths = [min(n_, keep) for n_ in self.lengths]

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = self.lengths[layer_idx]
        return None if n == 0 else (self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n])

    @classmethod
    def from_legacy(cls, past: Legacy, max_len: int | None = None, *, grow: bool = False) -> "StaticCache":
        """Copy legacy tuples into a new preallocated cache of ``max_len`` slots (default: just enough)."""
        _check_legacy(past)
        k0 = past[0][0]
        if not isinstance(k0, torch.Tensor) or k0.dim() != 4:
            raise ValueError("legacy keys must be (batch, kv_heads, seq, head_dim) tensors")
        B, H, S, D = k0.shape
        max_len = S if max_len is None else max_len
        cache = cls(len(past), B, H, max_len, D, dtype=k0.dtype, device=k0.device, grow=grow)
        for layer, (k, v) in enumerate(past):
            cache.update(k, v, layer)
        return cache
