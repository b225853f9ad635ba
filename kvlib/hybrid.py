"""One cache, a policy per layer: full, sliding window, chunked, or shared with another layer.

Gemma 3 gives five of every six layers a window of 1,024 tokens; gpt-oss alternates windows
of 128 with full layers; CLA and YOCO let a layer read an earlier layer's keys instead of
keeping its own. The model's pattern (`ModelConfig.layers`, kinds from `kvlib.layers`)
decides what each layer may see; the cache decides what each layer must *keep*::

    full         every token, appended (as `kvlib.DynamicCache` does)
    window(W)    a ring buffer of W slots (plus the first `sinks` tokens): a decode step
                 writes one slot over the oldest and copies nothing
    chunked(C)   the tokens of the current chunk; a new chunk starts empty
    shared(i)    nothing: ``update`` returns layer i's keys and values of this step

* `HybridCache(layers)` is that cache. A window layer's decode step sees exactly what it
  holds, so it runs with no mask at all; a chunk of several tokens attends to what the
  layer held plus the chunk, through the band mask `kvlib.layers.visible` draws, and then
  keeps only what later queries can see.
* `Recompute(layers)` is its reference: it keeps every token of every layer and masks per
  layer. A hybrid `Transformer` called with no cache runs through one, so ``model(tokens)``
  is the full recompute with per-layer masks that the hybrid cache must equal.

Positions stay absolute (token t is rotated at t), and the layout is ``(B, H_kv, S, D)``.
A hybrid cache takes no padding mask: its layers hold different tokens, so one step mask
cannot describe them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import Cache, model_layout, nbytes_of
from .layers import LayerKind, check_pattern, visible


def cache_for(config, cache: Cache | None) -> Cache | None:
    """The cache a model of ``config`` runs with: ``cache`` if its layers are the model's; a fresh
    `Recompute` for a hybrid model given none (the reference); else a clear error."""
    kinds = config.layer_kinds()
    if cache is None:
        return Recompute(kinds) if config.hybrid else None
    if getattr(cache, "layers", kinds) != kinds:
        raise ValueError("the cache's layer kinds differ from the model's: run a model with ModelConfig.layers "
                         "set through kvlib.hybrid.HybridCache.for_model(model.config)")
    if config.hybrid and not hasattr(cache, "layers"):
        raise ValueError(f"{type(cache).__name__} keeps every layer alike, but this model's layers differ "
                         f"({', '.join(sorted({str(k) for k in kinds}))}): use "
                         f"kvlib.hybrid.HybridCache.for_model(model.config)")
    return cache


class _Kinds(Cache):
    """What `HybridCache` and `Recompute` share: the pattern, the tokens seen, each layer's last
    step (query and key positions) for its mask, and how a shared layer reads its source."""

    # bookkeeping, not storage: each layer's last query and key positions, and the keys of this step
    # lent to the layers that share them (the last reader of the step lets go of them)
    beside_kv = ("step", "lent")

    @classmethod
    def for_model(cls, model_or_config: object) -> "_Kinds":
        """A cache for a `kvlib.Transformer` or a `kvlib.ModelConfig`: its pattern of layers, or
        every layer full. It makes its tensors at the first update, in the model's dtype and device."""
        return cls(model_layout(model_or_config)[0].layer_kinds())

    def __init__(self, layers: Sequence[LayerKind]) -> None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers must be a sequence of kvlib.layers kinds, got {type(layers).__name__}")
        if any(isinstance(k, LayerKind) and k.kind == "latent" for k in layers):
            raise ValueError("latent (MLA) layers cache one latent per token, not K and V: use kvlib.mla")
        self.layers = check_pattern(layers, len(layers))
        super().__init__(len(self.layers))
        self.reset()

    def reset(self) -> None:
        self.seen = [0] * self.n_layer  # tokens ever given to each layer
        self.step: list[tuple | None] = [None] * self.n_layer  # (q_pos, k_pos) of each layer's last update
        # this step's keys and values of a layer that others share, until its last reader has read them
        self.lent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _readers(self, src: int) -> list[int]:
        return [j for j, kind in enumerate(self.layers) if kind.kind == "shared" and kind.source == src]

    def _done(self, layer_idx: int, k, v, q_pos, k_pos):
        """Record a step of a layer that keeps a cache, and lend its keys to the layers sharing it."""
        self.step[layer_idx] = (q_pos, k_pos)
        if self._readers(layer_idx):
            self.lent[layer_idx] = (k, v)
        return k, v

    def owner(self, layer_idx: int) -> int:
        """The layer whose cache ``layer_idx`` reads: its source if it is shared, else itself."""
        kind = self.layers[self.check_layer(layer_idx)]
        return kind.source if kind.kind == "shared" else layer_idx

    @property
    def tokens_seen(self) -> int:
        """Tokens of text given so far, evicted or not (layer 0's count; every layer sees every token)."""
        return self.seen[0]

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Absolute positions: the new tokens continue from every token seen, evicted or not."""
        B, T = tokens.shape
        return torch.arange(self.seen[0], self.seen[0] + T, device=tokens.device).expand(B, T)

    def _read_shared(self, key_states: torch.Tensor, layer_idx: int):
        """A shared layer's update: its own keys are not kept; it reads its source's of this step."""
        src, T = self.layers[layer_idx].source, key_states.shape[2]
        if src not in self.lent or self.seen[src] != self.seen[layer_idx] + T:
            raise ValueError(f"layer {layer_idx} reads layer {src}'s cache, so layer {src} must be updated "
                             f"with the same {T} new tokens first, in the same step")
        self.seen[layer_idx] += T
        self.step[layer_idx] = self.step[src]
        k, v = self.lent[src]
        if layer_idx == self._readers(src)[-1]:
            del self.lent[src]  # the last reader: keep no view of this step alive
        return k, v

    def layer_mask(self, layer_idx: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask of ``layer_idx``'s last step over the keys its update returned: the band of its
        kind (`kvlib.layers.visible`), or None where that is plain bottom-right causal."""
        if self.step[layer_idx] is None:
            raise ValueError(f"layer {layer_idx} has not been updated in this step")
        if mask is not None:
            raise ValueError(f"{type(self).__name__} takes no step mask (padding): its layers hold different "
                             f"tokens, so one mask cannot describe them all")
        q_pos, k_pos = self.step[layer_idx]
        band = visible(self.layers[self.owner(layer_idx)], q_pos, k_pos)  # (T, S)
        T, S = band.shape
        causal = torch.ones(T, S, dtype=torch.bool, device=band.device).tril(S - T)
        return None if torch.equal(band, causal) else band[None, None]  # (1, 1, T, S)


