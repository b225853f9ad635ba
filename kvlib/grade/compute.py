"""Graders of what the model computes with a cache: positions under padding, attention over a cache,
generation against the recompute, and whether a difference in logits is rounding or a bug."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import attention, causal_mask
from ..cache import Cache, DynamicCache
from ..generate import generate_naive
from ..model import Transformer
from ..padding import pad, position_ids
from .result import TINY, Grade, as_ints, fail, need_callable, need_float_dtype, raised, tiny_model

__all__ = ["grade_attention", "grade_generation", "grade_logits_vs_recompute", "grade_positions"]


# -- positions for a left-padded batch ---------------------------------------------------------------
ROW_LENGTHS = (6, 4, 1, 5)  # real tokens per row of the padded batch: row 0 has no padding
DECODE_STEPS = 2
TOL = 1e-5  # fp32: two runs of the same row differ by rounding only, far below this


@torch.no_grad()
def grade_positions(next_position: Callable[[torch.Tensor], torch.Tensor]) -> Grade:
    """``next_position(valid)``: the RoPE position of each row's next token in a left-padded batch,
    ``(B, 1)`` ints, where ``valid`` ``(B, S)`` is True at the real tokens among the ``S`` keys the
    cache holds (pads False). The tiny seeded model (fp32) prefills the batch at each row's own
    positions (`kvlib.padding.position_ids`), then runs `DECODE_STEPS` decode steps at the
    positions ``next_position`` gives. Each row's logits, at every real token and every step, must
    equal that row's run alone, unpadded (within `TOL`): a row continues where it alone would."""
    need_callable("next_position", next_position, "a function next_position(valid) -> (B, 1) positions")
    model, g = tiny_model(), torch.Generator().manual_seed(7)
    rows = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in ROW_LENGTHS]
    new = torch.randint(1, TINY.vocab_size, (len(rows), DECODE_STEPS), generator=g)  # (B, steps)
    alone = []
    for r, row in enumerate(rows):
        cache = DynamicCache(TINY.n_layer)
        alone.append(torch.cat([model(torch.tensor([row]), cache)[0]] +
                               [model(new[r : r + 1, s : s + 1], cache)[0] for s in range(DECODE_STEPS)]))
    ids, valid = pad(rows)  # (B, T) each, left-padded
    B, T = ids.shape
    on = (f"a left-padded batch of {B} rows ({', '.join(map(str, ROW_LENGTHS))} real tokens), prefilled at "
          f"each row's own positions, then {DECODE_STEPS} decode steps")
    checked = ["positions (B, 1)"]
    cache = DynamicCache(TINY.n_layer)
    steps = [model(ids, cache, positions=position_ids(valid), key_valid=valid)]  # (B, T, V)
    key_valid = valid
    for s in range(DECODE_STEPS):
        try:
            got = next_position(key_valid.clone())
        except Exception as e:
            return fail("positions", checked, "positions", on, f"your function {raised(e)}")
        if (not isinstance(got, torch.Tensor) or tuple(got.shape) != (B, 1) or got.is_floating_point()
                or got.dtype == torch.bool or got.is_complex()):
            what = f"{got.dtype} of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return fail("positions", checked, "positions", on, f"at decode step {s + 1} your function returned "
                        f"{what}, not a ({B}, 1) integer tensor")
        key_valid = torch.cat([key_valid, torch.ones(B, 1, dtype=torch.bool)], dim=1)
        steps.append(model(new[:, s : s + 1], cache, positions=got.cpu().long(),
                           key_valid=key_valid))
    batch = torch.cat(steps, dim=1)  # (B, T + steps, vocab)
    for r, n in enumerate(ROW_LENGTHS):
        checked.append(f"row {r} ({T - n} pads)")
        diff = (batch[r, T - n :] - alone[r]).abs().amax(dim=-1)  # (n + steps,): worst logit per token
        bad = (~(diff <= TOL)).nonzero()
        if len(bad):
            i = int(bad[0])
            where = "a prompt token" if i < n else f"decode step {i - n + 1}"
            return fail("positions", checked, "each row as if alone", on,
                        f"row {r} ({T - n} pads on the left): its logits differ from the row run alone by "
                        f"{float(diff[i]):.1e} at its token {i} ({where}; tolerance {TOL:.0e})")
    return Grade("positions", True, tuple(checked))


