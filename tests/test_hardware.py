"""The roofline model: byte and FLOP counts against hand counts, the presets, and bad input."""

import math

import pytest
import torch

from kvlib import PRESETS, Transformer, cost, memory
from kvlib.hardware import (
    GPT_FAST_A100, HARDWARE, Hardware, StepTime, fast_dtype, fastest, measure, step_time,
)

pytestmark = pytest.mark.cpu_only("about the CPU: threads, AMX, oneDNN")

SMALL = [
    PRESETS["tiny"],  # MHA, untied embeddings
    PRESETS["tiny"].replace(n_kv_head=2, tie_embeddings=True),  # GQA, tied
    PRESETS["smollm2-135m"],
]


def hand_bytes(c, batch, context, new, width):
    """Count from the model's own parameters and the cache's own tensors, not from kvlib.memory."""
    model = Transformer(c, device="meta")
    weights = sum(p.numel() for p in model.parameters())
    if not c.tie_embeddings:  # the embedding table is only looked up: one row per new token
        weights -= c.vocab_size * c.d_model
        weights += batch * new * c.d_model
    per_token = 0
    for _ in range(c.n_layer):
        per_token += 2 * c.n_kv_head * c.head_dim  # one key and one value vector per KV head
    return weights * width, batch * context * per_token * width, batch * new * per_token * width


def hand_flops(c, batch, context, new):
    """Walk every new token of every sequence through every Linear of the model."""
    model = Transformer(c, device="meta")
    body = sum(2 * m.weight.shape[0] * m.weight.shape[1] for name, m in model.named_modules()
               if type(m).__name__ == "Linear" and name != "lm_head")
    head = 2 * c.d_model * c.vocab_size
    matmul = attention = 0
    for _ in range(batch):
        for i in range(new):
            matmul += body
            keys = context + i + 1
            attention += c.n_layer * c.n_head * (2 * c.head_dim * keys + 2 * keys * c.head_dim)  # q.k, then p.v
        matmul += head  # logits for the last new token only
    return matmul, attention


@pytest.mark.parametrize("c", SMALL, ids=lambda c: c.name)
@pytest.mark.parametrize("batch,context,new", [(1, 0, 1), (3, 17, 1), (2, 0, 9), (1, 5, 4)])
@pytest.mark.parametrize("dtype,width", [("fp32", 4), ("fp16", 2)])
def test_step_bytes_and_flops_equal_hand_counts(c, batch, context, new, dtype, width):
    b = cost.step_bytes(c, batch, context, new, dtype)
    assert (b["weights"], b["kv_read"], b["kv_write"]) == hand_bytes(c, batch, context, new, width)
    assert b["total"] == b["weights"] + b["kv_read"] + b["kv_write"]
    f = cost.step_flops(c, batch, context, new)
    assert (f["matmul"], f["attention"]) == hand_flops(c, batch, context, new)


@pytest.mark.parametrize("c", SMALL, ids=lambda c: c.name)
def test_step_counts_agree_with_memory_and_the_older_cost_functions(c):
    assert cost.step_bytes(c, 1, 40)["total"] == cost.decode_bytes_per_token(c, 40)
    assert cost.step_bytes(c, 4, 40, dtype="fp16")["total"] == cost.decode_bytes_per_token(c, 40, batch=4, dtype="fp16")
    assert cost.step_bytes(c, 3, 40, dtype="fp32")["kv_read"] == memory.kv_cache_bytes(c, 40, 3, "fp32")
    assert cost.step_flops(c, 1, 0, 12)["total"] == cost.cached_flops(c, 12, 1)  # a prefill
    assert cost.step_flops(c, 1, 30)["total"] == cost.flops_per_token(c, 31)  # a decode step


def test_intensity_of_matmuls_grows_with_batch_and_of_attention_does_not():
    c = PRESETS["smollm2-135m"]
    for batch in (1, 8, 64):
        i = cost.intensity(c, batch, 1000, dtype="fp16")
        # every sequence reads its own cache: 2 FLOPs per element per query head sharing it
        assert i["attention"] == pytest.approx(2 * c.n_rep / 2)
        # each weight is read once and used by every row; the norms dilute it by < 0.1%
        assert i["matmul"] == pytest.approx(2 * batch / 2, rel=1e-3)


