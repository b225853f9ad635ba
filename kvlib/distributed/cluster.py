"""The arithmetic of moving a KV cache at cluster scale: links, prefill time, shards, overlap.

Past one GPU a cache is bytes on a wire. Whether moving it pays is one comparison::

    moving it    bytes / one-way link bandwidth            (a floor: links run below their rate)
    making it    prefill FLOPs / (GPUs * efficiency * peak FLOP/s)

Three things decide the answer, and each is easy to get wrong:

* **one way, not both.** A cache moves in one direction. NVLink 4's "900 GB/s" is both
  directions of an H100's 18 links added together: 450 GB/s each way.
* **no prefill runs at peak.** A real prefill attains a fraction of the spec sheet's FLOP/s;
  `EFFICIENCY_BAND` is the assumption this module states (40-65%), and `prefill_time`
  refuses 100%. Comparing a link with a prefill at peak makes the prefill look faster than
  it is, and can flip the verdict.
* **per rank, and layer by layer.** Under tensor parallelism each GPU holds and sends only its
  KV heads (`shard_bytes`), over its own link, except where heads or MLA's latent are
  replicated. A prefill worker can send each layer as soon as it is computed, hiding most of
  the transfer behind the layers still to compute (`pipeline_finish`, `exposed_transfer`).

Sizes come from `kvlib.memory`, FLOPs from `kvlib.cost`, peaks from `kvlib.hardware`.
Bandwidths are bytes/s in decimal units (1 GB/s = 1e9 bytes/s), as the spec sheets give them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import cost, memory
from ..config import ModelConfig
from ..hardware import Hardware
from ..validate import int_at_least, positive_int


@dataclass(frozen=True)
class Link:
    """A link a cache can cross, at its nominal rate in **one** direction (bytes/s)."""

    name: str
    bandwidth: float
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.bandwidth, (int, float)) or isinstance(self.bandwidth, bool) \
                or not self.bandwidth > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be a positive number of bytes/s, "
                             f"got {self.bandwidth!r}")
        if not self.source:
            raise ValueError(f"Link {self.name!r} needs a source for its bandwidth")


# -- the links, one way ---------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (SXM): "NVLink: 900GB/s". That is 18 NVLink 4 links of
# 50 GB/s each, counting both directions (25 GB/s each way per link): 450 GB/s each way.
NVLINK_4 = Link("NVLink 4, H100 SXM", 900e9 / 2,
                "NVIDIA H100 datasheet: 900 GB/s is both directions of 18 links; half each way")
# InfiniBand NDR (IBTA roadmap; NVIDIA ConnectX-7): 400 Gb/s per 4x port, per direction, = 50 GB/s.
# A DGX H100 has eight such ports for its compute fabric, one per GPU (DGX H100 user guide).
INFINIBAND_NDR = Link("InfiniBand NDR, one 400 Gb/s port", 400e9 / 8,
                      "IBTA roadmap / NVIDIA ConnectX-7: NDR is 400 Gb/s per port, each way")
# PCIe 5.0 (PCI-SIG): 32 GT/s per lane with 128b/130b encoding, 16 lanes, each direction:
# 32e9 * 16 * 128/130 / 8 = 63.0 GB/s ("about 64 GB/s"), GPU to and from CPU memory.
PCIE_5_X16 = Link("PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8,
                  "PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b encoding, x16, each way")
# 100 Gb/s Ethernet (IEEE 802.3 100GBASE): 12.5 GB/s each way, before TCP's own overheads.
ETHERNET_100G = Link("Ethernet, 100 Gb/s", 100e9 / 8, "IEEE 802.3 100 Gb/s Ethernet, each way")
# One NVMe SSD on PCIe 4.0 x4: sequential reads of about 7 GB/s (Samsung 990 PRO datasheet:
# 7,450 MB/s; rounded down). A DGX H100 holds eight 3.84 TB NVMe U.2 drives for data (its
# datasheet), read in parallel with `transfer_time(..., lanes=n)`.
NVME_SSD = Link("NVMe SSD, PCIe 4.0 x4, one drive", 7e9,
                "Samsung 990 PRO datasheet: 7,450 MB/s sequential read, rounded down")
LINKS = (NVLINK_4, INFINIBAND_NDR, PCIE_5_X16, ETHERNET_100G, NVME_SSD)

# -- how much of its peak a prefill attains: an assumption, stated ---------------------------------
# Llama 3's training reached 38-43% of the H100's bf16 peak over a whole model (Llama 3 paper,
# arXiv 2407.21783, Table 4); FlashAttention-3 reaches about 75% in attention alone (arXiv
# 2407.08608). A long prefill is one large forward with no backward and no pipeline bubbles, so we
# carry 40% (slow) to 65% (good) and never 100%, the roofline's bound that no prefill reaches.
EFFICIENCY_BAND = (0.40, 0.65)


def transfer_time(nbytes: int, link: Link, lanes: int = 1) -> float:
    """Seconds to move ``nbytes`` one way over ``lanes`` copies of ``link`` used in parallel
    (8 GPUs each on its own InfiniBand port, or 4 NVMe drives read at once): a floor, at the
    links' nominal rate.

    Example

    >>> from kvlib.distributed import cluster
    >>> nbytes = kvlib.memory.kv_cache_bytes(kvlib.PRESETS["llama-3-8b"], 8192, dtype="fp16")  # 1 GiB
    >>> round(cluster.transfer_time(nbytes, cluster.INFINIBAND_NDR) * 1e3, 1)  # ms at 50 GB/s
    21.5
    >>> round(cluster.transfer_time(nbytes, cluster.NVME_SSD, lanes=4) * 1e3, 1)  # four drives at 7 GB/s
    38.3
    """
    int_at_least("nbytes", nbytes, 0)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link, got {type(link).__name__}")
    positive_int("lanes", lanes)
    return nbytes / (link.bandwidth * lanes)


# -- per-rank shards under tensor parallelism ------------------------------------------------------
def kv_heads_per_rank(n_kv_head: int, tp: int) -> int:
    """KV heads one rank holds at tensor-parallel size ``tp``, by vLLM's rule.

    ``tp <= n_kv_head``: the heads are split, ``n_kv_head / tp`` each (``tp`` must divide them).
    ``tp > n_kv_head``: each rank still needs a KV head for its query heads, so every head is
    replicated on ``tp / n_kv_head`` ranks and each rank holds 1 (``n_kv_head`` must divide
    ``tp``). Any other pair is refused, as vLLM's ``LlamaAttention`` refuses it (vLLM 0.32,
    ``vllm/model_executor/models/llama.py``; ``QKVParallelLinear`` in ``layers/linear.py``).
    """
    positive_int("n_kv_head", n_kv_head)
    positive_int("tp", tp)
    if tp <= n_kv_head:
        if n_kv_head % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the {n_kv_head} KV heads: "
                             "each rank must hold the same number of whole heads")
        return n_kv_head // tp
    if tp % n_kv_head:
        raise ValueError(f"tensor-parallel size {tp} exceeds the {n_kv_head} KV heads but is not a "
                         "multiple of them: the heads cannot be replicated evenly over the ranks")
    return 1


def kv_head_replicas(n_kv_head: int, tp: int) -> int:
    """On how many ranks each KV head lives: 1 while ``tp <= n_kv_head``, else ``tp / n_kv_head``."""
    return tp * kv_heads_per_rank(n_kv_head, tp) // n_kv_head


def shard_bytes(config: ModelConfig, seq_len: int, tp: int, batch: int = 1,
                dtype: memory.DType = None) -> int:
    """Cache bytes one rank holds at tensor-parallel size ``tp`` (and sends, in disaggregation).

    A layer of K/V heads keeps `kv_heads_per_rank` of its ``n_kv_head`` heads on each rank. An MLA
    layer's latent is one vector per token shared by all heads, so it cannot be split by head:
    every rank keeps all of it, and its per-rank bytes do not shrink with ``tp``. That is why
    SGLang and vLLM run DeepSeek's attention data-parallel (each request's latent on one rank)
    instead of tensor-parallel. Query heads must divide too (``n_head % tp == 0``), as in vLLM.
    ``dtype`` is `kvlib.memory`'s (default: a kvlib model's fp32; a served model's is ``"bf16"``).
    """
    memory.check_config(config)
    positive_int("tp", tp)
    if config.n_head % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the {config.n_head} query "
                         "heads: each rank must hold the same number of whole heads")
    per_rank = kv_heads_per_rank(config.n_kv_head, tp)
    total = 0
    for kind, nbytes in zip(config.layer_kinds(), memory.kv_bytes_by_layer(config, seq_len, batch,
                                                                          dtype)):
        # K/V layers' bytes are a multiple of n_kv_head: the division is exact
        total += nbytes if kind.kind == "latent" else nbytes * per_rank // config.n_kv_head
    return total


# -- prefill time ----------------------------------------------------------------------------------
def prefill_flops(config: ModelConfig, tokens: int, active_params: int | None = None,
                  attention_width: int | None = None) -> int:
    """FLOPs of prefilling ``tokens`` tokens from an empty cache::

        2 * matmul params * tokens  +  2 * attention_width * n_layer * n_head * T(T+1)/2

    For a Llama-family config this is `kvlib.cost.step_flops` (its lm_head on the last token
    only). A ``"shapes"`` preset (DeepSeek-V3: MLA and mixture-of-experts) has no block kvlib
    counts, so pass ``active_params``, the weights one token is multiplied by (DeepSeek-V3: 37B
    of its 671B), and ``attention_width``, the q.k width plus the p.v width of one head
    (DeepSeek-V3: 192 + 128; default ``2 * head_dim``).
    """
    memory.check_config(config)
    positive_int("tokens", tokens)
    if active_params is None:
        if config.family != "llama":
            raise ValueError(f"{config.name or 'this model'} is a {config.family!r} preset: kvlib does "
                             "not count its weights, so pass active_params (weights per token)")
        if attention_width is not None:
            raise ValueError("attention_width goes with active_params; a Llama's is 2 * head_dim")
        return cost.step_flops(config, 1, 0, tokens)["total"]
    positive_int("active_params", active_params)
    width = 2 * config.head_dim if attention_width is None else positive_int("attention_width",
                                                                             attention_width)
    keys = tokens * (tokens + 1) // 2  # token i attends to i + 1 keys
    return 2 * active_params * tokens + 2 * width * config.n_layer * config.n_head * keys


def prefill_time(config: ModelConfig, hw: Hardware, tokens: int, efficiency: float, *,
                 dtype: str = "bf16", gpus: int = 1, active_params: int | None = None,
                 attention_width: int | None = None) -> float:
    """Seconds to prefill ``tokens`` tokens on ``gpus`` GPUs of ``hw`` (tensor-parallel), each
    attaining ``efficiency`` of its ``dtype`` peak: ``prefill_flops / (gpus * efficiency * peak)``.

    A long prefill is compute-bound, so FLOPs set its time; the all-reduces of tensor parallelism
    are left out (over NVLink they are small beside the matmuls). ``efficiency`` must lie in
    (0, 1): no prefill runs at its peak (`EFFICIENCY_BAND` is this module's assumption), and the
    peak's bare bound is `kvlib.hardware.step_time`'s.
    """
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a Hardware, got {type(hw).__name__}")
    if not isinstance(efficiency, (int, float)) or isinstance(efficiency, bool) \
            or not 0 < efficiency < 1:
        raise ValueError(f"efficiency must be a fraction of peak in (0, 1), got {efficiency!r}: no "
                         "prefill runs at 100% of peak (EFFICIENCY_BAND states kvlib's assumption)")
    positive_int("gpus", gpus)
    flops = prefill_flops(config, tokens, active_params, attention_width)
    return flops / (gpus * efficiency * hw.peak(dtype))


# -- sending the cache layer by layer, overlapped with the prefill ---------------------------------
def pipeline_finish(compute: Sequence[float], send: Sequence[float]) -> float:
    """When the last layer's cache has arrived, if each layer is sent as soon as it is computed.

    Layer ``i`` is computed after layers ``0..i-1`` (done at ``sum(compute[:i+1])``); its send
    starts when it is computed *and* the link has finished layer ``i-1``, and takes ``send[i]``::

        end[i] = max(sum(compute[:i+1]), end[i-1]) + send[i]

    Sent after the whole prefill instead, the last byte arrives at ``sum(compute) + sum(send)``.
    """
    if len(compute) != len(send) or not compute:
        raise ValueError(f"compute and send need one time per layer, got {len(compute)} and "
                         f"{len(send)}")
    if min(compute) < 0 or min(send) < 0:
        raise ValueError("layer times must be >= 0")
    done = end = 0.0
    for c, s in zip(compute, send):
        done += c
        end = max(done, end) + s
    return end


def exposed_transfer(prefill: float, transfer: float, n_layer: int, layerwise: bool = True) -> float:
    """Seconds the decode side waits for the cache after the prefill ends, for ``n_layer`` equal
    layers (each ``prefill / L`` to compute, ``transfer / L`` to send).

    Sent after the prefill, all of ``transfer`` is exposed. Sent layer by layer, only the last
    layer's send is exposed while the link keeps up (``s <= c``); when it cannot, each layer adds
    the difference, so the exposed time is, exactly (`pipeline_finish` with equal layers)::

        s + (L - 1) * max(0, s - c)  =  max(s, transfer - prefill * (L - 1) / L)
    """
    positive_int("n_layer", n_layer)
    if prefill < 0 or transfer < 0:
        raise ValueError(f"prefill and transfer must be >= 0 seconds, got {prefill!r}, {transfer!r}")
    if not layerwise:
        return transfer
    c, s = prefill / n_layer, transfer / n_layer
    return s + (n_layer - 1) * max(0.0, s - c)
