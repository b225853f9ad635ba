"""What a grader returns, and what every grader shares: the `Grade`, the failure line's shape,
argument checks, and the graders' tiny seeded model."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model import Transformer

__all__ = ["Grade"]  # the rest serves the graders

SHOWN = 3  # checks a passing grade's line names
# The graders' model: a small random Llama. std 0.2 makes its logits sharp, so no two greedy candidates tie.
TINY = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=61, max_seq_len=64,
                   name="the graders' tiny model")


@dataclass(frozen=True, repr=False)
class Grade:
    """What a grader found. ``checked`` names the inputs and properties it ran, in order: all of
    them when it passed, those up to the failing one (last) when it failed. ``failure`` is None
    when it passed, else ``"<property>: on <input>: <what differed>"``. A Grade is true when it
    passed, so ``assert grade`` fails with the grade's line.

    >>> print(kvlib.grade.Grade("demo", True, ("prefill", "decode")))
    PASS  demo: 2 checks (prefill, decode)
    """

    name: str
    passed: bool
    checked: tuple[str, ...]
    failure: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.passed, bool):
            raise TypeError(f"Grade.passed must be a bool, got {type(self.passed).__name__}")
        if self.passed != (self.failure is None):
            raise ValueError(f"a passing Grade has no failure and a failing one has one; got passed={self.passed}, "
                             f"failure={self.failure!r}")
        object.__setattr__(self, "checked", tuple(self.checked))

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if not self.passed:
            return f"FAIL  {self.name}: {self.failure}"
        shown = ", ".join(self.checked[:SHOWN]) + (", ..." if len(self.checked) > SHOWN else "")
        return f"PASS  {self.name}: {len(self.checked)} checks ({shown})"

    __repr__ = __str__


def fail(name: str, checked: list[str], prop: str, on: str, what: str) -> Grade:
    """A failing `Grade` whose line reads ``<prop>: on <on>: <what>``: the property, the input, what differed."""
    return Grade(name, False, tuple(checked), f"{prop}: on {on}: {what}")


def raised(err: BaseException) -> str:
    """``"raised ValueError: <message>"``: how a learner's exception reads in a failure."""
    return f"raised {type(err).__name__}: {err}"


def need_callable(name: str, value: object, want: str) -> None:
    """``TypeError`` naming ``name``, what it must be, and what it got, unless ``value`` is callable."""
    if not callable(value):
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")


def need_float_dtype(dtype: object) -> str:
    """``dtype``'s short name (``"float64"``) if it is a floating torch dtype; else TypeError."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (torch.float32, torch.float64, ...), got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def tiny_model(dtype: torch.dtype = torch.float32) -> Transformer:
    """`TINY` with seeded random weights (seed 0, std 0.2) in ``dtype``: every call builds the same model."""
    model = Transformer(TINY, dtype=dtype)
    model.reset_parameters(seed=0, std=0.2)
    return model.eval()


def as_ints(out: object) -> list[int] | None:
    """``out`` as a list of ints (a list or tuple of ints, or a 1-D integer tensor); None if it is not one."""
    if isinstance(out, torch.Tensor) and out.dim() == 1 and not out.is_floating_point():
        return out.tolist()
    if isinstance(out, (list, tuple)):
        try:
            return [operator.index(t) for t in out]
        except TypeError:
            return None
    return None
