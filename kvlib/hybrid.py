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

**Host round-trips.** None. Which positions a layer holds follows from counts the host keeps (tokens seen, slots
filled) and, for a window layer, a host copy of its ring's positions (``sinks + W`` ints).
So the slots a step writes, how much a chunked layer keeps, and whether a layer's band is
plain causal (no mask needed) are decided on the host; the device only gets index tensors.
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
        # (q_pos, k_pos, causal) of each layer's last update: positions on the device, causal on the host
        self.step: list[tuple | None] = [None] * self.n_layer
        # this step's keys and values of a layer that others share, until its last reader has read them
        self.lent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _readers(self, src: int) -> list[int]:
        return [j for j, kind in enumerate(self.layers) if kind.kind == "shared" and kind.source == src]

    def _done(self, layer_idx: int, k, v, q_pos, k_pos, causal: bool):
        """Record a step of a layer that keeps a cache (``causal``: its band is plain bottom-right
        causal, decided on the host), and lend its keys to the layers sharing it."""
        self.step[layer_idx] = (q_pos, k_pos, causal)
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
        q_pos, k_pos, causal = self.step[layer_idx]
        if causal:  # decided on the host when the layer was updated: no read of the band
            return None
        return visible(self.layers[self.owner(layer_idx)], q_pos, k_pos)[None, None]  # (1, 1, T, S)


