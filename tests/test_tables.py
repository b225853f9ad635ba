"""`kvbook.table`: a cell's numbers as an aligned table (issue 43)."""

import numpy as np
import pytest
import torch

import kvbook
from kvbook.tables import render

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


def test_columns_take_the_widest_cell_numbers_right_text_left():
    text = render([{"context": 128, "MB": 4.7234, "share": 0.0625, "dtype": "fp32"},
                   {"context": 1024, "MB": 37.75, "share": 0.5, "dtype": "bf16"}],
                  formats={"share": ".0%"})
    assert text.splitlines() == ["context     MB  share  dtype",
                                 "    128   4.72     6%  fp32",
                                 "  1,024  37.75    50%  bf16"]


def test_a_dict_of_columns_is_the_same_table_as_its_rows():
    rows = [{"n": 1, "x": 0.5}, {"n": 2, "x": 1.25}]
    assert render({"n": [1, 2], "x": [0.5, 1.25]}) == render(rows)


def test_numbers_print_as_numbers_whatever_their_type():
    text = render({"v": [torch.tensor(3.0), np.float32(2.5), np.int64(12345), torch.tensor([7])]})
    assert text.split() == ["v", "3.00", "2.50", "12,345", "7"]


def test_a_small_value_is_never_printed_as_zero():
    assert render({"gap": [3e-5, 0.0, 0.25]}, digits=2).split() == ["gap", "3.0e-05", "0.00", "0.25"]
    assert render({"gap": [3e-5]}, digits=6).split() == ["gap", "0.000030"]


def test_none_is_an_empty_cell_and_table_prints_render(capsys):
    rows = [{"a": "x", "b": None}, {"a": "yy", "b": 2}]
    assert kvbook.table(rows) is None
    assert capsys.readouterr().out == render(rows) + "\n"
    assert render(rows).splitlines()[1] == "x"  # the empty cell is not padded out


@pytest.mark.parametrize("rows, kwargs, match", [
    ([], {}, "at least one row"),
    ([{"a": 1}, {"b": 2}], {}, "row 1 has the columns"),
    ({"a": [1, 2], "b": [1]}, {}, "different lengths"),
    ([{"a": 1}], {"formats": {"b": ".1f"}}, "not columns"),
    ([{"a": "x"}], {"formats": {"a": ".1f"}}, "column 'a'"),
    ([{"a": 1}], {"digits": -1}, "digits"),
    ([{"a": 1}], {"digits": 2.0}, "digits"),
    ("a", {}, "list of dicts"),
    ([(1, 2)], {}, "row 0 is a tuple"),
])
def test_bad_input_is_a_clear_error(rows, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render(rows, **kwargs)
