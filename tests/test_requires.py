"""kvbook.requires: a cell needing a newer library says so and skips itself."""

import pytest

from kvbook.requires import missing, requires

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


def test_a_met_requirement_is_not_missing():
    assert missing("pytest>=1.0") == [] and missing("pytest>=1.0", "torch>=2.0") == []


def test_a_newer_version_is_named_with_the_one_installed(capsys):
    import pytest as installed

    lacking = missing("pytest>=999.0")
    assert lacking == [f"pytest>=999.0 (this runtime has {installed.__version__})"]
    assert requires("pytest>=999.0") is False
    out = capsys.readouterr().out
    assert "Skipped: this cell needs pytest>=999.0" in out and 'pip install -U "pytest>=999.0"' in out


def test_an_absent_package_is_missing():
    assert missing("no-such-package-kvlib>=1") == ["no-such-package-kvlib>=1 (this runtime does not have no-such-package-kvlib)"]


@pytest.mark.parametrize("spec, error", [("transformers", ValueError), ("transformers==5", ValueError),
                                         (5, TypeError)])
def test_a_malformed_requirement_raises_whatever_is_installed(spec, error):
    with pytest.raises(error):
        missing(spec)
    with pytest.raises(ValueError, match="at least one"):
        missing()


def test_the_cell_magic_skips_or_runs_the_cell(capsys):
    """%%requires in a real IPython shell: a missing version skips the body, a met one runs it,
    and an error in a cell that runs still fails it."""
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import start_ipython

    import kvbook

    shell = start_ipython()
    kvbook.setup()  # registers the magic in the running shell
    shell.user_ns["ran"] = []
    shell.run_cell("%%requires pytest>=999.0\nran.append('new')")
    assert shell.user_ns["ran"] == [] and "Skipped" in capsys.readouterr().out
    shell.run_cell("%%requires pytest>=1.0\nran.append('old')")
    assert shell.user_ns["ran"] == ["old"]
    result = shell.run_cell("%%requires pytest>=1.0\n1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)


@pytest.mark.parametrize("older, newer", [("4.56.0", "5.0"), ("4.56.2", "4.57"), ("5.0.0rc1", "5.0"),
                                          ("2.12.9", "2.13.0+cpu"), ("1.9", "1.10")])
def test_versions_compare_as_pip_orders_them(older, newer):
    from kvbook.requires import release

    assert release(older) < release(newer)
    assert release("5.0.0") == release("5.0") == release("5") and release("2.13.0+cpu") == release("2.13.0")