# -- attention over a cache ---------------------------------------------------------------------------
ATTENTION_CASES = (("a prefill", 5, 5), ("a decode step", 1, 6), ("a chunk", 3, 7))  # (case, Tq, Tk)


def grade_attention(fn: Callable[..., torch.Tensor]) -> Grade:
    """``fn(q, k, v)``, ``q`` ``(B, H, Tq, D)`` and ``k``, ``v`` ``(B, H, Tk, D)``: causal attention whose
    ``Tq`` queries are the *last* ``Tq`` positions of the ``Tk`` keys (bottom-right). Against
    ``kvlib.attention.attention(q, k, v, causal_mask(Tq, Tk))`` on a prefill (Tq = Tk = 5), a decode
    step (Tq = 1, Tk = 6) and a chunk (Tq = 3, Tk = 7: a chunked prefill, or a speculative verify), fp32,
    within `TOL`."""
    need_callable("fn", fn, "a function fn(q, k, v) -> output")
    B, H, D = 2, 3, 8
    checked: list[str] = []
    for i, (case, Tq, Tk) in enumerate(ATTENTION_CASES):
        g = torch.Generator().manual_seed(10 + i)
        q, k, v = (torch.randn(B, H, T, D, generator=g) for T in (Tq, Tk, Tk))
        want = attention(q, k, v, causal_mask(Tq, Tk))  # (B, H, Tq, D)
        checked.append(f"{case.removeprefix('a ')} (Tq={Tq}, Tk={Tk})")
        on = f"{case} (Tq={Tq}, the last of Tk={Tk} keys; q {tuple(q.shape)}, k and v {tuple(k.shape)})"
        try:
            got = fn(q.clone(), k.clone(), v.clone())
        except Exception as e:
            return fail("attention", checked, "equals kvlib.attention", on, f"your function {raised(e)}")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            what = f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return fail("attention", checked, "equals kvlib.attention", on,
                        f"your function returned {what}, not a tensor of shape {tuple(want.shape)}")
        err = (got.double() - want.double()).abs().amax(dim=(0, 1, 3))  # (Tq,): worst difference per query
        bad = (~(err <= TOL)).nonzero()
        if len(bad):
            j = int(bad[0])
            return fail("attention", checked, "equals kvlib.attention", on,
                        f"query {j} (at position {Tk - Tq + j}) differs by {float(err[j]):.1e} (tolerance {TOL:.0e})")
    return Grade("attention", True, tuple(checked))


# -- generation equals the recompute ------------------------------------------------------------------
PROMPTS = ([4, 17, 9], [11, 3, 11, 3, 11], [5, 9, 2, 6, 5, 9, 2, 6, 5, 9])  # 3, 5 and 10 tokens
NEW_TOKENS = 10


def grade_generation(fn: Callable[[Transformer, list[int], int], list[int]],
                     dtype: torch.dtype = torch.float32) -> Grade:
    """``fn(model, prompt_ids, max_new_tokens) -> list[int]``, the new tokens of greedy decoding, against
    `kvlib.generate_naive` (the whole text recomputed every step) on the tiny seeded model in ``dtype``
    (sharp logits: no ties), for 3 prompts of 3, 5 and 10 tokens, `NEW_TOKENS` new tokens each.
    ``fn`` gets a freshly built model (the same seeded weights) for every prompt."""
    need_callable("fn", fn, "a function fn(model, prompt_ids, max_new_tokens) -> list[int]")
    name = need_float_dtype(dtype)
    reference = tiny_model(dtype)
    wants = [generate_naive(reference, list(p), NEW_TOKENS)[0, len(p):].tolist() for p in PROMPTS]
    checked: list[str] = []
    for i, (prompt, want) in enumerate(zip(PROMPTS, wants)):
        checked.append(f"prompt {i} ({len(prompt)} tokens)")
        on = f"prompt {i} ({len(prompt)} tokens: {list(prompt)}), {NEW_TOKENS} new tokens, greedy, {name}"
        try:
            out = fn(tiny_model(dtype), list(prompt), NEW_TOKENS)
        except Exception as e:
            return fail("generation", checked, "equals full recompute", on, f"your function {raised(e)}")
        got = as_ints(out)
        if got is None:
            return fail("generation", checked, "equals full recompute", on,
                        f"your function returned {type(out).__name__}, not a list of token ids")
        if len(got) != NEW_TOKENS:
            return fail("generation", checked, "equals full recompute", on,
                        f"your function returned {len(got)} tokens, not {NEW_TOKENS} new ones")
        n = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if n is not None:
            return fail("generation", checked, "equals full recompute", on,
                        f"new token {n} differs from full recompute (yours {got[n]}, recompute {want[n]}); "
                        + ("tokens before it agree" if n else "it is the first"))
    return Grade("generation", True, tuple(checked))