def test_crossover_is_where_the_cache_read_equals_the_weights():
    c = PRESETS["smollm2-135m"]
    for batch in (1, 8):
        s = cost.crossover_context(c, batch)
        b = cost.step_bytes(c, batch, round(s))
        assert b["kv_read"] == pytest.approx(b["weights"], rel=1e-3)
    # the figures the chapter quotes: 46 KB/token against 540 MB of fp32 weights
    assert memory.kv_bytes_per_token(c, "fp32") == 46080
    assert 11_000 < cost.crossover_context(c, 1) < 12_500
    assert cost.crossover_context(c, 8) == pytest.approx(cost.crossover_context(c, 1) / 8)


@pytest.mark.parametrize("key", sorted(HARDWARE))
def test_every_preset_has_a_source_and_positive_numbers(key):
    hw = HARDWARE[key]
    assert hw.source and hw.name
    assert hw.mem_bandwidth > 0 and hw.memory > 0 and all(v > 0 for v in hw.peak_flops.values())
    for dt, peak in hw.peak_flops.items():
        assert hw.ridge(dt) == peak / hw.mem_bandwidth
        assert hw.attainable(hw.ridge(dt) / 2, dt) == pytest.approx(peak / 2)
        assert hw.attainable(hw.ridge(dt) * 2, dt) == peak


def test_hbm_capacities_are_binary():
    """An "80 GB" H100 has 80 GiB of HBM, 85.9e9 bytes: the sheets' GB is binary for memory."""
    assert HARDWARE["h100"].memory == HARDWARE["a100"].memory == 80 * 2**30
    assert HARDWARE["h200"].memory == 141 * 2**30
    assert round(HARDWARE["h100"].memory / 1e9, 1) == 85.9


def test_a_preset_predicts_the_ideal_roofline():
    c, hw = PRESETS["llama-3-8b"], HARDWARE["h100"]
    b, f = cost.step_bytes(c, 1, 1000, dtype="fp16"), cost.step_flops(c, 1, 1000)
    t = step_time(c, hw, 1, 1000, dtype="fp16")
    assert isinstance(t, StepTime) and t.overhead == 0
    # batch 1 is far below the ridge: time is bytes over bandwidth, part by part
    assert t.memory_bound
    assert t.total == pytest.approx(b["total"] / hw.mem_bandwidth)
    assert t.bound == pytest.approx(b["total"] / hw.mem_bandwidth)
    # a huge prefill is compute-bound: its matmuls run at the peak
    big = step_time(c, hw, 8, 0, 4096, dtype="fp16")
    assert not big.memory_bound
    assert big.matmul == pytest.approx(cost.step_flops(c, 8, 0, 4096)["matmul"] / hw.peak("fp16"))
    assert f["total"] / b["total"] < hw.ridge("fp16") < big.intensity


def test_measured_curves_interpolate_in_log_rows():
    hw = Hardware("fake", 1e9, {"fp32": 100.0}, 1e9, "a test", matmul_rows={1: 10.0, 4: 40.0},
                  attention_rows={1: 5e8, 4: 8e8})
    assert hw.matmul_flops(1, "fp32") == 10.0
    assert hw.matmul_flops(2, "fp32") == pytest.approx(25.0)  # log-midpoint of 1 and 4
    assert hw.matmul_flops(64, "fp32") == 40.0  # flat past the last point
    assert hw.attention_bandwidth(2) == pytest.approx(6.5e8)
    assert HARDWARE["t4"].attention_bandwidth(8) == HARDWARE["t4"].mem_bandwidth


def test_bad_input_gets_a_clear_error():
    c = PRESETS["smollm2-135m"]
    with pytest.raises(ValueError, match="batch"):
        cost.step_bytes(c, -1, 10)
    with pytest.raises(ValueError, match="context"):
        step_time(c, HARDWARE["t4"], 1, -5)
    with pytest.raises(ValueError, match="new_tokens"):
        cost.step_flops(c, 1, 10, 0)
    with pytest.raises(ValueError, match="dtype"):
        step_time(c, HARDWARE["t4"], dtype="fp64")
    with pytest.raises(ValueError, match=r"no peak for 'bf16'.*'fp16'"):
        step_time(c, HARDWARE["t4"], dtype="bf16")  # the T4 has no bf16 units
    with pytest.raises(TypeError, match="Hardware"):
        step_time(c, "t4")
    with pytest.raises(ValueError, match="source"):
        Hardware("x", 1e9, {"fp16": 1e12}, 1e9, "")
    with pytest.raises(ValueError, match="mem_bandwidth"):
        Hardware("x", -1.0, {"fp16": 1e12}, 1e9, "spec")
    with pytest.raises(ValueError, match="dtype"):
        Hardware("x", 1e9, {"fp64": 1e12}, 1e9, "spec")
    with pytest.raises(ValueError, match="measure"):
        measure(None, "int8")