def plain_causal(kind: LayerKind, q_pos: list[int] | range, k_pos: list[int] | range) -> bool:
    """Whether ``visible(kind, q_pos, k_pos)`` is the bottom-right causal band, from host positions:
    then a layer needs no mask. It runs on the CPU, so it never waits for the device."""
    if kind.kind == "full":
        return True
    q, k = torch.tensor(list(q_pos)), torch.tensor(list(k_pos))
    T, S = len(q), len(k)
    return torch.equal(visible(kind, q, k), torch.ones(T, S, dtype=torch.bool).tril(S - T))


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
        causal = plain_causal(self.layers[layer_idx], range(S - T, S), range(S))
        return self._done(layer_idx, self.keys[layer_idx], self.values[layer_idx], k_pos[S - T:], k_pos, causal)

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
        self.ring: list[list[int] | None] = [None] * self.n_layer  # a window's pos, on the host
        self.held = [0] * self.n_layer  # filled slots

    # -- one step ---------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        kind = self.layers[layer_idx]
        if kind.kind == "shared":
            return self._read_shared(key_states, layer_idx)
        T, dev, s0 = key_states.shape[2], key_states.device, self.seen[layer_idx]
        q_pos = torch.arange(s0, s0 + T, device=dev)  # (T,)
        if kind.kind == "window" and T == 1 and self.keys[layer_idx] is not None:
            self._write_ring(layer_idx, key_states, value_states, s0)  # decode: one slot, no copy
            n = self.held[layer_idx]
            k, v, k_pos = self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n], self.pos[layer_idx][:n]
            causal = True  # a window's decode step sees exactly what the layer holds
        else:  # a chunk: what is held plus the chunk, in order; then keep what later queries see
            old, n = self.layer_kv(layer_idx), self.held[layer_idx]
            k_pos = q_pos if old is None else torch.cat([self.pos[layer_idx][:n], q_pos])
            k = key_states if old is None else torch.cat([old[0], key_states], dim=2)  # (B, H_kv, S, D)
            v = value_states if old is None else torch.cat([old[1], value_states], dim=2)
            if kind.kind == "window":  # the held positions, on the host, then the chunk's
                causal = plain_causal(kind, range(s0, s0 + T), (self.ring[layer_idx] or [])[:n] + [*range(s0, s0 + T)])
                self._write_ring(layer_idx, key_states, value_states, s0)
            else:  # full and chunked layers hold positions s0 - n .. s0 - 1, in order
                causal = plain_causal(kind, range(s0, s0 + T), range(s0 - n, s0 + T))
                self._keep_in_order(layer_idx, kind, k, v, k_pos, s0 + T - 1)
        self.seen[layer_idx] += T
        return self._done(layer_idx, k, v, q_pos, k_pos, causal)

    def _keep_in_order(self, i: int, kind: LayerKind, k, v, k_pos, last: int) -> None:
        """Full and chunked layers: store ``k, v`` (all held plus the chunk, positions in order up
        to ``last``), a chunked layer only from the start of the last token's chunk."""
        if kind.kind == "chunked":
            keep = min(k_pos.shape[0], last % kind.size + 1)  # from the chunk's start to `last`
            k, v, k_pos = k[:, :, -keep:], v[:, :, -keep:], k_pos[-keep:]
        self.keys[i], self.values[i] = self.own(k), self.own(v)  # a full copy, as torch.cat makes
        self.pos[i], self.held[i] = k_pos.clone(), k_pos.shape[0]

    def _write_ring(self, i: int, k_new, v_new, s0: int) -> None:
        """Window layers: write the new tokens (positions ``s0 ..``) that later queries can still see
        into their slots. The slots come from the host's count of tokens: no read of the device."""
        kind = self.layers[i]
        W, n_sink, T = kind.size, kind.sinks, k_new.shape[2]
        if self.keys[i] is None:
            B, H, _, D = k_new.shape
            self.keys[i] = k_new.new_zeros(B, H, n_sink + W, D)
            self.values[i] = v_new.new_zeros(B, H, n_sink + W, D)
            self.pos[i] = torch.full((n_sink + W,), -1, dtype=torch.long, device=k_new.device)
            self.ring[i] = [-1] * (n_sink + W)
        last = s0 + T - 1
        keep = [t for t in range(T) if s0 + t > last - W or s0 + t < n_sink]  # what a later query may see
        slots = [p if p < n_sink else n_sink + (p - n_sink) % W for p in (s0 + t for t in keep)]
        for t, slot in zip(keep, slots):
            self.ring[i][slot] = s0 + t
        self.held[i] = max(self.held[i], max(slots) + 1)  # filled slots are a prefix: they fill in order
        if keep == list(range(T)) and slots == list(range(slots[0], slots[0] + T)):  # one run of slots
            at, t_at = slice(slots[0], slots[0] + T), slice(None)  # decode: a slice, no index tensor
        else:
            at, t_at = (torch.tensor(x, device=k_new.device) for x in (slots, keep))  # host -> device
        self.keys[i][:, :, at] = k_new[:, :, t_at]
        self.values[i][:, :, at] = v_new[:, :, t_at]
        self.pos[i][at] = torch.arange(s0, s0 + T, device=k_new.device)[t_at]
        self.count_written(self.keys[i][:, :, at], self.values[i][:, :, at])

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

    def _held_positions(self, i: int) -> list[int] | range:
        """Layer ``i``'s held positions in slot order, from the host: a window's ring copy, or the
        ``held`` positions before ``seen`` that full and chunked layers keep in order."""
        if self.ring[i] is not None:
            return self.ring[i][: self.held[i]]
        return range(self.seen[i] - self.held[i], self.seen[i])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens of the text. Only possible while every window and
        chunk still holds what a query at the new end would see: evicted keys cannot come back."""
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()
        for i, kind in enumerate(self.layers):
            if kind.kind in ("window", "chunked") and self.pos[i] is not None:
                need = int(visible(kind, torch.tensor([keep - 1]), torch.arange(keep))[0].sum())  # host
                have = sum(0 <= p < keep for p in self._held_positions(i))
                if have != need:
                    raise ValueError(f"cannot crop to {keep} tokens: layer {i} ({kind}) has evicted "
                                     f"{need - have} of the tokens the next query would see")
        for i, kind in enumerate(self.layers):
            held = self._held_positions(i)
            self.seen[i] = keep
            if kind.kind == "shared" or self.pos[i] is None:
                continue
            if kind.kind == "window":
                # the check above leaves a wrapped ring whole, so the emptied slots end the filled prefix
                self.pos[i] = torch.where(self.pos[i] < keep, self.pos[i], -1)
                self.ring[i] = [p if p < keep else -1 for p in self.ring[i]]
                self.held[i] = sum(p >= 0 for p in self.ring[i])
            else:
                n = sum(p < keep for p in held)
                if n < self.held[i]:  # copies: a view would keep the whole old tensor alive, unseen by nbytes
                    self.keys[i], self.values[i] = self.own(self.keys[i][:, :, :n]), self.own(self.values[i][:, :, :n])
                    self.pos[i] = self.pos[i][:n].clone()
                self.held[i] = n
        self.step, self.lent = [None] * self.n_layer, {}
