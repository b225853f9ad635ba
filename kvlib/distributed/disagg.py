"""Disaggregated prefill and decode: one process prefills, another decodes, the cache sent between.

Prefill is compute-bound and decode bandwidth-bound (chapter 5), and on one machine a long
prefill stalls every decode beside it. DistServe, Splitwise, Mooncake, NVIDIA Dynamo and
vLLM's KV connectors put the two phases on different machines and *ship the cache* from
the one that computed it to the one that continues the text.

Here rank 0 is the prefill worker and rank 1 the decode worker, two processes joined by
gloo (`kvlib.distributed.launch`); the link is gloo's ``send``/``recv``, the calls NCCL and
NIXL-based connectors make between GPUs.

- **Layer by layer.** A hook on each layer's attention hands that layer's keys and values to
  a sender thread as soon as the layer has computed them, so layer ``i`` travels while
  layers ``i + 1 ...`` compute (vLLM's connector API has the same two halves:
  ``save_kv_layer`` inside each attention layer, ``wait_for_save`` at the end). With
  ``overlap=False`` the sender starts only after the whole prefill.
- **The link.** Loopback between two processes moves bulk data at gigabytes a second, but
  the cache goes as one gloo send per layer, and each message's fixed cost can dominate
  (chapter 13.1's run: well under 1 GB/s for 60 sends, 11.8 MB in all). ``link_gb_s`` emulates a slower link (the sender waits
  ``bytes / rate`` before each send, as the wire would); None sends at loopback speed.
- **The decode worker** receives every layer into an ordinary kvlib cache, then the first
  token (the prefill's own), and continues with `kvlib.generate` on that cache. The keys
  and values arrive bit for bit as computed, so its tokens are one process's tokens.

Time to first token is taken on one clock (``time.monotonic``, system-wide on Linux and
macOS) from the request's arrival at the prefill worker to the moment the decode worker
holds the whole cache and the first token: what a user waits for before the stream starts.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from ..cache import StaticCache
from ..generate import generate, prefill
from ..model import Transformer
from .tp import build

PREFILL, DECODE = 0, 1  # the two ranks


class LayerSender:
    """A background thread that sends each queued layer's keys and values to ``dst``.

    ``put(layer, k, v)`` queues a layer (copies of its tensors) and returns at once;
    ``finish()`` waits until everything queued has been sent. ``sent_bytes`` counts the
    key and value bytes, ``done_at`` the time each layer's send completed.
    """

    def __init__(self, dst: int, link_gb_s: float | None = None) -> None:
        if link_gb_s is not None and not link_gb_s > 0:
            raise ValueError(f"link_gb_s must be a positive rate in GB/s or None, got {link_gb_s!r}")
        self.dst, self.rate = dst, link_gb_s
        self.sent_bytes = 0
        self.done_at: list[float] = []
        self._todo: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._todo.put((layer, k.contiguous().clone(), v.contiguous().clone()))  # (1, H_kv, T, D) each

    def _run(self) -> None:
        try:
            while (item := self._todo.get()) is not None:
                _, k, v = item
                nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
                if self.rate is not None:
                    time.sleep(nbytes / (self.rate * 1e9))  # the emulated wire's time for these bytes
                dist.send(k, self.dst)
                dist.send(v, self.dst)
                self.sent_bytes += nbytes
                self.done_at.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - re-raised by finish()
            self._error = e

    def finish(self, timeout: float = 120.0) -> None:
        """Wait (at most ``timeout`` s) until every queued layer is sent; re-raise a send's error."""
        self._todo.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"layers still unsent after {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError("sending the cache failed") from self._error


def _hooks(model: Transformer, cache: StaticCache, sender: LayerSender):
    """One hook per attention layer: send its keys and values once it has run."""
    def after(layer: int):
        def hook(module, inputs, output):
            k, v = cache.layer_kv(layer)  # (1, H_kv, T, D): what this layer just wrote
            sender.put(layer, k, v)
        return hook
    return [block.attn.register_forward_hook(after(i)) for i, block in enumerate(model.layers)]


@torch.inference_mode()
def prefill_worker(model: Transformer, prompt: list[int], n_new: int, overlap: bool,
                   link_gb_s: float | None, arrived: float) -> dict:
    """Rank 0: prefill ``prompt``, send the cache (by layer, or after) and the first token."""
    dist.send(torch.tensor([arrived], dtype=torch.float64), DECODE)  # one clock for both sides
    cache = StaticCache.for_model(model.config, 1, len(prompt) + n_new)
    sender = LayerSender(DECODE, link_gb_s)
    handles = _hooks(model, cache, sender) if overlap else []
    try:
        logits = prefill(model, torch.tensor([prompt]), cache)  # (1, vocab)
    finally:
        for h in handles:
            h.remove()
    computed = time.monotonic()
    if not overlap:  # the whole prefill first, then every layer
        for layer in range(model.config.n_layer):
            sender.put(layer, *cache.layer_kv(layer))
    sender.finish()
    first = logits.argmax(-1)  # (1,)
    dist.send(first, DECODE)
    return {"prefill_s": computed - arrived, "sent_bytes": sender.sent_bytes,
            "layer_sent_s": [t - arrived for t in sender.done_at], "first": int(first)}


@torch.inference_mode()
def decode_worker(model: Transformer, prompt: list[int], n_new: int) -> dict:
    """Rank 1: receive every layer's keys and values and the first token, then decode."""
    cfg = model.config
    arrived = torch.empty(1, dtype=torch.float64)
    dist.recv(arrived, PREFILL)  # when the request reached the prefill worker
    arrived = float(arrived)
    cache = StaticCache.for_model(cfg, 1, len(prompt) + n_new)
    shape = (1, cfg.n_kv_head, len(prompt), cfg.head_dim)
    received = 0
    for layer in range(cfg.n_layer):
        k, v = torch.empty(shape), torch.empty(shape)
        dist.recv(k, PREFILL)
        dist.recv(v, PREFILL)
        cache.update(k, v, layer)  # exactly the bits the prefill worker computed
        received += k.numel() * k.element_size() + v.numel() * v.element_size()
    first = torch.empty(1, dtype=torch.long)
    dist.recv(first, PREFILL)
    ready = time.monotonic()
    rest = generate(model, [int(first)], n_new - 1, cache=cache)[0, 1:].tolist() if n_new > 1 else []
    return {"ttft_s": ready - arrived, "received_bytes": received, "tokens": [int(first)] + rest,
            "cache_bytes": cache.nbytes}


def worker(rank: int, size: int, source, prompt: list[int], n_new: int,
           trials: list[tuple[bool, float | None]] = ((True, None),)) -> list[dict]:
    """One side of a disaggregated request, once per trial (for `kvlib.distributed.launch`, size 2).

    ``trials``: ``(overlap, link_gb_s)`` pairs, run one after another on the same loaded
    model. Before each, both ranks meet at a barrier, so neither model loading nor the
    previous trial is counted. Rank 0 prefills and sends, rank 1 receives and decodes.
    """
    if size != 2:
        raise ValueError(f"disaggregation here is one prefill and one decode process: size 2, got {size}")
    model = build(source)
    out = []
    for overlap, link_gb_s in trials:
        dist.barrier()
        if rank == PREFILL:
            out.append(prefill_worker(model, prompt, n_new, bool(overlap), link_gb_s, time.monotonic()))
        else:
            out.append(decode_worker(model, prompt, n_new))
    return out