# -- a difference: rounding or a bug? ------------------------------------------------------------------
PREFILL, DECODES = 6, 14  # 20 tokens: past a 16-slot buffer
STARTS = (0,) + tuple(range(PREFILL, PREFILL + DECODES))  # each step's first position


def _steps(model: Transformer, ids: torch.Tensor, cache: Cache):
    """Each step's logits ``(T, vocab)`` in turn: the prefill of `PREFILL` tokens, then one decode step a token."""
    yield model(ids[:, :PREFILL], cache)[0]
    for p in STARTS[1:]:
        yield model(ids[:, p : p + 1], cache)[0]


@torch.no_grad()
def grade_logits_vs_recompute(make: Callable[..., Cache], dtype: torch.dtype = torch.float64,
                              tol: float = 1e-9) -> Grade:
    """A cache from ``make(n_layer, batch, n_kv_head, head_dim, dtype)`` under the tiny seeded model in
    ``dtype``: a prefill of 6 tokens, then 14 decode steps; each step's logits against one full forward
    over the 20 tokens (the recompute). kvlib's `DynamicCache` on the same steps measures the rounding;
    a ``tol`` below it is refused (ValueError). In float64 rounding is about 1e-15, so a difference
    above ``tol`` is not rounding."""
    need_callable("make", make, "a function make(n_layer, batch, n_kv_head, head_dim, dtype) -> a kvlib Cache")
    name = need_float_dtype(dtype)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    model = tiny_model(dtype)
    ids = torch.randint(1, TINY.vocab_size, (1, PREFILL + DECODES), generator=torch.Generator().manual_seed(5))
    full = model(ids)[0]  # (20, vocab): every position recomputed from the whole text
    rounding = max(float((got - full[s : s + len(got)]).abs().max())
                   for s, got in zip(STARTS, _steps(model, ids, DynamicCache(TINY.n_layer))))
    if rounding > tol:
        raise ValueError(f"tol={tol:g} is below this model's rounding in {name}: kvlib.DynamicCache's logits "
                         f"differ from the recompute by {rounding:.1e}")
    prop, on = "logits equal the recompute", f"a prefill of {PREFILL} tokens, then {DECODES} decode steps ({name})"
    shape = (TINY.n_layer, 1, TINY.n_kv_head, TINY.head_dim, dtype)
    checked: list[str] = []
    try:
        cache = make(*shape)
    except Exception as e:
        return fail("logits_vs_recompute", ["make"], prop, on, f"make{shape} {raised(e)}")
    if not isinstance(cache, Cache):
        return fail("logits_vs_recompute", ["make"], prop, on, f"make returned {type(cache).__name__}, "
                    f"not a kvlib Cache")
    steps = _steps(model, ids, cache)
    for i, s in enumerate(STARTS):
        label = "the prefill" if i == 0 else f"decode step {i} (position {s})"
        checked.append(label)
        try:
            got = next(steps)
        except Exception as e:
            return fail("logits_vs_recompute", checked, prop, on, f"{label}: the model with your cache {raised(e)}")
        diff = float((got - full[s : s + len(got)]).abs().max())
        if not diff <= tol:
            return fail("logits_vs_recompute", checked, prop, on,
                        f"{label}: logits differ from the recompute by {diff:.1e} in {name} (tolerance {tol:.0e}; "
                        f"kvlib.DynamicCache differs by {rounding:.1e} here, its rounding): not rounding")
    return Grade("logits_vs_recompute", True, tuple(checked))
