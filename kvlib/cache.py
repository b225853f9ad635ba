"""Where the keys and values live between decode steps.

Every cache speaks the protocol of Hugging Face's ``Cache``::

    keys, values = cache.update(layer, k, v)   # append, then return everything so far

``k`` and ``v`` are ``(batch, kv_heads, new_tokens, head_dim)``. The model
calls ``update`` once per layer per forward pass, in layer order, so
``cache.seq_len`` (the length of layer 0) is the position of the next token.

Two storage policies:

* `DynamicCache` grows with ``torch.cat``: simple, but every step copies the
  whole cache into a fresh tensor.
* `StaticCache` preallocates ``(batch, kv_heads, max_len, head_dim)`` per layer
  and writes new tokens in place. With ``grow=True`` it doubles its capacity
  when full instead of failing.
"""

from __future__ import annotations

import torch

from .config import ModelConfig

Legacy = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # ((k_0, v_0), (k_1, v_1), ...)


class Cache:
    """Base class: shared argument checks and the legacy tuple format."""

    def __init__(self, n_layer: int) -> None:
        if not isinstance(n_layer, int) or n_layer <= 0:
            raise ValueError(f"n_layer must be a positive int, got {n_layer!r}")
        self.n_layer = n_layer
        self.bytes_written = 0  # bytes this cache has copied into its storage, all layers, K and V
        # (batch, kv_heads, head_dim, dtype, device) that every update must match
        self._spec: tuple[int, int, int, torch.dtype, torch.device] | None = None

    # -- the protocol ---------------------------------------------------------
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def get_seq_len(self, layer: int = 0) -> int:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Tokens held (in layer 0, which is updated first in every forward)."""
        return self.get_seq_len(0)

    @property
    def nbytes(self) -> int:
        """Bytes of memory the cache holds for keys and values."""
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens; a negative ``n`` drops ``-n`` tokens from the end."""
        raise NotImplementedError

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The valid ``(keys, values)`` of one layer, or None if it is empty."""
        raise NotImplementedError

    # -- helpers shared by subclasses ----------------------------------------------
    def _check(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer!r} is out of range for a cache of {self.n_layer} layers")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError(f"k and v must be tensors, got {type(k).__name__} and {type(v).__name__}")
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"k and v must both be (batch, kv_heads, new_tokens, head_dim); got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype or k.device != v.device:
            raise TypeError(f"k and v differ: {k.dtype} on {k.device} vs {v.dtype} on {v.device}")
        if k.shape[2] == 0:
            raise ValueError(f"update with zero new tokens: k has shape {tuple(k.shape)}")
        if self._spec is None:
            self._spec = (k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device)
            return
        B, H, D, dtype, device = self._spec
        for what, want, got in (("batch", B, k.shape[0]), ("kv_heads", H, k.shape[1]), ("head_dim", D, k.shape[3])):
            if want != got:
                raise ValueError(
                    f"{type(self).__name__} holds {what}={want} but update(layer={layer}) got {what}={got} "
                    f"(k shape {tuple(k.shape)}, expected ({B}, {H}, T, {D}))"
                )
        if k.dtype != dtype:
            raise TypeError(f"{type(self).__name__} holds {dtype} but update(layer={layer}) got {k.dtype}")
        if k.device != device:
            raise TypeError(f"{type(self).__name__} lives on {device} but update(layer={layer}) got a tensor on {k.device}")

    def _crop_target(self, n: int) -> int:
        if not isinstance(n, int):
            raise TypeError(f"crop takes an int, got {type(n).__name__}")
        have = self.seq_len
        keep = n if n >= 0 else have + n
        if keep < 0:
            raise IndexError(f"cannot drop {-n} tokens from a cache that holds {have}")
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
        return f"{type(self).__name__}(n_layer={self.n_layer}, seq_len={self.seq_len}, nbytes={self.nbytes})"


def _check_legacy(past: Legacy) -> None:
    if not isinstance(past, (tuple, list)) or len(past) == 0:
        raise TypeError("past_key_values must be a non-empty tuple of (k, v) pairs, one per layer")
    for i, kv in enumerate(past):
        if not isinstance(kv, (tuple, list)) or len(kv) != 2:
            raise TypeError(f"past_key_values[{i}] must be a (k, v) pair, got {type(kv).__name__}")


class DynamicCache(Cache):
    """Appends with ``torch.cat``, the way most from-scratch code does.

    Each update allocates a new ``(B, H, S + t, D)`` tensor and copies the old
    ``S`` tokens into it, so decoding N tokens copies O(N²) bytes in total.
    """

    def __init__(self, n_layer: int) -> None:
        super().__init__(n_layer)
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(layer, k, v)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)  # (B, H, S + t, D): a full copy
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        self.bytes_written += self.keys[layer].nbytes + self.values[layer].nbytes  # old + new, every time
        return self.keys[layer], self.values[layer]

    def get_seq_len(self, layer: int = 0) -> int:
        k = self.keys[layer]
        return 0 if k is None else k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values if t is not None)

    def reset(self) -> None:
        self.keys = [None] * self.n_layer
        self.values = [None] * self.n_layer
        self._spec = None

    def crop(self, n: int) -> None:
        keep = self._crop_target(n)
        for layer in range(self.n_layer):
            if self.keys[layer] is not None:
                self.keys[layer] = self.keys[layer][:, :, :keep]
                self.values[layer] = self.values[layer][:, :, :keep]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        k = self.keys[layer]
        return None if k is None else (k, self.values[layer])

    @classmethod
    def from_legacy(cls, past: Legacy) -> "DynamicCache":
        _check_legacy(past)
        cache = cls(len(past))
        for layer, (k, v) in enumerate(past):
            cache.update(layer, k, v)
        return cache


class StaticCache(Cache):
    """Preallocated buffers, written in place, as in gpt-fast.

    Shape per layer: ``(batch, kv_heads, max_len, head_dim)``. ``update``
    writes the new tokens into the next free slots and returns a view of the
    filled prefix. Overflow raises ``IndexError`` unless ``grow=True``, in
    which case the capacity doubles (amortised O(1) copying per token).
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
        super().__init__(n_layer)
        for name, val in (("batch", batch), ("n_kv_head", n_kv_head), ("max_len", max_len), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"StaticCache {name} must be a positive int, got {val!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        shape = (batch, n_kv_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.lengths = [0] * n_layer  # filled slots per layer
        self.grow = grow
        probe = self.keys[0]
        self._spec = (batch, n_kv_head, head_dim, dtype, probe.device)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        grow: bool = False,
    ) -> "StaticCache":
        """A cache shaped for ``config``: its layers, KV heads and head_dim."""
        return cls(config.n_layer, batch, config.n_kv_head, max_len, config.head_dim, dtype=dtype, device=device, grow=grow)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _reserve(self, needed: int) -> None:
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for layer in range(self.n_layer):
            for buf in (self.keys, self.values):
                old = buf[layer]
                B, H, _, D = old.shape
                new = old.new_zeros(B, H, cap, D)
                new[:, :, : self.lengths[layer]] = old[:, :, : self.lengths[layer]]  # the one copy a doubling costs
                self.bytes_written += new[:, :, : self.lengths[layer]].nbytes
                buf[layer] = new

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(layer, k, v)
        start = self.lengths[layer]
        end = start + k.shape[2]
        if end > self.capacity:
            if not self.grow:
                raise IndexError(
                    f"StaticCache overflow in layer {layer}: {start} tokens cached + {k.shape[2]} new "
                    f"> max_len={self.capacity}; allocate a larger cache or pass grow=True"
                )
            self._reserve(end)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.bytes_written += k.nbytes + v.nbytes  # only the new tokens
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def get_seq_len(self, layer: int = 0) -> int:
        return self.lengths[layer]

    @property
    def nbytes(self) -> int:
        """Bytes allocated: the whole ``max_len`` capacity, used or not."""
        return sum(t.nbytes for t in self.keys + self.values)

    def reset(self) -> None:
        self.lengths = [0] * self.n_layer  # old contents are simply overwritten later

    def crop(self, n: int) -> None:
        keep = self._crop_target(n)
        self.lengths = [min(n_, keep) for n_ in self.lengths]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = self.lengths[layer]
        return None if n == 0 else (self.keys[layer][:, :, :n], self.values[layer][:, :, :n])

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
            cache.update(layer, k, v)
        return cache
