"""FP8 KV cache: 8-bit floats (e4m3, vLLM's ``kv_cache_dtype="fp8"``) times an fp32 scale.

Where `kvlib.quant` rounds numbers onto an integer grid, e4m3 keeps a float's exponent: 1 sign, 4 exponent and 3
mantissa bits, with one fp32 scale per layer or per KV head. `FP8Cache` stores keys and values this way;
`quantize_fp8` and `fp8_scale` are the conversion. (Every name is importable from `kvlib.quant` too.)

**Host round-trips.** None. A scale must be positive and finite: one given as a number is checked as a number, one on
the CPU is read there, and a frozen scale is never checked again. A scale calibrated on an
accelerator is not read (that would stall the device): it is positive by construction, and
inf or NaN only if the prompt's keys were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import Cache, nbytes_of

# -- FP8: a float format instead of an integer grid ------------------------------------------------
FP8 = torch.float8_e4m3fn  # 1 sign, 4 exponent and 3 mantissa bits: vLLM's kv_cache_dtype="fp8"
FP8_MAX = float(torch.finfo(FP8).max)  # 448; e4m3 has no infinity, so larger numbers saturate here


@dataclass
class FP8Tensor:
    """Numbers stored as e4m3 floats times an fp32 scale: ``x̂ = data * scale``."""

    data: torch.Tensor  # float8_e4m3fn, the original shape
    scale: torch.Tensor  # fp32: shape () for one scale per tensor, (1, H, 1, 1) for one per head
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale).to(self.dtype)


def fp8_scale(x: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """``max|x| / 448``: the scale that puts ``x``'s largest magnitude on e4m3's largest number,
    over the whole tensor (shape ``()``) or over each head of a ``(B, H, S, D)`` tensor (``(1, H, 1, 1)``)."""
    if per_head and x.dim() != 4:
        raise ValueError(f"per-head scales need a (batch, heads, seq, head_dim) tensor, got shape {tuple(x.shape)}")
    amax = x.abs().amax(dim=(0, 2, 3), keepdim=True) if per_head else x.abs().amax()
    return (amax.float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero tensor: no 0 scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float | None = None, *, per_head: bool = False) -> FP8Tensor:
    """Round ``x / scale`` to the nearest e4m3 number, saturating at ±448 as vLLM's kernels do.

    A float keeps about two significant digits (3 mantissa bits: relative error at most
    1/16) over a wide range of magnitudes, so unlike an integer grid it needs no scale
    per token: ``scale`` only has to keep the numbers inside that range. ``None``
    computes one with `fp8_scale`.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == FP8:
        raise TypeError(f"quantize_fp8 needs a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8 needs a non-empty tensor, got shape {tuple(x.shape)}")
    if isinstance(scale, torch.Tensor) and scale.device.type == "cpu" or isinstance(scale, (int, float)):
        _check_scale(torch.as_tensor(scale, dtype=torch.float32))  # host values: free to read
    s = fp8_scale(x, per_head) if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if scale is None and s.device.type == "cpu":
        _check_scale(s)  # a calibrated scale is finite iff x is; read on the host only
    return _encode(x, s)


def _check_scale(s: torch.Tensor) -> None:
    """Scales on the host must be positive and finite. Never called on an accelerator's tensor: reading
    it would stall the device (see "Host round-trips"); a scale given as a number is checked as one."""
    if not bool(((s > 0) & s.isfinite()).all()):
        raise ValueError(f"an fp8 scale must be positive and finite, got {s.tolist()}")


def _encode(x: torch.Tensor, s: torch.Tensor) -> FP8Tensor:
    """``x / s`` rounded to e4m3, saturating at ±448; ``s`` already checked (or frozen after its check)."""
    data = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return FP8Tensor(data, s, x.dtype)


class FP8Cache(Cache):
    """Keys and values stored as e4m3 floats, with one fp32 scale per layer (or per KV head) for each.

    ``scale=None`` calibrates each scale on the first update (the prompt) and freezes
    it, as Hugging Face's ``QuantizedCache(backend="fp8")`` does; later numbers beyond
    that range saturate. A number fixes every scale (vLLM uses 1.0 unless the checkpoint
    or a calibration supplies scales). No residual window: every token is stored in FP8
    at once, so a token costs 1 byte per number and the scales are a few bytes per layer.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.quant.FP8Cache(model.config.n_layer)
    >>> logits = model(torch.arange(1, 41)[None], cache)
    >>> cache.nbytes  # 40 tokens x 2 (K, V) x 2 layers x 2 heads x 16 dims x 1 byte, and 4 fp32 scales
    5136
    """

    def __init__(self, n_layer: int, *, per_head: bool = False, scale: float | None = None) -> None:
        super().__init__(n_layer)
        if scale is not None and (not isinstance(scale, (int, float)) or not 0 < scale < float("inf")):
            raise ValueError(f"scale must be a positive number or None (calibrate), got {scale!r}")
        self.per_head, self.scale = per_head, scale
        self.reset()

    def reset(self) -> None:
        self.keys: list[FP8Tensor | None] = [None] * self.n_layer
        self.values: list[FP8Tensor | None] = [None] * self.n_layer

    def _append(self, old: FP8Tensor | None, x: torch.Tensor) -> FP8Tensor:
        if old is None:
            new = quantize_fp8(x, self.scale, per_head=self.per_head)  # new storage: data and scale
            self.count_written(new)
            return new
        codes = _encode(x, old.scale).data  # the frozen scale, checked when it was set: no read per step
        # Joined as bytes, a full copy: torch 2.5 (kvlib's floor) has no CPU cat for float8 ("cat_serial_kernel"
        # not implemented for 'Float8_e4m3fn'), and a view to uint8 and back moves no data on any torch.
        data = torch.cat([old.data.view(torch.uint8), codes.view(torch.uint8)], dim=2).view(FP8)  # (B, H, S + T, D)
        self.count_written(data)
        return FP8Tensor(data, old.scale, old.dtype)

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        self.keys[layer_idx] = self._append(self.keys[layer_idx], key_states)
        self.values[layer_idx] = self._append(self.values[layer_idx], value_states)
        return self.layer_kv(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys[layer_idx] is None else self.keys[layer_idx].data.shape[2]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    def crop(self, max_length: int) -> None:
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    # a copy (through its bytes: torch 2.5 copies float8 only that way), not a view of the old data
                    data = t.data[:, :, :keep].view(torch.uint8).clone().view(t.data.dtype)
                    self.count_written(data)
                    store[i] = FP8Tensor(data, t.scale, t.dtype)  # the scales stay

    def layer_kv(self, layer_idx):
        if self.keys[layer_idx] is None or self.get_seq_length(layer_idx) == 0:
            return None
        return self.keys[layer_idx].dequantize(), self.values[layer_idx].dequantize()
