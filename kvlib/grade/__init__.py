"""Graders for the "Find the bug" chapter: a learner's code run against kvlib's own answers.

Each ``grade_*`` function runs the learner's function (or cache factory) on fixed, seeded inputs,
compares it with kvlib's reference or checks a property, and returns a `Grade`: ``PASS  name: n
checks (...)``, or ``FAIL  name: <property>: on <input>: <what differed>``. A grade says what
failed and on what input, as a failing test does, never how to fix it. An exception raised by
the learner's code is a failure too ("your function raised ValueError: ..."); a wrong argument
to a grader itself (not callable, an unknown preset) raises ``TypeError`` or ``ValueError``.

>>> def formula(config, seq_len):  # bytes of K and V at bf16, with the query heads
...     return 2 * config.n_layer * config.n_head * config.head_dim * seq_len * 2
>>> print(kvlib.grade.grade_kv_formula(formula, ["llama-3-8b"], lengths=(4096,)))
FAIL  kv_formula: kv bytes: on llama-3-8b (32 layers, n_head 32, n_kv_head 8, d_model 4096,
head_dim 128) at seq_len 4096: your function gives 2,147,483,648 bytes, kvlib.memory.kv_cache_bytes
536,870,912 (4.00x as much)

Tensors are ``(batch, heads, seq, head_dim)``, as everywhere in kvlib. Every grader builds what
it runs on the CPU in a fixed order from fixed seeds: the same code gets the same grade.

* `kvlib.grade.result`: `Grade`, and what the graders share (the failure line, the tiny model).
* `kvlib.grade.storage`: what a cache keeps: `grade_kv_formula` (its size), `grade_cache` (the
  protocol, `kvlib.check`), `grade_window_cache` (a window) and `grade_fork` (a fork's block tables).
* `kvlib.grade.compute`: what the model computes with it: `grade_positions` (left padding),
  `grade_attention` (bottom-right causal), `grade_generation` and `grade_logits_vs_recompute`.
"""

from .compute import grade_attention, grade_generation, grade_logits_vs_recompute, grade_positions
from .result import Grade
from .storage import grade_cache, grade_fork, grade_kv_formula, grade_window_cache

__all__ = ["Grade", "grade_attention", "grade_cache", "grade_fork", "grade_generation", "grade_kv_formula",
           "grade_logits_vs_recompute", "grade_positions", "grade_window_cache"]