class Recompute(_Kinds):
    """The reference: every token of every layer kept, each layer masked by its kind.

    Nothing is evicted, so what a window or chunk may not see is hidden by the mask alone.
    A hybrid `Transformer` called without a cache runs through a fresh one, which makes
    ``model(tokens)`` the full recompute that `HybridCache` must equal."""

    def reset(self) -> None:
        super().reset()
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        if self.layers[layer_idx].kind == "shared":
            return self._read_shared(key_states, layer_idx)
        T = key_states.shape[2]
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = self.own(key_states), self.own(value_states)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=2)  # (B, H_kv, S, D)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=2)
            self.count_written(self.keys[layer_idx], self.values[layer_idx])
        self.seen[layer_idx] += T
        S = self.seen[layer_idx]
        k_pos = torch.arange(S, device=key_states.device)
        return self._done(layer_idx, self.keys[layer_idx], self.values[layer_idx], k_pos[S - T:], k_pos)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen[self.owner(layer_idx)]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    def crop(self, max_length: int) -> None:
        if self.crop_length(max_length) == 0:
            return self.reset()
        raise ValueError("Recompute is a one-pass reference: make a new one instead of cropping (or crop(0))")

    def layer_kv(self, layer_idx):
        i = self.owner(layer_idx)
        return None if self.keys[i] is None else (self.keys[i], self.values[i])