def test_measure_profiles_this_machine():
    torch.manual_seed(0)
    c = PRESETS["tiny"]
    hw = measure(c, "fp32", nbytes=2**22, rows=(1, 2), repeats=1)
    assert set(hw.matmul_rows) == {1, 2} and set(hw.attention_rows) == {1, 2}
    assert hw.mem_bandwidth == pytest.approx(hw.matmul_rows[1] * 4 / 2)
    assert hw.overhead >= 0 and hw.overhead_per_row >= 0 and hw.overhead + hw.overhead_per_row > 0
    assert hw.peak("fp32") >= max(hw.matmul_rows.values())
    t = step_time(c, hw, 2, 10, dtype="fp32")
    assert math.isfinite(t.total) and t.total > t.overhead > 0


def test_a_quantized_cache_moves_fewer_bytes_but_the_same_weights():
    c = PRESETS["llama-2-7b"]
    full, q4 = cost.step_bytes(c, 4, 2000, dtype="fp16"), cost.step_bytes(c, 4, 2000, dtype="fp16", kv_dtype="int4")
    assert q4["weights"] == full["weights"]
    assert q4["kv_read"] * 4 == full["kv_read"]  # 2 bytes -> half a byte per number
    assert cost.crossover_context(c, 1, "fp16", "int4") == pytest.approx(4 * cost.crossover_context(c, 1, "fp16"))
    with pytest.raises(ValueError, match="dtype"):
        cost.step_bytes(c, 1, 10, kv_dtype="int3")


def test_fastest_keeps_each_number_at_its_best():
    slow = Hardware("cpu", 1e9, {"fp32": 10.0}, 1e9, "m1", overhead=0.004, overhead_per_row=1e-4,
                    matmul_rows={1: 5.0, 8: 20.0}, attention_rows={1: 4e8})
    fast = Hardware("cpu", 2e9, {"fp32": 8.0}, 1e9, "m2", overhead=0.006, overhead_per_row=5e-5,
                    matmul_rows={1: 6.0, 8: 15.0}, attention_rows={1: 3e8})
    best = fastest(slow, fast)
    assert best.mem_bandwidth == 2e9 and best.peak("fp32") == 10.0
    assert best.overhead == 0.004 and best.overhead_per_row == 5e-5
    assert best.matmul_rows == {1: 6.0, 8: 20.0} and best.attention_rows == {1: 4e8}
    assert step_time(PRESETS["tiny"], best, 2, 8, dtype="fp32").total <= min(
        step_time(PRESETS["tiny"], h, 2, 8, dtype="fp32").total for h in (slow, fast))
    with pytest.raises(ValueError, match="alike"):
        fastest(slow, Hardware("cpu", 1e9, {"fp32": 1.0}, 1e9, "m3", matmul_rows={1: 1.0}))
    with pytest.raises(TypeError, match="Hardware"):
        fastest(slow, "fast")


def test_prefill_overhead_counts_every_row():
    hw = Hardware("cpu", 1e9, {"fp32": 1e12}, 1e9, "m", overhead=0.01, overhead_per_row=1e-4)
    c = PRESETS["tiny"]
    assert step_time(c, hw, 2, 0, 50, dtype="fp32").overhead == pytest.approx(0.01 + 100 * 1e-4)
    assert step_time(c, hw, 4, 10, dtype="fp32").overhead == pytest.approx(0.01 + 4 * 1e-4)


@pytest.mark.parametrize("amx, avx512_bf16, want", [
    (True, True, torch.bfloat16), (True, False, torch.bfloat16),
    (False, True, torch.bfloat16), (False, False, torch.float32),
])
def test_fast_dtype_follows_the_cpus_bf16_instructions(monkeypatch, amx, avx512_bf16, want):
    for var in ("KVLIB_FAST_DTYPE", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)  # the portable CI job sets them
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert fast_dtype() is want and fast_dtype("cpu") is want


