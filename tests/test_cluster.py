"""kvlib.distributed.cluster: the arithmetic of moving a cache at cluster scale.

Expected values are worked out here from the definitions (spec-sheet rates, head counts, the
cache formula), not copied from the module's output; the layer-wise pipeline is checked against
hand cases and against a tick-by-tick simulation of a compute unit and a link.
"""

import random

import pytest

from kvlib import PRESETS
from kvlib.config import ModelConfig
from kvlib.distributed import cluster
from kvlib.hardware import HARDWARE
from kvlib.layers import latent

pytestmark = pytest.mark.cpu_only("pure Python: formulas, tables and simulations with no tensors on a device")

LLAMA70, DSV3, MISTRAL, TINY = (PRESETS[n] for n in ("llama-3-70b", "deepseek-v3", "mistral-7b",
                                                      "tiny"))


# -- links ----------------------------------------------------------------------------------------
def test_links_are_one_way_rates_from_their_spec_sheets():
    assert cluster.NVLINK_4.bandwidth == 450e9  # 900 GB/s counts both directions
    assert cluster.INFINIBAND_NDR.bandwidth == 50e9  # 400 Gb/s / 8 bits
    assert cluster.PCIE_5_X16.bandwidth == pytest.approx(63.015e9, rel=1e-4)  # 512 GT/s * 128/130 / 8
    assert cluster.ETHERNET_100G.bandwidth == 12.5e9
    assert cluster.NVME_SSD.bandwidth == 7e9
    assert all(link.source for link in cluster.LINKS)
    assert len({link.name for link in cluster.LINKS}) == len(cluster.LINKS)


def test_transfer_time_is_bytes_over_bandwidth_times_lanes():
    gb = 335_544_320  # one Llama-3-70B rank's 8k-token shard (below)
    assert cluster.transfer_time(gb, cluster.INFINIBAND_NDR) == pytest.approx(6.7108864e-3)
    assert cluster.transfer_time(gb, cluster.NVME_SSD, lanes=4) == pytest.approx(gb / 28e9)
    assert cluster.transfer_time(0, cluster.NVLINK_4) == 0


@pytest.mark.parametrize("bad", [
    lambda: cluster.transfer_time(-1, cluster.NVME_SSD),
    lambda: cluster.transfer_time(10, cluster.NVME_SSD, lanes=0),
    lambda: cluster.Link("x", 0, "s"),
    lambda: cluster.Link("x", 1e9, ""),
])
def test_bad_link_input_is_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_transfer_time_wants_a_link():
    with pytest.raises(TypeError, match="Link"):
        cluster.transfer_time(10, 50e9)


# -- shards ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv,tp,heads,replicas", [
    (8, 1, 8, 1), (8, 2, 4, 1), (8, 8, 1, 1),  # split
    (8, 16, 1, 2), (2, 4, 1, 2), (1, 8, 1, 8),  # replicated: tp a multiple of the heads
    (3, 3, 1, 1),  # SmolLM2 at tp 3
])
def test_kv_heads_per_rank_split_then_replicate(n_kv, tp, heads, replicas):
    assert cluster.kv_heads_per_rank(n_kv, tp) == heads
    assert cluster.kv_head_replicas(n_kv, tp) == replicas


@pytest.mark.parametrize("n_kv,tp", [(8, 3), (8, 12), (3, 2), (2, 3), (6, 4)])
def test_sizes_vllm_refuses_are_refused(n_kv, tp):
    with pytest.raises(ValueError, match=f"{tp}"):
        cluster.kv_heads_per_rank(n_kv, tp)


