"""The argument checks every module shares, so each rule and its message live in one place.

Each function returns the value it checked, so a constructor can write
``self.block_size = positive_int("block_size", block_size)``. Misuse raises
``ValueError`` (a wrong value) or ``TypeError`` (a wrong kind of thing), with
the argument's name and the value it got.
"""

from __future__ import annotations


def int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``ValueError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int (not a bool) ``> 0``; else ``ValueError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