class HybridCache(_Kinds):
    """A cache with a policy per layer: ``HybridCache(config.layers)`` or `for_model`.

    Storage per layer that keeps a cache of its own (``(B, H_kv, slots, D)`` keys and values,
    and ``pos[layer]`` ``(slots,)``, the absolute position in each slot):

    * full and chunked: the held tokens in order; a chunked layer drops the tokens before its
      current chunk after each update;
    * window(W, sinks): ``sinks + W`` slots allocated by the first update. Token p < sinks sits
      in slot p for good; later tokens go round the ring, token p in slot
      ``sinks + (p - sinks) % W``. Until the ring first fills, slots fill in order.

    ``get_seq_length(layer)`` is what that layer holds (a shared layer: its source's); the
    position of the next token is `positions`, which counts every token seen.

    Example

    >>> from kvlib.layers import full, window
    >>> config = kvlib.PRESETS["tiny"].replace(layers=(window(8), full()))
    >>> model = kvlib.Transformer(config)
    >>> cache = kvlib.hybrid.HybridCache.for_model(config)
    >>> logits = model(torch.arange(1, 41)[None], cache)
    >>> [cache.get_seq_length(layer) for layer in range(2)]  # what each layer holds
    [8, 40]
    """

    beside_kv = ("pos", "step", "lent")

    @property
    def evicts(self) -> bool:
        """Whether some layer drops tokens it was given (a window or a chunked layer)."""
        return any(kind.kind in ("window", "chunked") for kind in self.layers)

    def reset(self) -> None:
        super().reset()
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer
        self.pos: list[torch.Tensor | None] = [None] * self.n_layer  # (slots,) absolute positions, -1 empty
        self.held = [0] * self.n_layer  # filled slots

    # -- one step ---------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        kind = self.layers[layer_idx]
        if kind.kind == "shared":
            return self._read_shared(key_states, layer_idx)
        T, dev = key_states.shape[2], key_states.device
        q_pos = torch.arange(self.seen[layer_idx], self.seen[layer_idx] + T, device=dev)  # (T,)
        if kind.kind == "window" and T == 1 and self.keys[layer_idx] is not None:
            self._write_ring(layer_idx, key_states, value_states, q_pos)  # decode: one slot, no copy
            n = self.held[layer_idx]
            k, v, k_pos = self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n], self.pos[layer_idx][:n]
        else:  # a chunk: what is held plus the chunk, in order; then keep what later queries see
            old = self.layer_kv(layer_idx)
            k_pos = q_pos if old is None else torch.cat([self.pos[layer_idx][: self.held[layer_idx]], q_pos])
            k = key_states if old is None else torch.cat([old[0], key_states], dim=2)  # (B, H_kv, S, D)
            v = value_states if old is None else torch.cat([old[1], value_states], dim=2)
            if kind.kind == "window":
                self._write_ring(layer_idx, key_states, value_states, q_pos)
            else:
                self._keep_in_order(layer_idx, kind, k, v, k_pos)
        self.seen[layer_idx] += T
        return self._done(layer_idx, k, v, q_pos, k_pos)

    def _keep_in_order(self, i: int, kind: LayerKind, k, v, k_pos) -> None:
        """Full and chunked layers: store ``k, v`` (all held plus the chunk), a chunked layer
        only from the start of the last token's chunk."""
        if kind.kind == "chunked":
            start = int(k_pos[-1]) // kind.size * kind.size
            keep = int((k_pos >= start).sum())
            k, v, k_pos = k[:, :, -keep:], v[:, :, -keep:], k_pos[-keep:]
        self.keys[i], self.values[i] = self.own(k), self.own(v)  # a full copy, as torch.cat makes
        self.pos[i], self.held[i] = k_pos.clone(), k_pos.shape[0]

    def _write_ring(self, i: int, k_new, v_new, q_pos) -> None:
        """Window layers: write the new tokens that later queries can still see into their slots."""
        kind = self.layers[i]
        W, n_sink = kind.size, kind.sinks
        if self.keys[i] is None:
            B, H, _, D = k_new.shape
            self.keys[i] = k_new.new_zeros(B, H, n_sink + W, D)
            self.values[i] = v_new.new_zeros(B, H, n_sink + W, D)
            self.pos[i] = torch.full((n_sink + W,), -1, dtype=torch.long, device=k_new.device)
        last = int(q_pos[-1])
        keep = (q_pos > last - W) | (q_pos < n_sink)  # (T,): what a later query may see
        p = q_pos[keep]
        slots = torch.where(p < n_sink, p, n_sink + (p - n_sink) % W)  # (T',)
        self.keys[i][:, :, slots] = k_new[:, :, keep]
        self.values[i][:, :, slots] = v_new[:, :, keep]
        self.pos[i][slots] = p
        self.held[i] = int((self.pos[i] >= 0).sum())
        self.count_written(self.keys[i][:, :, slots], self.values[i][:, :, slots])

    # -- the rest of the protocol -----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.held[self.owner(layer_idx)]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    def layer_kv(self, layer_idx):
        """The keys and values a layer holds, in slot order (a window's ring is not unrolled)."""
        i = self.owner(layer_idx)
        n = self.held[i]
        return None if n == 0 else (self.keys[i][:, :, :n], self.values[i][:, :, :n])

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor | None:
        """The absolute position of each held token ``(S,)``, in the order `layer_kv` returns them."""
        i = self.owner(layer_idx)
        return None if self.held[i] == 0 else self.pos[i][: self.held[i]]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens of the text. Only possible while every window and
        chunk still holds what a query at the new end would see: evicted keys cannot come back."""
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()
        for i, kind in enumerate(self.layers):
            if kind.kind in ("window", "chunked") and self.pos[i] is not None:
                need = visible(kind, torch.tensor([keep - 1]), torch.arange(keep))[0].sum()
                have = ((self.pos[i] >= 0) & (self.pos[i] < keep)).sum()
                if int(have) != int(need):
                    raise ValueError(f"cannot crop to {keep} tokens: layer {i} ({kind}) has evicted "
                                     f"{int(need - have)} of the tokens the next query would see")
        for i, kind in enumerate(self.layers):
            self.seen[i] = keep
            if kind.kind == "shared" or self.pos[i] is None:
                continue
            if kind.kind == "window":
                # the check above leaves a wrapped ring whole, so the emptied slots end the filled prefix
                self.pos[i] = torch.where(self.pos[i] < keep, self.pos[i], -1)
                self.held[i] = int((self.pos[i] >= 0).sum())
            else:
                n = int((self.pos[i] < keep).sum())
                if n < self.held[i]:  # copies: a view would keep the whole old tensor alive, unseen by nbytes
                    self.keys[i], self.values[i] = self.own(self.keys[i][:, :, :n]), self.own(self.values[i][:, :, :n])
                    self.pos[i] = self.pos[i][:n].clone()
                self.held[i] = n
        self.step, self.lent = [None] * self.n_layer, {}