def test_llama_shard_is_its_kv_heads_share_until_heads_replicate():
    # 2 (K, V) * 80 layers * 1 head * 128 dims * 8,192 tokens * 2 bytes (bf16)
    one_head = 2 * 80 * 1 * 128 * 8192 * 2
    assert cluster.shard_bytes(LLAMA70, 8192, 8, dtype="bf16") == one_head == 335_544_320
    assert cluster.shard_bytes(LLAMA70, 8192, 2, dtype="bf16") == 4 * one_head
    assert cluster.shard_bytes(LLAMA70, 8192, 1, dtype="bf16") == 8 * one_head
    # 16 ranks, 8 heads: each rank still holds one head, so the shard stops shrinking
    assert cluster.shard_bytes(LLAMA70, 8192, 16, dtype="bf16") == one_head
    assert cluster.shard_bytes(LLAMA70, 8192, 8, batch=3, dtype="fp8") == 3 * one_head // 2


def test_mla_latent_is_replicated_on_every_rank():
    # 61 layers * (512 + 64) numbers * 4,096 tokens * 2 bytes, on each of the ranks
    whole = 61 * 576 * 4096 * 2
    for tp in (1, 2, 8, 16):
        assert cluster.shard_bytes(DSV3, 4096, tp, dtype="bf16") == whole


def test_shards_follow_each_layers_kind():
    # Mistral: every layer a 4,096-token window; at 8,192 tokens it holds 4,096; 8 KV heads / 4 ranks
    assert cluster.shard_bytes(MISTRAL, 8192, 4, dtype="bf16") == 32 * 2 * 2 * 128 * 4096 * 2
    # one full layer of 2 KV heads (16 dims) and one latent(24) layer, 10 tokens, 4 bytes, tp 2
    mixed = TINY.replace(layers=(TINY.layer_kinds()[0], latent(24)), family="shapes")
    assert cluster.shard_bytes(mixed, 10, 2, dtype="fp32") == 2 * 1 * 16 * 10 * 4 + 24 * 10 * 4


def test_query_heads_must_divide_too():
    cfg = ModelConfig(n_layer=1, n_head=6, n_kv_head=2, d_model=48, d_ff=64, vocab_size=10,
                      max_seq_len=16)
    assert cluster.kv_heads_per_rank(2, 4) == 1  # the KV heads alone would allow 4 ranks
    with pytest.raises(ValueError, match="6 query heads"):
        cluster.shard_bytes(cfg, 8, 4)
    with pytest.raises(ValueError, match="3 does not divide the 8 KV heads"):
        cluster.shard_bytes(LLAMA70.replace(n_head=48), 8, 3)


# -- prefill --------------------------------------------------------------------------------------
def test_prefill_flops_of_a_llama_from_its_shapes():
    # tiny: per block d*(H+2Hkv)*D + H*D*d + d*2ff + ff*d = 8192 + 4096 + 16384 + 8192 = 36,864
    body = 2 * 2 * 36_864  # 2 FLOPs per weight, 2 blocks
    head = 2 * 64 * 128  # lm_head on the last token only
    attention = 2 * 2 * 2 * 4 * 16 * (1 + 2 + 3)  # q.k and p.v, 2 layers, 4 heads, 16 dims
    assert cluster.prefill_flops(TINY, 3) == 3 * body + head + attention == 461_824


def test_prefill_flops_with_active_params_for_a_shapes_preset():
    # 2 * 1,000 * 3 matmul + 2 * (2 * 16) * 2 layers * 4 heads * (1 + 2 + 3) keys
    assert cluster.prefill_flops(TINY, 3, active_params=1000) == 6000 + 3072
    assert cluster.prefill_flops(TINY, 3, active_params=1000, attention_width=48) == 6000 + 4608
    with pytest.raises(ValueError, match="active_params"):
        cluster.prefill_flops(DSV3, 1024)
    with pytest.raises(ValueError, match="attention_width"):
        cluster.prefill_flops(TINY, 3, attention_width=48)


def test_prefill_time_is_flops_over_gpus_efficiency_and_peak():
    h100 = HARDWARE["h100"]
    assert cluster.prefill_time(TINY, h100, 3, 0.5) == pytest.approx(461_824 / (0.5 * 989.4e12))
    assert cluster.prefill_time(TINY, h100, 3, 0.5, gpus=8) == pytest.approx(
        461_824 / (8 * 0.5 * 989.4e12))
    fp8 = cluster.prefill_time(DSV3, h100, 3, 0.4, dtype="fp8", active_params=1000)
    assert fp8 == pytest.approx((6000 + 2 * 256 * 61 * 128 * 6) / (0.4 * 1978.9e12))
    lo, hi = cluster.EFFICIENCY_BAND
    assert 0 < lo < hi < 1


