"""kvlib.grade: every grader passes kvlib's own reference code and fails the "Find the bug" chapter's
buggy code, naming the property that failed and the input it failed on (asserted by fragments, never
whole lines); a bad argument to a grader raises TypeError/ValueError; `check_block_tables` catches
each way a table and the reference counts can disagree."""

import pytest
import torch
import torch.nn.functional as F

from kvlib import Cache, DynamicCache, ModelConfig, attention, causal_mask, generate
from kvlib.cache import nbytes_of
from kvlib.evict import WindowCache
from kvlib.grade import (Grade, grade_attention, grade_cache, grade_fork, grade_generation, grade_kv_formula,
                         grade_logits_vs_recompute, grade_positions, grade_window_cache)
from kvlib.layers import tokens_held
from kvlib.memory import kv_cache_bytes
from kvlib.paged import BlockAllocator, BlockTableError, check_block_tables
from kvlib.speculative import PromptLookupDraft

pytestmark = pytest.mark.cpu_only("the graders build their tiny seeded models on the CPU by design, so that a "
                                  "learner's grade never depends on the machine")


def fails(grade: Grade, *fragments: str) -> str:
    """The grade's failure, after checking that it failed and that its line holds every fragment."""
    assert isinstance(grade, Grade) and not grade and grade.failure, f"expected a failing grade, got {grade}"
    for fragment in fragments:
        assert fragment in grade.failure, f"{fragment!r} is not in: {grade.failure}"
    assert str(grade) == f"FAIL  {grade.name}: {grade.failure}" == repr(grade)
    return grade.failure


def test_a_grade_reads_as_one_line_and_is_true_when_it_passed():
    ok, bad = Grade("demo", True, ["a", "b", "c", "d"]), Grade("demo", False, ("a",), "p: on x: y")
    assert ok and not bad and ok.checked == ("a", "b", "c", "d")
    assert str(ok) == "PASS  demo: 4 checks (a, b, c, ...)" and str(bad) == "FAIL  demo: p: on x: y"
    with pytest.raises(ValueError, match="failure"):
        Grade("demo", True, (), "a failure on a pass")
    with pytest.raises(TypeError, match="bool"):
        Grade("demo", 1, ())


# -- 1. the size formula ------------------------------------------------------------------------------------
def by_layer(config, seq_len):
    """A learner's right answer, written out: each layer's numbers per token times the tokens it holds."""
    per = {"full": 2 * config.n_kv_head * config.head_dim, "window": 2 * config.n_kv_head * config.head_dim,
           "chunked": 2 * config.n_kv_head * config.head_dim, "shared": 0}
    return sum((kind.size if kind.kind == "latent" else per[kind.kind]) * tokens_held(kind, seq_len) * 2
               for kind in config.layer_kinds())


QWEN3_4B = ModelConfig(n_layer=36, n_head=32, n_kv_head=8, d_model=2560, d_ff=9728, vocab_size=151936,
                       head_dim=128, max_seq_len=40960, name="Qwen3-4B")


@pytest.mark.parametrize("fn", [lambda c, n: kv_cache_bytes(c, n, 1, "bf16"), by_layer], ids=["kvlib", "by layer"])
def test_kv_formula_passes_kvlib_s_formula_on_every_preset_in_teaching_order(fn):
    grade = grade_kv_formula(fn)
    assert grade and str(grade).startswith("PASS  kv_formula: 45 checks (gpt2 at 1, gpt2 at 4096")
    order = [c.split(" at ")[0] for c in grade.checked[::3]]
    assert order.index("llama-2-7b") < order.index("smollm2-135m") < order.index("gemma-3-27b") < order.index(
        "deepseek-v3")  # MHA, then GQA, then windows, then latent
    assert grade_kv_formula(fn, {"Qwen3-4B": QWEN3_4B})


def test_kv_formula_fails_query_heads_on_the_first_gqa_model():
    grade = grade_kv_formula(lambda c, n: 2 * c.n_layer * c.n_head * c.head_dim * n * 2)
    fails(grade, "kv bytes: on smollm2-135m (30 layers, n_head 9, n_kv_head 3, d_model 576, head_dim 64) at seq_len 1",
          "kvlib.memory.kv_cache_bytes 23,040", "3.00x as much")
    assert grade.checked[-1] == "smollm2-135m at 1" and "llama-2-7b at 131072" in grade.checked  # MHA passed first