@pytest.mark.parametrize("env, want", [
    ({"KVLIB_FAST_DTYPE": "fp32"}, torch.float32),
    ({"KVLIB_FAST_DTYPE": "BF16", "DNNL_MAX_CPU_ISA": "AVX2"}, torch.bfloat16),  # the override wins
    ({"DNNL_MAX_CPU_ISA": "AVX2"}, torch.float32),  # oneDNN kept off bf16: the reader's CPU
    ({"DNNL_MAX_CPU_ISA": "avx512_core_vnni"}, torch.float32),
    ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, torch.bfloat16),  # bf16 dot products allowed
    ({"ATEN_CPU_CAPABILITY": "avx2"}, torch.float32),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, torch.bfloat16),
])
def test_fast_dtype_obeys_the_limits_torchs_kernels_obey(monkeypatch, env, want):
    """Under CI's emulation of an AVX2 CPU the probes still see AMX; fast_dtype must not."""
    for var in ("KVLIB_FAST_DTYPE", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert fast_dtype() is want


def test_fast_dtype_names_a_bad_override(monkeypatch):
    monkeypatch.setenv("KVLIB_FAST_DTYPE", "fp16")
    with pytest.raises(ValueError, match="KVLIB_FAST_DTYPE.*'fp16'"):
        fast_dtype()


def test_fast_dtype_rejects_devices_it_does_not_know():
    with pytest.raises(ValueError, match="meta"):
        fast_dtype("meta")


def test_memory_and_cost_default_to_a_kvlib_models_width_and_step_time_to_a_gpus():
    """memory and cost size a kvlib model by default (dtype=None: fp32, its cache's); step_time prices a
    GPU's step, so it keeps a serving GPU's fp16 (kvlib.memory.DEFAULT_DTYPE); measure must be told."""
    import inspect

    c = PRESETS["llama-2-7b"]
    assert memory.DEFAULT_DTYPE == "fp16" and memory.MODEL_DTYPE == torch.float32
    for fn in (memory.weight_bytes, memory.kv_cache_bytes, memory.kv_bytes_per_token, cost.decode_bytes_per_token,
               cost.step_bytes, cost.intensity, cost.crossover_context):
        assert inspect.signature(fn).parameters["dtype"].default is None, fn.__name__
    assert inspect.signature(step_time).parameters["dtype"].default == memory.DEFAULT_DTYPE
    assert cost.step_bytes(c, 1, 100)["kv_read"] == memory.kv_cache_bytes(c, 100) == 2 * memory.kv_cache_bytes(
        c, 100, dtype=memory.DEFAULT_DTYPE)
    with pytest.raises(TypeError):
        measure(c)  # no dtype: which one runs fast differs by machine


def test_gpt_fast_reference_is_a_share_of_the_a100_spec_that_falls_with_the_bits():
    """The README's bandwidths over the A100's spec: 69%, 52%, 42%; and in 16 bits the bytes
    per token it implies are Llama-2-7B's own (tokens/s x bytes per step = bytes/s)."""
    spec = HARDWARE["a100"].mem_bandwidth
    share = {k: bw / spec for k, (_, bw) in GPT_FAST_A100.items()}
    assert [round(100 * share[k]) for k in ("bf16", "int8", "int4")] == [69, 52, 42]
    tps, bw = GPT_FAST_A100["bf16"]
    step = cost.step_bytes(PRESETS["llama-2-7b"], 1, 5, dtype="bf16")["total"]
    assert bw / tps == pytest.approx(step, rel=0.02)
    assert all(tps > 0 and 0 < bw < spec for tps, bw in GPT_FAST_A100.values())


def test_last_level_cache_bytes_reads_the_largest_level_the_os_lists(tmp_path):
    from kvlib.hardware import last_level_cache_bytes

    for name, level, size in (("index0", "1", "48K"), ("index2", "2", "2048K"), ("index3", "3", "480M"),
                              ("index1", "1", "32K"), ("index4", "2", "1024K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert last_level_cache_bytes(str(tmp_path)) == 480 * 2**20  # the level-3 cache, not the last listed
    (tmp_path / "index3" / "size").write_text("n/a\n")  # unreadable: the next level down
    assert last_level_cache_bytes(str(tmp_path)) == 2048 * 2**10
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None  # no such directory (not Linux)
