"""kvbook: the figure style's tick labels, and the one set-up line every chapter starts with."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvbook  # noqa: E402
from kvbook.plot import plain_ticks, subplots  # noqa: E402

pytestmark = pytest.mark.cpu_only("builds or reads the book (nbformat/jupyter, kvbook): no tensors on a device")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def labels(axis) -> list[str]:
    axis.figure.canvas.draw()  # the formatters run when the figure is drawn
    return [t.get_text() for t in axis.get_ticklabels() if t.get_visible()]


def log_axes():
    fig, ax = subplots()
    ax.plot([1, 4096], [0.5, 2_000_000])
    ax.set(xscale="log", yscale="log")
    ax.set_xticks([1, 16, 128, 1024, 4096])
    ax.set_yticks([1, 10, 1000, 1_000_000])
    return ax


def test_log_axes_otherwise_label_powers():
    ax = log_axes()
    assert any("^" in t or "times" in t for t in labels(ax.xaxis))  # mathtext: $\mathdefault{2^{7}}$ etc.


def test_plain_ticks_on_an_axes_labels_both_axes_with_plain_numbers():
    ax = log_axes()
    assert plain_ticks(ax) is ax
    assert labels(ax.xaxis) == ["1", "16", "128", "1,024", "4,096"]
    assert labels(ax.yaxis) == ["1", "10", "1,000", "1,000,000"]
    assert not [t for t in ax.xaxis.get_ticklabels(minor=True) if t.get_text()]  # minor ticks unlabelled


def test_plain_ticks_on_one_axis_leaves_the_other_alone_and_takes_a_format():
    ax = log_axes()
    assert plain_ticks(ax.xaxis, fmt="{:g}") is ax.xaxis
    assert labels(ax.xaxis) == ["1", "16", "128", "1024", "4096"]
    assert any("^" in t for t in labels(ax.yaxis))  # still powers of ten
    ax.set_yticks([0.5, 2.5])
    plain_ticks(ax.yaxis)
    assert labels(ax.yaxis) == ["0.5", "2.5"]  # no trailing zeros, no thousands to group


def test_plain_ticks_rejects_what_is_not_an_axis():
    with pytest.raises(TypeError, match="Axes or Axis"):
        plain_ticks("x")
    with pytest.raises((ValueError, KeyError, IndexError)):
        plain_ticks(subplots()[1], fmt="{:,.12q}")  # a bad format fails at the call


# -- kvbook.setup ---------------------------------------------------------------------------------
@pytest.fixture
def torch_state():
    """Put back what setup changes: it is process-wide."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    rng = torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    torch.set_rng_state(rng)


def test_setup_sets_threads_grad_and_seed(torch_state):
    assert kvbook.setup(threads=1) is None
    assert torch.get_num_threads() == 1 and not torch.is_grad_enabled()
    first = torch.rand(3)
    kvbook.setup(threads=2, grad=True)
    assert torch.get_num_threads() == 2 and torch.is_grad_enabled()
    assert torch.equal(torch.rand(3), first)  # seeded again: the same numbers
    state = torch.get_rng_state()
    kvbook.setup(threads=1, seed=None)
    assert torch.equal(torch.get_rng_state(), state)  # seed=None leaves the generator alone


def test_setup_leaves_the_readers_cores_alone_by_default(torch_state):
    """A chapter uses every core of the reader's machine; only timing cells pin a count."""
    torch.set_num_threads(3)
    kvbook.setup()
    assert torch.get_num_threads() == 3


def test_setup_says_where_the_chapter_runs_on_a_gpu_runtime(torch_state, monkeypatch, capsys):
    """On Colab's T4 the line names the GPU, says the model's cells run there through
    kvbook.device(), and that the cells about the CPU stay on it; one line, nothing on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla T4")
    kvbook.setup()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "Tesla T4" in out
    assert "kvbook.device()" in out and "(cuda)" in out  # the model's cells: on the GPU
    assert "run on the CPU" in out and "roofline" in out  # the CPU's own cells: not moved
    assert "the chapter runs on the CPU" not in out  # the old line, wrong on a GPU runtime
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kvbook.setup()
    assert capsys.readouterr().out == ""  # a CPU runtime: nothing printed


def test_device_is_the_gpu_when_the_runtime_has_one_and_asks_afresh(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kvbook.device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kvbook.device() == torch.device("cpu")  # not cached from the call before
    assert isinstance(kvbook.device(), torch.device)


@pytest.mark.parametrize("kwargs, error", [({"threads": 0}, ValueError), ({"threads": 1.0}, TypeError),
                                           ({"grad": 0}, TypeError), ({"seed": 0.5}, TypeError)])
def test_setup_rejects_bad_arguments_before_changing_anything(torch_state, kwargs, error):
    before = torch.get_num_threads(), torch.is_grad_enabled()
    with pytest.raises(error):
        kvbook.setup(**kwargs)
    assert (torch.get_num_threads(), torch.is_grad_enabled()) == before


def test_importing_kvlib_book_imports_no_plotting_or_widgets():
    import subprocess
    import sys

    code = ("import sys, kvbook; kvbook.setup(threads=1); "
            "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_setup_makes_figures_sharp_in_a_notebook():
    """kvbook.setup() in a Jupyter kernel: a figure comes out as a 2x PNG whose stored
    width is half its pixels, so the notebook and the website show it at its size, sharp on
    a high-resolution screen. Either order: matplotlib imported before setup() or after."""
    import base64
    import struct

    import nbformat
    from nbclient import NotebookClient

    for first in ("", "import matplotlib.pyplot\n"):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(first + "import kvbook\nkvbook.setup()"),
                    nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\n"
                                              "plt.figure(figsize=(4, 3)); plt.plot([1, 2]); plt.show()")]
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
        (out,) = [o for o in nb.cells[1].outputs if "image/png" in o.get("data", {})]
        png = base64.b64decode(out["data"]["image/png"])
        pixels = struct.unpack(">I", png[16:20])[0]  # the IHDR chunk's width
        shown = out["metadata"]["image/png"]["width"]
        assert pixels == 2 * shown, f"{pixels} px stored for {shown} px shown ({first or 'setup first'})"