def test_kv_formula_fails_a_head_dim_derived_from_d_model_on_qwen3_4b():
    fails(grade_kv_formula(lambda c, n: 2 * c.n_layer * c.n_kv_head * (c.d_model // c.n_head) * n * 2,
                           {"Qwen3-4B": QWEN3_4B}),
          "kv bytes: on Qwen3-4B (36 layers", "n_kv_head 8, d_model 2560, head_dim 128) at seq_len 1", "0.62x as much")


@pytest.mark.parametrize("name, facts, ratio", [("gemma-3-27b", "52 of 62 layers windowed (window 1024)", "2.70x"),
                                                ("gpt-oss-20b", "12 of 24 layers windowed (window 128)", "1.94x")])
def test_kv_formula_fails_every_layer_at_full_length_on_window_models(name, facts, ratio):
    grade = grade_kv_formula(lambda c, n: 2 * c.n_layer * c.n_kv_head * c.head_dim * n * 2, [name])
    fails(grade, f"on {name} (", facts, "at seq_len 4096", f"{ratio} as much")
    assert grade.checked == (f"{name} at 1", f"{name} at 4096")  # a window holds the one token: length 1 agrees


def test_kv_formula_fails_a_float_and_an_exception_naming_the_input():
    fails(grade_kv_formula(lambda c, n: kv_cache_bytes(c, n, 1, "bf16") / 1, ["tiny"]),
          "kv bytes: on tiny (2 layers", "at seq_len 1", "returned float 256.0, not an int")
    fails(grade_kv_formula(lambda c, n: c.window * n, ["gpt2"]), "on gpt2 (12 layers",
          "your function raised AttributeError", "window")


def test_kv_formula_refuses_bad_arguments():
    with pytest.raises(TypeError, match="fn must be a function"):
        grade_kv_formula(42)
    with pytest.raises(ValueError, match=r"configs names no preset: \['llama-9'\]"):
        grade_kv_formula(by_layer, ["llama-9"])
    with pytest.raises(TypeError, match="ModelConfig"):
        grade_kv_formula(by_layer, {"Qwen3-4B": dict(n_layer=36)})
    with pytest.raises(ValueError, match="empty"):
        grade_kv_formula(by_layer, [])
    with pytest.raises(ValueError, match="positive"):
        grade_kv_formula(by_layer, lengths=(0,))
    with pytest.raises(TypeError, match="lengths"):
        grade_kv_formula(by_layer, lengths=4096)


# -- 2. the cache protocol ----------------------------------------------------------------------------------
class ForgetsOldTokens(DynamicCache):
    """Keeps only the newest chunk: ``self.keys[layer] = k``."""

    def update(self, k, v, layer):
        self.validate_update(k, v, layer)
        self.keys[layer], self.values[layer] = self.own(k), self.own(v)
        return self.keys[layer], self.values[layer]


class CropCrashes(DynamicCache):
    def crop(self, max_length):
        raise RuntimeError(f"cannot crop to {max_length}")


def test_grade_cache_passes_dynamic_cache_and_turns_a_check_error_into_the_failure():
    assert str(grade_cache(lambda n_layer, b, h, d, dtype: DynamicCache(n_layer))).startswith(
        "PASS  cache: 11 checks (update, tokens seen, layers independent, ...)")
    grade = grade_cache(lambda n_layer, b, h, d, dtype: ForgetsOldTokens(n_layer))
    fails(grade, "[update returns everything so far]", "keys of layer 0 after step 1", "shape (2, 2, 1, 4)")
    assert grade.checked == ("update",)


def test_grade_cache_reports_the_cache_s_own_exception_under_its_property():
    grade = grade_cache(lambda n_layer, b, h, d, dtype: CropCrashes(n_layer))
    fails(grade, "[crop and reset] your cache raised RuntimeError: cannot crop to 4")
    assert grade.checked == ("update", "tokens seen", "layers independent", "crop and reset")


def test_grade_cache_refuses_bad_arguments_as_check_cache_does():
    with pytest.raises(TypeError, match="the class DynamicCache itself"):
        grade_cache(DynamicCache)
    with pytest.raises(ValueError, match="not_applicable names no property"):
        grade_cache(lambda *a: DynamicCache(a[0]), not_applicable={"speed": "slow"})
    with pytest.raises(TypeError):
        grade_cache(lambda *a: DynamicCache(a[0]), colour="red")


# -- 3. a window cache --------------------------------------------------------------------------------------
class KeepsEverything(DynamicCache):
    """The chapter's first try: attend to the last W, store everything."""

    def __init__(self, n_layer, window):
        super().__init__(n_layer)
        self.window = window

    def update(self, k, v, layer):
        keys, values = super().update(k, v, layer)
        return keys[:, :, -self.window:], values[:, :, -self.window:]


class TrimsToAView(KeepsEverything):
    """A "fix" that keeps a view of the last W: the whole tensor under it stays alive."""

    def update(self, k, v, layer):
        DynamicCache.update(self, k, v, layer)
        self.keys[layer] = self.keys[layer][:, :, -self.window:]  # a view of the torch.cat result
        self.values[layer] = self.values[layer][:, :, -self.window:]
        return self.keys[layer], self.values[layer]


class TrimsACopy(KeepsEverything):
    """Trims a copy, but DynamicCache's get_seq_length counts what it holds."""

    def update(self, k, v, layer):
        DynamicCache.update(self, k, v, layer)
        self.keys[layer] = self.keys[layer][:, :, -self.window:].clone()
        self.values[layer] = self.values[layer][:, :, -self.window:].clone()
        return self.keys[layer], self.values[layer]


class CountsSeen(TrimsACopy):
    """The full fix, as Hugging Face's sliding layers count: get_seq_length is the tokens seen."""

    def __init__(self, n_layer, window):
        super().__init__(n_layer, window)
        self.seen = [0] * n_layer

    def update(self, k, v, layer):
        self.seen[layer] += k.shape[2]
        return super().update(k, v, layer)

    def get_seq_length(self, layer_idx=0):
        return self.seen[layer_idx]


class KeepsTheFirst(KeepsEverything):
    """Returns the first W tokens, not the last."""

    def update(self, k, v, layer):
        keys, values = DynamicCache.update(self, k, v, layer)
        return keys[:, :, :self.window], values[:, :, :self.window]


def window(cls, W=8):
    return lambda n_layer, batch, n_kv_head, head_dim, dtype: cls(n_layer, W)


@pytest.mark.parametrize("cls", [WindowCache, CountsSeen])
def test_window_grader_passes_kvlib_s_ring_buffer_and_the_full_fix(cls):
    assert str(grade_window_cache(window(cls), 8)) == \
        "PASS  window_cache: 3 checks (attends to the last W, holds at most W, tokens seen)"
    assert grade_window_cache(window(cls, 3), 3, tokens=5)


@pytest.mark.parametrize("cls", [KeepsEverything, TrimsToAView])
def test_window_grader_fails_a_cache_that_keeps_more_than_w_alive(cls):
    grade = grade_window_cache(window(cls), 8)
    fails(grade, "holds at most W: on 32 tokens fed one at a time (window 8, 2 layers", "after 9 tokens",
          "kvlib.check.storage_bytes", "it holds 9 tokens' worth, the window is 8 (4,096 bytes)")
    assert grade.checked == ("attends to the last W", "holds at most W")
    views = "the tensors it holds show only 8 tokens' worth: they are views into larger storage"
    assert (views in grade.failure) == (cls is TrimsToAView)  # said only where a view is the cause


def test_window_grader_fails_a_cache_that_counts_held_tokens_as_seen():
    fails(grade_window_cache(window(TrimsACopy), 8), "tokens seen: on 32 tokens fed one at a time (window 8",
          "after 9 tokens fed, cache.tokens_seen is 8")


def test_window_grader_fails_a_cache_that_attends_to_the_wrong_tokens():
    fails(grade_window_cache(window(KeepsTheFirst), 8), "attends to the last W: on 32 tokens fed",
          "after 9 tokens, layer 0", "the keys of tokens 0..7; the last 8 are tokens 1..8")
    fails(grade_window_cache(lambda n_layer, *_: DynamicCache(n_layer), 4), "attends to the last W",
          "after 5 tokens, layer 0: update returned the keys of tokens 0..4; the last 4 are tokens 1..4")


def test_window_grader_reports_a_crash_and_refuses_bad_arguments():
    def broken(n_layer, *_):
        raise NotImplementedError("todo")

    fails(grade_window_cache(broken, 8), "attends to the last W", "make(2, 1, 2, 16, torch.float32) raised "
          "NotImplementedError: todo")
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        grade_window_cache(window(WindowCache), 0)
    with pytest.raises(TypeError, match="window must be an int"):
        grade_window_cache(window(WindowCache), "8")
    with pytest.raises(TypeError, match="make must be a function"):
        grade_window_cache(None, 8)


# -- 4. positions for a left-padded batch -------------------------------------------------------------------
def real_tokens(valid):
    return valid.sum(dim=-1, keepdim=True)  # (B, 1): each row's next position


def test_positions_grader_passes_each_rows_count_of_real_tokens():
    grade = grade_positions(real_tokens)
    assert grade and grade.checked[1:] == ("row 0 (0 pads)", "row 1 (2 pads)", "row 2 (5 pads)", "row 3 (1 pads)")



def test_positions_grader_fails_the_caches_length_on_the_first_padded_row():
    """unsloth#3699: the decode step at the cache's length, one position for every row."""
    fails(grade_positions(lambda valid: torch.full((valid.shape[0], 1), valid.shape[1])),
          "each row as if alone: on a left-padded batch of 4 rows (6, 4, 1, 5 real tokens), prefilled at each "
          "row's own positions, then 2 decode steps",
          "row 1 (2 pads on the left): its logits differ from the row run alone by",
          "at its token 4 (decode step 1; tolerance 1e-05)")


def test_positions_grader_fails_an_off_by_one_and_bad_returns():
    fails(grade_positions(lambda valid: real_tokens(valid) - 1), "each row as if alone",
          "row 0 (0 pads on the left)", "(decode step 1;")
    fails(grade_positions(lambda valid: real_tokens(valid).float()), "positions: on a left-padded batch",
          "at decode step 1 your function returned torch.float32 of shape (4, 1), not a (4, 1) integer tensor")
    fails(grade_positions(lambda valid: valid.long().cumsum(-1)), "returned torch.int64 of shape (4, 6)")
    fails(grade_positions(lambda valid: valid.sum(dim=-1)), "returned torch.int64 of shape (4,), not a (4, 1)")
    fails(grade_positions(lambda valid: valid.cumsum(0, 1)), "positions: on a left-padded batch",
          "your function raised")
    with pytest.raises(TypeError, match="next_position must be a function"):
        grade_positions("cumsum")


# -- 5. attention over a cache ------------------------------------------------------------------------------
def test_attention_grader_passes_kvlib_s_bottom_right_mask():
    grade = grade_attention(lambda q, k, v: attention(q, k, v, causal_mask(q.shape[2], k.shape[2])))
    assert grade.checked == ("prefill (Tq=5, Tk=5)", "decode step (Tq=1, Tk=6)", "chunk (Tq=3, Tk=7)") and grade


def test_attention_grader_fails_is_causal_on_a_decode_step_after_passing_the_prefill():
    grade = grade_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    fails(grade, "equals kvlib.attention: on a decode step (Tq=1, the last of Tk=6 keys",
          "query 0 (at position 5) differs by", "(tolerance 1e-05)")
    assert grade.checked == ("prefill (Tq=5, Tk=5)", "decode step (Tq=1, Tk=6)")


def test_attention_grader_fails_a_top_left_mask_on_the_chunk():
    def top_left(q, k, v):
        Tq, Tk = q.shape[2], k.shape[2]
        return attention(q, k, v, torch.ones(Tq, Tk, dtype=torch.bool).tril() if Tq > 1 else None)

    fails(grade_attention(top_left), "on a chunk (Tq=3, the last of Tk=7 keys", "query 0 (at position 4) differs")
    fails(grade_attention(lambda q, k, v: q), "on a prefill", "query 0 (at position 0)")
    fails(grade_attention(lambda q, k, v: v.sum(1)), "on a prefill", "returned shape (2, 5, 8), not a tensor of "
          "shape (2, 3, 5, 8)")
    with pytest.raises(TypeError, match="fn must be a function"):
        grade_attention(None)


# -- 6. generation against the recompute --------------------------------------------------------------------
def speculative(model, prompt, n, crop=True, k=4):
    """Greedy speculative decoding with prompt-lookup drafts over a DynamicCache; ``crop=False`` forgets the
    rollback after a rejected draft (the chapter's bug)."""
    cache, draft, seq = DynamicCache(model.config.n_layer), PromptLookupDraft(), list(prompt)
    with torch.no_grad():
        seq.append(int(model(torch.tensor([seq]), cache)[0, -1].argmax()))
        while len(seq) - len(prompt) < n:
            left = n - (len(seq) - len(prompt))
            guess = draft.propose(seq, min(k, left - 1)) if left > 1 else []
            start = cache.tokens_seen
            best = model(torch.tensor([[seq[-1]] + guess]), cache)[0].argmax(-1).tolist()  # the target's tokens
            a = 0
            while a < len(guess) and guess[a] == best[a]:
                a += 1
            if crop:
                cache.crop(start + 1 + a)  # keep the last token and the accepted guesses
            seq += guess[:a] + [best[a]]
    return seq[len(prompt):len(prompt) + n]


@pytest.mark.parametrize("fn", [lambda m, p, n: generate(m, p, n)[0, len(p):].tolist(), speculative],
                         ids=["generate", "speculative"])
def test_generation_grader_passes_cached_generation(fn):
    assert str(grade_generation(fn)) == \
        "PASS  generation: 3 checks (prompt 0 (3 tokens), prompt 1 (5 tokens), prompt 2 (10 tokens))"


def test_generation_grader_fails_speculation_that_forgets_the_crop():
    fails(grade_generation(lambda m, p, n: speculative(m, p, n, crop=False)),
          "equals full recompute: on prompt 0 (3 tokens: [4, 17, 9]), 10 new tokens, greedy, float32",
          "differs from full recompute (yours", "tokens before it agree")


def test_generation_grader_fails_wrong_lengths_and_types_and_refuses_bad_arguments():
    fails(grade_generation(lambda m, p, n: generate(m, p, n)[0].tolist()), "on prompt 0 (3 tokens",
          "returned 13 tokens, not 10 new ones")
    fails(grade_generation(lambda m, p, n: "tokens"), "returned str, not a list of token ids")
    with pytest.raises(TypeError, match="floating torch.dtype"):
        grade_generation(speculative, dtype=torch.int64)
    with pytest.raises(TypeError, match="fn must be a function"):
        grade_generation([1, 2])


# -- 7. rounding or a bug -----------------------------------------------------------------------------------
class WrapsAt16(Cache):
    """A preallocated 16-slot cache that writes token p at slot p % 16: past 16 tokens it overwrites silently."""

    def __init__(self, n_layer, batch, n_kv_head, head_dim, dtype):
        super().__init__(n_layer)
        self.k = torch.zeros(n_layer, batch, n_kv_head, 16, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.n = [0] * n_layer

    def update(self, k, v, layer):
        for t in range(k.shape[2]):
            self.k[layer, :, :, (self.n[layer] + t) % 16] = k[:, :, t]
            self.v[layer, :, :, (self.n[layer] + t) % 16] = v[:, :, t]
        self.n[layer] += k.shape[2]
        return self.layer_kv(layer)

    def get_seq_length(self, layer_idx=0):
        return self.n[layer_idx]

    @property
    def nbytes(self):
        return nbytes_of(self.k, self.v)

    def reset(self):
        self.n = [0] * self.n_layer

    def crop(self, max_length):
        self.n = [self.crop_length(max_length)] * self.n_layer

    def layer_kv(self, layer_idx):
        S = min(self.n[layer_idx], 16)
        return None if S == 0 else (self.k[layer_idx, :, :, :S], self.v[layer_idx, :, :, :S])


def test_logits_grader_passes_dynamic_cache_in_float64_and_catches_a_silent_wrap():
    grade = grade_logits_vs_recompute(lambda n_layer, *_: DynamicCache(n_layer))
    assert grade and len(grade.checked) == 15 and grade.checked[-1] == "decode step 14 (position 19)"
    grade = grade_logits_vs_recompute(WrapsAt16)
    fails(grade, "logits equal the recompute: on a prefill of 6 tokens, then 14 decode steps (float64)",
          "decode step 11 (position 16): logits differ from the recompute by", "in float64 (tolerance 1e-09",
          "kvlib.DynamicCache differs by", "not rounding")
    assert grade.checked[-2] == "decode step 10 (position 15)"  # 16 tokens fit: those steps passed


def test_logits_grader_fails_a_factory_that_gives_no_cache_and_refuses_a_tol_below_rounding():
    fails(grade_logits_vs_recompute(lambda *a: "cache"), "logits equal the recompute", "make returned str, not a "
          "kvlib Cache")
    with pytest.raises(ValueError, match="below this model's rounding in float32"):
        grade_logits_vs_recompute(lambda n_layer, *_: DynamicCache(n_layer), dtype=torch.float32)
    assert grade_logits_vs_recompute(lambda n_layer, *_: DynamicCache(n_layer), dtype=torch.float32, tol=1e-4)
    with pytest.raises(ValueError, match="tol must be a positive number"):
        grade_logits_vs_recompute(lambda n_layer, *_: DynamicCache(n_layer), tol=0)


# -- 8. a fork, and the block-table checker -----------------------------------------------------------------
def fork_right(pool, parent):
    for block in parent[:-1]:
        pool.share(block)
    return parent[:-1] + [pool.allocate()]


def fork_leaks_last(pool, parent):
    for block in parent:
        pool.share(block)
    return parent[:-1] + [pool.allocate()]


def fork_no_share(pool, parent):
    return parent[:-1] + [pool.allocate()]


def fork_shares_all(pool, parent):
    for block in parent:
        pool.share(block)
    return list(parent)


def test_fork_grader_passes_a_copy_on_write_fork():
    assert grade_fork(fork_right).checked == ("after the fork", "copy on write", "full blocks shared",
                                              "after the parent finished", "after the child finished")


def test_fork_grader_fails_the_chapter_s_forks_naming_the_step():
    on = "on a parent of 10 tokens in blocks [5, 2, 7] (block size 4, the last block partial), a pool of 8 blocks"
    fails(grade_fork(fork_leaks_last), "block tables agree with reference counts: " + on, "after the fork: block 7 "
          "has reference count 2 but 1 table holds it: it will never return to the free list")
    fails(grade_fork(fork_no_share), on, "after the fork: block 2 has reference count 1 but 2 tables hold it: "
          "freeing one will free it under the other")
    fails(grade_fork(fork_shares_all), "copy on write: " + on, "both tables end in block 7")
    fails(grade_fork(lambda pool, parent: [pool.allocate() for _ in parent]), "full blocks shared: " + on,
          "the child's full blocks are [0, 3], the parent's [5, 2]")
    fails(grade_fork(lambda pool, parent: None), on, "after the fork: your fork returned None")
    with pytest.raises(TypeError, match="fork must be a function"):
        grade_fork(3)


def test_check_block_tables_catches_free_held_leaked_and_double_owned_blocks():
    pool = BlockAllocator(num_blocks=8, block_size=4)
    parent = [pool.allocate() for _ in range(3)]  # [0, 1, 2]
    child = fork_right(pool, parent)  # [0, 1, 3]
    check_block_tables(pool, {"parent": parent, "child": child})
    with pytest.raises(BlockTableError, match="block 0 has reference count 2 but 1 table holds it: it will never"):
        check_block_tables(pool, {"parent": parent})
    with pytest.raises(BlockTableError, match="block 3 has reference count 1 but no table holds it"):
        check_block_tables(pool, {"parent": parent, "child": child[:2]})
    with pytest.raises(BlockTableError, match="block 0 has reference count 2 but 3 tables hold it: freeing one "
                                              "will free it under the other$"):
        check_block_tables(pool, {"parent": parent, "child": child, "other": [0]})
    with pytest.raises(BlockTableError, match="table 'child' holds block 5, which is free .its reference count is "
                                              "0.: it can be handed to another sequence while this one reads it"):
        check_block_tables(pool, {"parent": parent, "child": child + [5]})
    with pytest.raises(BlockTableError, match="table 'child' holds 9, which is not a block of this pool"):
        check_block_tables(pool, {"child": [9]})
    pool.refcount[4] = 1  # on the free list with an owner: the allocator's own bookkeeping breaks
    with pytest.raises(BlockTableError, match="the allocator's own bookkeeping is inconsistent: block 4"):
        check_block_tables(pool, {"parent": parent, "child": child})
    assert issubclass(BlockTableError, AssertionError)


def test_check_block_tables_refuses_what_is_not_an_allocator_or_tables():
    pool = BlockAllocator(num_blocks=2, block_size=4)
    with pytest.raises(TypeError, match="BlockAllocator"):
        check_block_tables({}, {})
    with pytest.raises(TypeError, match="map a sequence's name"):
        check_block_tables(pool, [[0]])
    with pytest.raises(TypeError, match="table 'a' must be a list"):
        check_block_tables(pool, {"a": 0})
