"""kvbook.glue: numbers to the website's prose, never sentences (issue 43)."""

from unittest import mock

import numpy as np
import pytest

import kvbook

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


def glued(**values) -> dict:
    with mock.patch("myst_nb.glue") as glue:
        kvbook.glue(**values)
    assert all(c.kwargs == {"display": False} for c in glue.call_args_list)
    return {c.args[0]: c.args[1] for c in glue.call_args_list}


def test_numbers_and_strings_of_numbers_are_glued_as_given():
    assert glued(a=1, b=2.5, c="2 of 3", d="0, 1 and 11") == {"a": 1, "b": 2.5, "c": "2 of 3", "d": "0, 1 and 11"}


def test_numpy_scalars_are_glued_as_pythons():
    """np.float64's text is "np.float64(2.5)", which a prose format spec (:.1f) cannot read."""
    out = glued(x=np.float64(2.5), n=np.int64(3), f=np.float32(0.5))
    assert out == {"x": 2.5, "n": 3, "f": 0.5} and [type(v) for v in out.values()] == [float, int, float]


@pytest.mark.parametrize("value", ["identical to", "times faster", "int4", True, np.bool_(True), [1, 2], None])
def test_words_bools_and_containers_are_refused_before_anything_is_glued(value):
    with mock.patch("myst_nb.glue") as glue, pytest.raises(TypeError, match="glue carries numbers"):
        kvbook.glue(ok=1.0, bad=value)
    glue.assert_not_called()
