"""Caches with a fixed budget: a sliding window, attention sinks, and heavy hitters.

Every other kvlib cache grows with the context. These hold at most a budget of tokens per
layer. When an update would go over it they evict first; then the step attends to what is
held plus its new tokens. A decode step therefore sees exactly ``budget`` keys, its own
included, and memory and time per token stay flat however long the text.

* `WindowCache(n_layer, window)`: the ``window`` most recent tokens, in a ring buffer. A
  decode step writes one slot over the oldest and copies nothing else. Positions stay
  absolute: token t is rotated at t, however many came before it.
* `SinkCache(n_layer, n_sink, window, rope_base)`: StreamingLLM's cache. It keeps the
  first ``n_sink`` tokens (the *attention sinks*) plus the ``window`` most recent, with
  positions counted *within the cache*, as the paper does.
* `H2OCache(n_layer, heavy, recent)`: H2O's cache. It keeps the ``recent`` most recent
  tokens plus the ``heavy`` older ones that have received the most attention so far. It needs
  the attention weights, which fused kernels never write out, so it brings its own
  attention function: ``model.set_attention_impl(cache.attention)``.

A step may bring several tokens at once (a prefill chunk), up to the recent part of the
budget. Each query of the chunk then sees the held tokens and the chunk's earlier tokens.
Score a long text in chunks and say so, because the first queries of a chunk see fewer
old tokens than a decode step does.
"""

from __future__ import annotations

import torch

from .attention import repeat_kv, softmax
from .cache import Cache, nbytes_of
from .validate import int_at_least, positive_int
from .model import apply_rope, rope_cos_sin


