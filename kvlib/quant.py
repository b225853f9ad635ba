"""Quantizing the KV cache: fewer bits per number, plus a scale per group.

Asymmetric ``b``-bit quantization of a group of numbers with minimum ``m`` and
maximum ``M`` stores::

    s = (M - m) / (2^b - 1)            scale, one per group
    q = round((x - m) / s)  in [0, 2^b - 1]
    x̂ = q * s + m                      |x - x̂| <= s / 2

Symmetric quantization drops ``m``: ``s = max|x| / (2^(b-1) - 1)``,
``q = round(x / s)``, ``x̂ = q * s``, with the same ``s / 2`` bound.

Which numbers share a scale is the **granularity**. The cache is
``(B, H, S, D)``: *per-token* scales reduce over the channels ``D`` of one
token; *per-channel* scales reduce over the tokens ``S`` of one channel;
``group_size`` splits that axis into groups. KIVI (Liu et al., 2024) quantizes
keys per channel (a few key channels carry large outliers) and values per
token, and keeps the newest tokens in full precision.

Scales and minimums are stored in fp16 (fp32 where a tensor's pass fp16's 65,504) and counted
in ``nbytes``. 4-bit and 2-bit codes are packed two and four to a byte.

**Host round-trips.** None in a decode step. Two checks read values: that the input is finite, and whether a
tensor's scales fit fp16 (else they stay fp32). On the CPU they read host memory and run as
they always have. On an accelerator reading them would stall the device at every flush, so
there `quantize` queues them as device-side assertions (``torch._assert_async``): no wait,
and an input that holds inf or NaN, or a spread past fp16's ±65,504 (scales stay fp16 there),
stops the program at the device's next synchronization with CUDA's "device-side assert
triggered" instead of a ValueError. It never gives a wrong cache silently.

`FP8Cache` stores 8-bit floats instead (e4m3, vLLM's ``kv_cache_dtype="fp8"``),
with one fp32 scale per layer or per KV head. (`kvlib.hf.HFQuantizedCache` runs
Hugging Face's own ``QuantizedCache`` under a kvlib model, for comparison.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import Cache, DynamicCache, nbytes_of
from .validate import int_at_least, positive_int

BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``q`` (uint8, each < 2^bits) along the last dim: ``8 / bits`` codes per byte."""
    _check_bits(bits)
    per = 8 // bits
    if q.shape[-1] % per:
        raise ValueError(f"the last dim ({q.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    if per == 1:
        return q.to(torch.uint8)
    q = q.to(torch.uint8).reshape(*q.shape[:-1], q.shape[-1] // per, per)  # (..., n/per, per)
    shifts = torch.arange(per, dtype=torch.uint8, device=q.device) * bits  # code i goes to bits [i*b, (i+1)*b)
    return (q << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: the sum is an OR


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: ``(..., n / per)`` bytes -> ``(..., n)`` uint8 codes."""
    _check_bits(bits)
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    q = (packed[..., None] >> shifts) & (2**bits - 1)  # (..., n/per, per)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16, nudged up where rounding went down: a stored scale must not shrink."""
    h = x.to(torch.float16)
    low = h.float() < x
    return torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _fp16_at_most(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    high = h.float() > x
    return torch.where(high, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _finite(*xs: torch.Tensor | None) -> bool:
    """True unless a tensor holds inf or NaN. It reads the tensors, so it runs on host values only:
    on an accelerator it would stall the device at every flush (see "Host round-trips")."""
    return all(bool(x.isfinite().all()) for x in xs if x is not None)  # in fp16: nothing past ±65,504


def _on_host(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


@dataclass
class QTensor:
    """A quantized tensor: packed codes plus fp16 scales (and minimums, if asymmetric)."""

    codes: torch.Tensor  # uint8, packed along the (moved-last) reduced axis
    scale: torch.Tensor  # fp16 (fp32 if any overflows fp16), one per group
    minimum: torch.Tensor | None  # like scale, one per group; None when symmetric
    bits: int
    dim: int  # the axis whose elements share a scale (-1: per token, -2: per channel)
    shape: tuple[int, ...]  # the original shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimum is None else self.minimum.nbytes
        return self.codes.nbytes + self.scale.nbytes + extra

    def dequantize(self) -> torch.Tensor:
        q = unpack_codes(self.codes, self.bits).float()  # (..., groups, group_size)
        s = self.scale.float()[..., None]
        if self.minimum is None:
            x = (q - 2 ** (self.bits - 1)) * s
        else:
            x = q * s + self.minimum.float()[..., None]
        moved = list(self.shape)
        moved.append(moved.pop(self.dim))  # the reduced axis was moved last
        x = x.reshape(moved)
        return x.movedim(-1, self.dim).to(self.dtype)


def quantize(
    x: torch.Tensor, bits: int, dim: int = -1, group_size: int | None = None, symmetric: bool = False
) -> QTensor:
    """Quantize ``x`` with one scale per ``group_size`` consecutive elements along ``dim``.

    ``dim=-1`` on a ``(B, H, S, D)`` cache is per-token, ``dim=-2`` per-channel;
    ``group_size=None`` shares one scale across the whole axis.

    Scales and minimums are computed in fp32 and stored in fp16, rounded outward, unless one of
    them is past fp16's ±65,504: then the tensor's stay fp32 (4 bytes each in ``nbytes``). That
    check, and the one for inf or NaN, read values on the CPU; on an accelerator they are
    device-side assertions, and scales stay fp16 (module docstring, "Host round-trips").
    """
    _check_bits(bits)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor with at least one dim, got shape {tuple(x.shape)}")
    host = _on_host(x)  # the checks below read values: on the host only (see "Host round-trips")
    if host and not _finite(x):
        raise ValueError(f"quantize needs finite numbers; x {tuple(x.shape)} holds inf or NaN")
    if not host:  # checked on the device, without waiting for it
        torch._assert_async(x.isfinite().all(), "quantize needs finite numbers; x holds inf or NaN")
    dim = dim % x.dim()
    n = x.shape[dim]
    g = n if group_size is None else group_size
    if positive_int("group_size", g) and n % g:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing the axis length {n} (dim {dim})")
    if g % (8 // bits):
        raise ValueError(f"group_size {g} must be a multiple of {8 // bits} to pack {bits}-bit codes")
    xf = x.float().movedim(dim, -1)  # (..., n): the shared axis last
    xg = xf.reshape(*xf.shape[:-1], n // g, g)  # (..., groups, g)
    qmax = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1  # the largest code (symmetric: |code|)
    lo, top = (None, xg.abs().amax(-1)) if symmetric else (xg.amin(-1), xg.amax(-1))  # (..., groups)
    low = None if symmetric else _fp16_at_most(lo)  # never above the true minimum
    half = _fp16_at_least((top if symmetric else top - low.float()) / qmax)
    scale, minimum = (half, low) if not host or _finite(low, half) else (  # past fp16's ±65,504: fp32
        (top if symmetric else top - lo) / qmax, lo)
    if not host:
        torch._assert_async(scale.isfinite().all() if minimum is None else
                            (scale.isfinite().all() & minimum.isfinite().all()),
                            "quantize: a group's spread is past fp16's ±65,504 on this device")
    if host and not _finite(scale):  # only a spread past fp32's own 3.4e38
        raise ValueError(f"quantize: a group's spread overflows fp32 (max |x| {float(xg.abs().max()):.3g})")
    s = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))[..., None]
    if symmetric:
        q = torch.clamp(torch.round(xg / s), -qmax, qmax) + 2 ** (bits - 1)  # shift to unsigned codes
    else:
        q = torch.clamp(torch.round((xg - minimum.float()[..., None]) / s), 0, qmax)
    return QTensor(pack_codes(q.to(torch.uint8), bits), scale, minimum, bits, dim - x.dim(), tuple(x.shape), x.dtype)


def quantized_nbytes(numbers: int, bits: int, group_size: int, symmetric: bool = False) -> int:
    """The bytes `quantize` stores for ``numbers`` numbers at ``bits`` bits, one scale per
    ``group_size`` of them: the packed codes, ``numbers * bits / 8``, plus an fp16 scale (and an
    fp16 minimum unless ``symmetric``) per group. Per number that is ``bits / 8 + 4 / group_size``
    bytes: a 4-bit cache with a scale and minimum per 64 numbers stores 0.5625 a number, 28% of fp16.
    (A tensor whose scales pass fp16's range keeps them in fp32, 4 bytes each: `QTensor.nbytes`.)

    >>> kvlib.quant.quantized_nbytes(64, 4, 64)  # 32 bytes of codes, a 2-byte scale and minimum
    36
    """
    _check_bits(bits)
    int_at_least("numbers", numbers, 0)
    positive_int("group_size", group_size)
    if numbers % group_size or group_size % (8 // bits):
        raise ValueError(f"group_size={group_size} must divide numbers={numbers} and be a multiple of "
                         f"{8 // bits} to pack {bits}-bit codes")
    return numbers * bits // 8 + (numbers // group_size) * 2 * (1 if symmetric else 2)


class CastCache(DynamicCache):
    """Stores keys and values in a lower-precision float dtype (fp16, bf16); returns them upcast."""

    def __init__(self, n_layer: int, dtype: torch.dtype = torch.float16) -> None:
        super().__init__(n_layer)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"CastCache stores a floating-point torch.dtype, got {dtype!r}")
        self.store_dtype = dtype

    def update(self, key_states, value_states, layer_idx):
        keys, values = super().update(key_states.to(self.store_dtype), value_states.to(self.store_dtype), layer_idx)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


def _trim(pieces: list[QTensor], n: int) -> int:
    """Drop whole pieces from the end until at most ``n`` tokens remain; return how many remain."""
    while pieces and sum(q.shape[2] for q in pieces) > n:
        pieces.pop()
    return sum(q.shape[2] for q in pieces)


class QuantizedCache(Cache):
    """A KV cache whose older tokens are quantized, KIVI-style.

    The newest tokens wait in a full-precision **residual** window. Whenever it
    holds ``residual + block`` tokens or more, the oldest whole blocks of
    ``block`` tokens are quantized (per-channel scales need a block of tokens to
    share them) and leave the window. ``key_dim``/``value_dim`` choose the granularity:
    ``"channel"`` (scales over the block's tokens) or ``"token"`` (scales over
    channels, in groups of ``group_size``). ``update`` returns the dequantized
    blocks followed by the residual, so attention sees what a quantized kernel
    would compute with.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> ids = torch.arange(1, 41)[None]  # 40 tokens
    >>> q8 = kvlib.quant.QuantizedCache(model.config.n_layer, bits=8, residual=8, block=8)
    >>> exact = kvlib.DynamicCache(model.config.n_layer)
    >>> torch.allclose(model(ids, q8), model(ids, exact), atol=0.02)  # 8 bits: logits move by ~0.002
    True
    >>> q8.nbytes < exact.nbytes / 2  # 32 tokens in int8 (and their scales), the newest 8 in fp32
    True
    """

    def __init__(
        self,
        n_layer: int,
        bits: int = 4,
        *,
        key_dim: str = "channel",
        value_dim: str = "token",
        group_size: int | None = None,
        residual: int = 32,
        block: int = 32,
        symmetric: bool = False,
    ) -> None:
        super().__init__(n_layer)
        _check_bits(bits)
        for name, d in (("key_dim", key_dim), ("value_dim", value_dim)):
            if d not in ("channel", "token"):
                raise ValueError(f"{name} must be 'channel' or 'token', got {d!r}")
        int_at_least("residual", residual, 0)
        if positive_int("block", block) % (8 // bits):
            raise ValueError(f"block must be a positive multiple of {8 // bits} for {bits}-bit codes, got {block!r}")
        self.bits, self.key_dim, self.value_dim = bits, key_dim, value_dim
        self.group_size, self.residual, self.block, self.symmetric = group_size, residual, block, symmetric
        self.reset()

    def reset(self) -> None:
        self.keys: list[list[QTensor]] = [[] for _ in range(self.n_layer)]  # quantized, oldest first
        self.values: list[list[QTensor]] = [[] for _ in range(self.n_layer)]
        self.residual_keys: list[torch.Tensor | None] = [None] * self.n_layer  # (B, H, r, D) full precision
        self.residual_values: list[torch.Tensor | None] = [None] * self.n_layer

    def _q(self, x: torch.Tensor, how: str) -> QTensor:
        if how == "channel":  # one scale per channel, shared by the block's tokens
            return quantize(x, self.bits, dim=-2, symmetric=self.symmetric)
        return quantize(x, self.bits, dim=-1, group_size=self.group_size, symmetric=self.symmetric)

    def _flush(self, t: torch.Tensor, how: str, n_blocks: int) -> list[QTensor]:
        """Quantize the first ``n_blocks * block`` tokens of ``t``: per-channel block by block,
        per-token all at once (its scales do not depend on how tokens are grouped)."""
        if how == "channel":
            pieces = [self._q(t[:, :, i * self.block:(i + 1) * self.block], how) for i in range(n_blocks)]
        else:
            pieces = [self._q(t[:, :, : n_blocks * self.block], how)]
        self.count_written(pieces)  # codes, scales and minimums: new storage
        return pieces

    def update(self, key_states, value_states, layer_idx):
        k, v, layer = key_states, value_states, layer_idx
        self.validate_update(k, v, layer)
        if self.group_size is not None and k.shape[-1] % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide head_dim {k.shape[-1]}")
        rk, rv = self.residual_keys[layer], self.residual_values[layer]
        if rk is None:  # copies, never views of the model's activations
            rk, rv = self.own(k), self.own(v)
        else:
            rk, rv = torch.cat([rk, k], dim=2), torch.cat([rv, v], dim=2)  # (B, H, r + T, D)
            self.count_written(rk, rv)
        n_blocks = max(0, (rk.shape[2] - self.residual) // self.block)  # whole blocks that leave the window
        if n_blocks:
            self.keys[layer] += self._flush(rk, self.key_dim, n_blocks)
            self.values[layer] += self._flush(rv, self.value_dim, n_blocks)
            rk, rv = (self.own(t[:, :, n_blocks * self.block:]) for t in (rk, rv))  # the window, compacted
        self.residual_keys[layer], self.residual_values[layer] = rk, rv
        return self.layer_kv(layer)

    def quantized_length(self, layer: int = 0) -> int:
        """Tokens of ``layer`` held quantized; the rest wait in the full-precision residual window."""
        return sum(q.shape[2] for q in self.keys[layer])

    def quantized_blocks(self, layer: int = 0) -> int:
        """Pieces of quantized keys in ``layer`` (per channel: one per block; per token: one per flush)."""
        return len(self.keys[layer])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        r = self.residual_keys[layer_idx]
        return self.quantized_length(layer_idx) + (0 if r is None else r.shape[2])

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values, self.residual_keys, self.residual_values)

    def crop(self, max_length: int) -> None:
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()  # empty: the next update may bring another batch size
        for layer in range(self.n_layer):
            kv = self.layer_kv(layer)
            if kv is None:
                continue
            keys, values = kv
            # Keys and values may be cut into pieces differently (per channel: one piece per block;
            # per token: one per flush). Every flush ends on a block boundary, so both lists can be
            # cut where the coarser one has to stop.
            start = min(_trim(self.keys[layer], keep), _trim(self.values[layer], keep))
            _trim(self.keys[layer], start), _trim(self.values[layer], start)
            # the rest, as floats: a fresh window (the dequantized part becomes full precision again)
            self.residual_keys[layer] = self.own(keys[:, :, start:keep])
            self.residual_values[layer] = self.own(values[:, :, start:keep])

    def layer_kv(self, layer_idx):
        layer = layer_idx
        if self.residual_keys[layer] is None:
            return None
        keys = torch.cat([q.dequantize() for q in self.keys[layer]] + [self.residual_keys[layer]], dim=2)  # (B, H, S, D)
        values = torch.cat([q.dequantize() for q in self.values[layer]] + [self.residual_values[layer]], dim=2)
        return keys, values


# FP8 lives in kvlib.fp8; its names stay importable from here.
from .fp8 import FP8, FP8_MAX, FP8Cache, FP8Tensor, fp8_scale, quantize_fp8  # noqa: E402,F401