@pytest.mark.parametrize("eff", [1.0, 1.2, 0, -0.5])
def test_a_prefill_at_or_beyond_peak_is_refused(eff):
    with pytest.raises(ValueError, match="100%"):
        cluster.prefill_time(TINY, HARDWARE["h100"], 8, eff)


def test_prefill_time_wants_hardware():
    with pytest.raises(TypeError, match="Hardware"):
        cluster.prefill_time(TINY, "h100", 8, 0.5)


# -- layer-wise overlap ---------------------------------------------------------------------------
def simulate(compute: list[int], send: list[int]) -> int:
    """Tick by tick: a compute unit works through the layers in order, and a link sends each
    finished layer in order, one at a time. Returns the tick at which the last send ends."""
    c_left, s_left = list(compute), list(send)
    ready = nxt = finished = t = 0
    active = None
    while finished < len(compute):
        if active is None and nxt < ready:
            active, nxt = nxt, nxt + 1
        if ready < len(compute):
            c_left[ready] -= 1
        if active is not None:
            s_left[active] -= 1
        t += 1
        if ready < len(compute) and c_left[ready] == 0:
            ready += 1
        if active is not None and s_left[active] == 0:
            finished, active = finished + 1, None
    return t


@pytest.mark.parametrize("compute,send,finish", [
    ([1, 1, 1], [2, 2, 2], 7),  # the link is the bottleneck: c + L*s
    ([3, 3], [1, 1], 7),  # the link keeps up: the prefill (6) + the last layer's send
    ([1, 5], [4, 1], 7),  # layer 1 waits for its compute, not for the link
    ([2], [5], 7),  # one layer: nothing to overlap
])
def test_pipeline_hand_cases(compute, send, finish):
    assert cluster.pipeline_finish(compute, send) == finish
    assert simulate(compute, send) == finish


def test_pipeline_matches_a_tick_simulation():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 8)
        compute = [rng.randint(1, 6) for _ in range(n)]
        send = [rng.randint(1, 6) for _ in range(n)]
        assert cluster.pipeline_finish(compute, send) == simulate(compute, send), (compute, send)


def test_exposed_transfer_closed_form_equals_the_pipeline():
    rng = random.Random(1)
    for _ in range(300):
        L, prefill, transfer = rng.randint(1, 100), rng.uniform(0, 2), rng.uniform(0, 2)
        finish = cluster.pipeline_finish([prefill / L] * L, [transfer / L] * L)
        assert cluster.exposed_transfer(prefill, transfer, L) == pytest.approx(finish - prefill,
                                                                               abs=1e-12)
        assert cluster.exposed_transfer(prefill, transfer, L, layerwise=False) == transfer


def test_exposed_transfer_hand_values():
    # 80 layers; transfer 40 ms, prefill 800 ms: the link keeps up, one layer (0.5 ms) shows
    assert cluster.exposed_transfer(0.8, 0.04, 80) == pytest.approx(0.0005)
    # transfer 1.6 s against a 0.8 s prefill: 1.6 - 0.8 * 79/80 = 0.81 s shows
    assert cluster.exposed_transfer(0.8, 1.6, 80) == pytest.approx(0.81)


@pytest.mark.parametrize("bad", [
    lambda: cluster.pipeline_finish([1, 2], [1]),
    lambda: cluster.pipeline_finish([], []),
    lambda: cluster.pipeline_finish([1, -1], [1, 1]),
    lambda: cluster.exposed_transfer(-1.0, 1.0, 4),
    lambda: cluster.exposed_transfer(1.0, 1.0, 0),
])
def test_bad_pipeline_input_is_refused(bad):
    with pytest.raises(ValueError):
        bad()