class _Budgeted(Cache):
    """Storage shared by the caches below: per layer, K and V ``(B, H_kv, S, D)`` kept in order,
    and the absolute position of every held token, ``(B, H_kv, S)``.

    ``nbytes`` and ``bytes_written`` count keys and values, chapter 4's formula at the
    budget; the positions sit beside them (`beside_kv`), 8 bytes per held token per KV head.
    """

    beside_kv = ("pos",)
    evicts = True

    def __init__(self, n_layer: int, budget: int, recent: int) -> None:
        super().__init__(n_layer)
        self.budget, self.recent = budget, recent
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * self.n_layer
        self.values: list[torch.Tensor | None] = [None] * self.n_layer
        self.pos: list[torch.Tensor | None] = [None] * self.n_layer  # (B, H_kv, S) absolute positions
        self.seen = [0] * self.n_layer  # tokens ever given to each layer

    def _check_chunk(self, T: int, held: int) -> None:
        """A chunk that makes the cache evict may not be longer than the recent part."""
        if held + T > self.budget and T > self.recent:
            raise ValueError(
                f"{type(self).__name__} takes at most {self.recent} new tokens per update (its recent part), "
                f"got {T}: feed a long prompt in chunks of at most {self.recent}"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held now (at most the budget), not tokens seen: see `tokens_seen`."""
        return 0 if self.keys[layer_idx] is None else self.keys[layer_idx].shape[2]

    @property
    def tokens_seen(self) -> int:
        """Tokens of text given so far, evicted or not (layer 0's count)."""
        return self.seen[0]

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Absolute positions: the new tokens continue from every token seen, evicted or not."""
        B, T = tokens.shape
        return torch.arange(self.seen[0], self.seen[0] + T, device=tokens.device).expand(B, T)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys, self.values)

    @property
    def n_evicted(self) -> int:
        """Tokens evicted so far from layer 0."""
        return self.seen[0] - self.get_seq_length(0)

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor | None:
        """Absolute positions of the held tokens, ``(B, H_kv, S)`` in storage order (or None)."""
        return self.pos[self.check_layer(layer_idx)]

    def layer_kv(self, layer_idx):
        return None if self.keys[layer_idx] is None else (self.keys[layer_idx], self.values[layer_idx])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens of the text (not of the slots): the held tokens at
        positions below it. Refused (``ValueError``) when the cache has already evicted a token that a
        run over just those tokens would still hold: evicted keys cannot come back."""
        keep = self.crop_length(max_length)
        if keep == 0:
            return self.reset()
        if keep == self.tokens_seen:
            return
        self._check_crop(keep)
        for i in range(self.n_layer):
            if self.keys[i] is not None:
                self._keep_before(i, keep)

    def _needed(self, n: int) -> range | list[int]:
        """Positions a cache that was given exactly ``n`` tokens must still hold for its next step."""
        raise NotImplementedError

    def _check_crop(self, n: int) -> None:
        need = torch.as_tensor(list(self._needed(n)), dtype=torch.long)  # (N,)
        for i in range(self.n_layer):
            held = self.kept_positions(i)  # (B, H_kv, S) or None
            if held is None or not need.numel():
                continue
            have = (held[..., None] == need.to(held.device)).any(dim=-2)  # (B, H_kv, N): each needed one held?
            if bool(have.all()):
                continue
            lost = need[~have.all(dim=0).all(dim=0).cpu()].tolist()
            raise ValueError(
                f"cannot crop {type(self).__name__} to {n} tokens: layer {i} has already evicted position(s) "
                f"{lost[:5]}{' ...' if len(lost) > 5 else ''}, which a cache given only those {n} tokens would "
                f"still hold; crop before the cache evicts them, or prefill the first {n} tokens again")

    def _keep_before(self, i: int, n: int) -> None:
        """Keep layer ``i``'s held tokens at positions below ``n`` (held in order), as copies."""
        m = int((self.pos[i][0, 0] < n).sum())
        self.keys[i], self.values[i] = self.own(self.keys[i][:, :, :m]), self.own(self.values[i][:, :, :m])
        self.pos[i] = self.pos[i][:, :, :m].clone()
        self.seen[i] = n

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Keep the held tokens at indices ``keep`` ``(B, H_kv, S')`` (None: all), then append ``k, v``."""
        B, H, T, D = k.shape
        new_pos = torch.arange(self.seen[layer], self.seen[layer] + T, device=k.device).expand(B, H, T)
        old = (self.keys[layer], self.values[layer], self.pos[layer])
        if old[0] is None:
            old = (k[:, :, :0], v[:, :, :0], new_pos[:, :, :0])
        elif keep is not None:
            idx = keep[..., None].expand(-1, -1, -1, D)  # (B, H_kv, S', D)
            old = (old[0].gather(2, idx), old[1].gather(2, idx), old[2].gather(2, keep))
        self.keys[layer] = torch.cat([old[0], k], dim=2)  # (B, H_kv, S' + T, D)
        self.values[layer] = torch.cat([old[1], v], dim=2)
        self.pos[layer] = torch.cat([old[2], new_pos], dim=2)
        self.seen[layer] += T
        self.count_written(self.keys[layer], self.values[layer])


class WindowCache(_Budgeted):
    """The ``window`` most recent tokens, in a ring buffer: one slot written per decode step.

    The buffers ``(B, H_kv, window, D)`` are allocated by the first update. Until they
    fill, tokens go in order. Then each decode step overwrites the oldest slot in place, so
    the ring holds tokens out of order. A decode step's single query sees every held key,
    and attention does not care about the order of the keys it sums over, so the ring is
    returned as it lies. A chunk of several tokens needs its keys in order for the causal
    mask, so it unrolls the ring once (one copy per chunk, not per token).

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.evict.WindowCache(model.config.n_layer, window=8)
    >>> kvlib.generate(model, [1, 2, 3], 20, cache=cache).shape
    torch.Size([1, 23])
    >>> cache.seq_len, cache.nbytes  # 8 tokens held: 2 x 2 layers x 2 heads x 8 x 16 dims x 4 bytes
    (8, 4096)
    """

    def __init__(self, n_layer: int, window: int) -> None:
        super().__init__(n_layer, positive_int("window", window), window)
        self.window = window

    def reset(self) -> None:
        super().reset()
        self.held = [0] * self.n_layer
        self.start = [0] * self.n_layer  # ring index of the oldest held token (0 until the ring wraps)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.held[layer_idx]

    def layer_kv(self, layer_idx):
        n = self.held[layer_idx]
        return None if n == 0 else (self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n])

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor | None:
        n = self.held[self.check_layer(layer_idx)]
        return None if n == 0 else self.pos[layer_idx][:, :, :n]

    def _unroll(self, layer: int) -> None:
        s = self.start[layer]
        if s:
            self.keys[layer], self.values[layer], self.pos[layer] = (
                torch.roll(t, -s, dims=2) for t in (self.keys[layer], self.values[layer], self.pos[layer]))
            self.count_written(self.keys[layer], self.values[layer])
            self.start[layer] = 0

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        B, H, T, D = key_states.shape
        i, W = layer_idx, self.window
        self._check_chunk(T, self.held[i])
        if self.keys[i] is None:
            self.keys[i] = key_states.new_zeros(B, H, W, D)
            self.values[i] = value_states.new_zeros(B, H, W, D)
            self.pos[i] = torch.zeros(B, H, W, dtype=torch.long, device=key_states.device)
        new_pos = torch.arange(self.seen[i], self.seen[i] + T, device=key_states.device)  # (T,)
        held, start = self.held[i], self.start[i]
        if T == 1 and held == W:  # the ring is full: overwrite the oldest slot in place
            s, start, held = start, (start + 1) % W, W
        else:
            self._unroll(i)
            start = 0
            if held + T > W:  # slide the newest W - T tokens to the front
                drop = held + T - W
                for t in (self.keys[i], self.values[i], self.pos[i]):
                    t[:, :, : W - T] = t[:, :, drop:held].clone()
                self.count_written(self.keys[i][:, :, : W - T], self.values[i][:, :, : W - T])
                held = W - T
            s, held = held, held + T
        self.keys[i][:, :, s : s + T] = key_states
        self.values[i][:, :, s : s + T] = value_states
        self.pos[i][:, :, s : s + T] = new_pos
        # the counts change only once the step is stored: a write that fails leaves them as they were
        self.held[i], self.start[i] = held, start
        self.seen[i] += T
        self.count_written(key_states, value_states)
        return self.layer_kv(i)

    def _needed(self, n: int) -> range:
        return range(max(0, n - self.window + 1), n)  # what the next query at position n sees

    def _keep_before(self, i: int, n: int) -> None:
        self._unroll(i)
        self.held[i] = int((self.pos[i][0, 0, : self.held[i]] < n).sum())
        self.seen[i] = n



class SinkCache(_Budgeted):
    """StreamingLLM: the first ``n_sink`` tokens plus the ``window`` most recent, positions within the cache.

    Positions count slots in the cache, not tokens in the text: the held tokens sit at
    0 … S-1 and a new token comes right after them, so no position ever exceeds
    ``n_sink + window``. The model rotates each key at its position *before* it reaches
    the cache. When the window's oldest ``e`` tokens are evicted, every later window token
    moves ``e`` slots down, so its stored key is rotated by ``-e`` positions (a RoPE
    rotation composes: rotating by p and then by -e is rotating by p - e). We re-rotate
    on eviction (``window`` keys per step) rather than store unrotated keys and rotate
    every key at every read (``n_sink + window`` keys per step, and a model that applies
    RoPE after the cache). Hugging Face's former ``SinkCache`` made the same choice.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.evict.SinkCache(model.config.n_layer, n_sink=4, window=8, rope_base=model.config.rope_base)
    >>> kvlib.generate(model, [1, 2, 3], 20, cache=cache).shape
    torch.Size([1, 23])
    >>> cache.seq_len  # the 4 sinks and the 8 most recent
    12
    """

    def __init__(self, n_layer: int, n_sink: int, window: int, rope_base: float) -> None:
        int_at_least("n_sink", n_sink, 0)
        positive_int("window", window)
        if not rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {rope_base!r}")
        super().__init__(n_layer, n_sink + window, window)
        self.n_sink, self.window, self.rope_base = n_sink, window, float(rope_base)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Slots in the cache: after this step's eviction, the new tokens take the last ``T`` slots."""
        B, T = tokens.shape
        start = min(self.get_seq_length(0), self.budget - T)
        return torch.arange(start, start + T, device=tokens.device).expand(B, T)

    def position_end(self, new_tokens: int) -> int:
        """Positions count slots, so they never pass the budget, however long the text."""
        return min(self.tokens_held + new_tokens, self.budget)

    def _needed(self, n: int) -> list[int]:
        # the sinks, and the recent tokens the next query at position n sees
        return list(range(min(n, self.n_sink))) + list(range(max(self.n_sink, n - self.window + 1), n))

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        T, held = key_states.shape[2], self.get_seq_length(layer_idx)
        self._check_chunk(T, held)
        drop = max(0, held + T - self.budget)
        keep = None
        if drop:
            B, H, _, D = key_states.shape
            kept = list(range(self.n_sink)) + list(range(self.n_sink + drop, held))
            keep = torch.tensor(kept, device=key_states.device).expand(B, H, len(kept))
            k = self.keys[layer_idx]
            # rotate in fp32 and round once: a bf16 key is re-rotated at every eviction, and
            # bf16 arithmetic inside the rotation would add its rounding each time
            cos, sin = rope_cos_sin(torch.full((1, 1), -drop, device=k.device), D, self.rope_base, torch.float32)
            window = apply_rope(k[:, :, self.n_sink + drop:].float(), cos, sin).to(k.dtype)
            self.keys[layer_idx] = torch.cat([k[:, :, : self.n_sink + drop], window], dim=2)
            self.count_written(self.keys[layer_idx])  # the re-rotated keys, written again
        self._append(layer_idx, key_states, value_states, keep)
        return self.keys[layer_idx], self.values[layer_idx]


def h2o_keep(scores: torch.Tensor, heavy: int, protect: int) -> torch.Tensor:
    """Which held tokens H2O keeps: the last ``protect`` (recent), plus the ``heavy`` others with
    the highest accumulated attention ``scores`` ``(B, H_kv, S)``; ties go to the older token.

    Returns indices ``(B, H_kv, min(S, heavy + protect))``, ascending (storage order kept).
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be (batch, kv_heads, held), got shape {tuple(scores.shape)}")
    B, H, S = scores.shape
    if heavy < 0 or protect < 0:
        raise ValueError(f"heavy and protect must be >= 0, got {heavy} and {protect}")
    if S <= heavy + protect:
        return torch.arange(S, device=scores.device).expand(B, H, S)
    old = S - protect
    # stable sort descending: equal scores keep their order, so the older token wins a tie
    top = torch.sort(scores[..., :old], dim=-1, descending=True, stable=True).indices[..., :heavy]
    recent = torch.arange(old, S, device=scores.device).expand(B, H, protect)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values


class H2OCache(_Budgeted):
    """H2O: the ``recent`` most recent tokens plus the ``heavy`` older ones most attended so far.

    Each held token carries its accumulated attention: the sum, over every query that has
    seen it and every query head that shares its KV head, of the weight it received. The
    weights come from `attention`, this cache's own attention function, which the model
    must use: ``model.set_attention_impl(cache.attention)``. An update that has to evict
    without them raises ``ValueError``. Choices are per KV head, as in the paper's code,
    and positions stay absolute.

    Example

    >>> model = kvlib.Transformer(kvlib.PRESETS["tiny"])
    >>> cache = kvlib.evict.H2OCache(model.config.n_layer, heavy=4, recent=4)
    >>> model.set_attention_impl(cache.attention)  # the cache sees the attention weights
    >>> kvlib.generate(model, [1, 2, 3], 20, cache=cache).shape, cache.seq_len
    (torch.Size([1, 23]), 8)
    """

    beside_kv = ("pos", "score")  # the accumulated attention: fp32, one per held token per KV head

    def __init__(self, n_layer: int, heavy: int, recent: int) -> None:
        int_at_least("heavy", heavy, 0)
        super().__init__(n_layer, heavy + positive_int("recent", recent), recent)
        self.heavy = heavy

    def reset(self) -> None:
        super().reset()
        self.score: list[torch.Tensor | None] = [None] * self.n_layer  # (B, H_kv, S), fp32
        self.last_layer: int | None = None
        self.observed = [False] * self.n_layer  # did the layer's last step record its weights?

    def update(self, key_states, value_states, layer_idx):
        self.validate_update(key_states, value_states, layer_idx)
        B, H, T, _ = key_states.shape
        held = self.get_seq_length(layer_idx)
        self._check_chunk(T, held)
        score = self.score[layer_idx]
        if held and not self.observed[layer_idx]:
            raise ValueError(
                f"H2OCache needs the attention weights of every step, and layer {layer_idx}'s last step "
                "recorded none (its attention was not this cache's): call "
                "model.set_attention_impl(cache.attention) before running the model"
            )
        self.observed[layer_idx] = False
        keep = None
        if held + T > self.budget:
            keep = h2o_keep(score, self.heavy, self.budget - T - self.heavy)
            score = score.gather(2, keep)
        zeros = torch.zeros(B, H, T, device=key_states.device)
        self.score[layer_idx] = zeros if score is None else torch.cat([score, zeros], dim=2)
        self._append(layer_idx, key_states, value_states, keep)
        self.last_layer = layer_idx
        return self.keys[layer_idx], self.values[layer_idx]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Attention that also adds each key's weights to its score. A model calls it right after
        ``update`` in the same layer, so the weights belong to `last_layer`."""
        if self.last_layer is None or k.shape[2] != self.get_seq_length(self.last_layer):
            raise ValueError("H2OCache.attention must follow this cache's own update in the same layer")
        B, H, Tq, D = q.shape
        H_kv = k.shape[1]
        scores = q @ repeat_kv(k, H // H_kv).transpose(-2, -1) / D**0.5  # (B, H, Tq, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        w = softmax(scores.float(), dim=-1)  # (B, H, Tq, S)
        per_kv = w.reshape(B, H_kv, H // H_kv, Tq, -1).sum(dim=(2, 3))  # (B, H_kv, S)
        self.score[self.last_layer] += per_kv
        self.observed[self.last_layer] = True
        return (w.to(v.dtype) @ repeat_kv(v, H // H_kv))  # (B, H, Tq, D)

    def crop(self, max_length: int) -> None:
        """Only ``crop(0)`` (empty it) or a crop to every token seen (nothing to do): each held token's
        score sums the attention of every later query, the cropped ones included, so no prefix of an
        H2O cache is what a cache given only that prefix would hold."""
        keep = self.crop_length(max_length)
        if 0 < keep < self.tokens_seen:
            raise ValueError(
                f"H2OCache cannot be cropped to {keep} of its {self.tokens_seen} tokens: the scores it ranks by "
                f"include the attention of the tokens after them, which a crop cannot take back; prefill the "
                f"first {keep} tokens into a new cache instead")
        super().crop(max_length)
