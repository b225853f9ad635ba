"""Growing a cache with ``torch.cat``: simple, and every step copies the whole cache.

`DynamicCache` is what most from-scratch code writes, and what Hugging Face's
``DynamicCache`` does (its ``DynamicLayer.update``, transformers 5.x).
"""

from __future__ import annotations

import torch

from .protocol import Cache, Legacy, _check_legacy, nbytes_of

class DynamicCache(Cache):
    """Appends with ``torch.cat``, the way most from-scratch code does, and so does
    Hugging Face's ``DynamicCache`` (its ``DynamicLayer.update``, transformers 5.x).

    Each update allocates a new ``(B, H, S + t, D)`` tensor and copies the old
    ``S`` tokens into it, so decoding N tokens copies O(N²) bytes in total.
    ``keys[layer]`` and ``values[layer]`` are the stored tensors (None while empty). The
    first update stores a copy too (as Hugging Face's does), never the caller's view.
    ``crop`` keeps views of the old tensors; the next update's ``torch.cat`` compacts them.

    Example

    >>> cache = kvlib.DynamicCache(n_layer=2)
    >>> k = torch.randn(1, 2, 3, 16)  # (B, H_kv, T, D): three tokens' keys
    >>> cache.update(k, k, layer_idx=0)[0].shape, cache.get_seq_length(0)
    (torch.Size([1, 2, 3, 16]), 3)
    >>> cache.update(k[:, :, :1], k[:, :, :1], layer_idx=0)[0].shape  # one more: a new, longer tensor
    torch.Size([1, 2, 4, 16])
    """

    def __init__(self, n_layer: int) -> None:
        super().__init__(n_layer)
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        layer = layer_idx
        if self.keys[layer] is None:  # a copy, never a view of the model's activations
            self.keys[layer], self.values[layer] = self.own(key_states), self.own(value_states)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], key_states], dim=2)  # (B, H, S + t, D): a full copy
            self.values[layer] = torch.cat([self.values[layer], value_states], dim=2)
            self.count_written(self.keys[layer], self.values[layer])  # old + new, every time
        return self.keys[layer], self.values[layer]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[2]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    def reset(self) -> None:
        self.keys = [None] * self.n_layer
        self.values = [None] * self.n_layer

    def crop(self, max_length: int) -> None:
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()  # empty: the next update may bring another batch size
        for layer in range(self.n_layer):
            if self.keys[layer] is not None and keep < self.keys[layer].shape[2]:
                # a copy, not a view: a view would keep the whole old tensor alive (and nbytes would not see it)
                self.keys[layer] = self.own(self.keys[layer][:, :, :keep])
                self.values[layer] = self.own(self.values[layer][:, :, :keep])

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        k = self.keys[layer_idx]
        return None if k is None else (k, self.values[layer_idx])

    @classmethod
    def from_legacy(cls, past: Legacy) -> "DynamicCache":
        _check_legacy(past)
        cache = cls(len(past))
        for layer, (k, v) in enumerate(past):
            cache.update(k, v, layer)
        return cache
