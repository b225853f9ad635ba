"""What serves the book rather than teaches the cache: figures, diagrams, the widget panel, the website's data.

* `kvbook.tables`: a cell's numbers as a small aligned table (``kvbook.table(rows)``);
* `kvbook.plot`: the book's one figure style (`subplots`, `COLORS`, `plain_ticks`);
* `kvbook.diagrams`: pictures of the ideas, drawn before they are measured;
* `kvbook.explorer`: the ipywidgets panel over `kvlib.memory`'s arithmetic;
* `kvbook.web`: the website explorers' data (``python -m kvbook.web OUT.js``);
* `kvbook.pool`: step through a paged pool's trace, one engine or two side by side
  (``pool_explorer``), and the website's copy of the traces (``python -m kvbook.pool OUT.js``);
  `kvbook.pooltrace` reads and checks a trace;
* `kvbook.requires`: a cell that needs a newer library than the reader has says so
  and skips itself (``%%requires transformers>=5.0``);
* `kvbook.reader`: the reader edition of a chapter, the notebook Colab and the
  download button open, with no MyST left in it (``python -m kvbook.reader``).

These pull in matplotlib or ipywidgets, so ``import kvlib`` never imports them; import
each on its own (``import kvbook.plot``). This package itself holds `setup`, the one
line every chapter starts with, `device`, where the cells that move a model put it (the
GPU when the runtime has one), `glue`, which hands a cell's numbers to the website's
prose, and `table`, which prints them; it imports neither.
"""

from __future__ import annotations

from .tables import table

__all__ = ["device", "glue", "setup", "table"]


def setup(threads: int | None = None, grad: bool = False, seed: int | None = 0) -> None:
    """Put torch in the state every chapter runs in: ``kvbook.setup()``.

    * ``threads``: by default torch keeps the count it chose, one thread a core of the
      reader's machine, so an 8-core laptop runs the chapter on 8. A cell that *times*
      something pins its own count for just those lines, ``with kvlib.timing.threads(1):``,
      which puts the count back afterwards; ``setup(threads=n)`` sets it for the whole
      notebook, for a reader who wants to.
    * ``torch.set_grad_enabled(grad)``: off by default. The book only runs models
      forward, and without autograd no timing pays for recording a backward pass.
    * ``torch.manual_seed(seed)``: every ``torch.randn`` without a generator of its own
      draws the same numbers on every run. ``seed=None`` leaves the generator alone.

    The settings are process-wide, so calling it again simply sets them again.
    ``threads`` must be ``None`` or a positive int (``TypeError``/``ValueError``
    otherwise, checked before anything changes). Returns ``None``, so a notebook cell
    ending with it prints nothing.

    In IPython (Jupyter, Colab, the book's build) it also registers the ``%%requires``
    cell magic of `kvbook.requires`, and draws figures as 2x PNGs ("retina"): shown at
    their size, sharp on a high-resolution screen, in the notebook and on the website. On
    a runtime with a CUDA GPU (Colab's T4, say) it prints one line naming what runs where:
    the cells that put a model on `device()` run on that GPU, and the cells about the CPU
    (its roofline, its threads, AMX and oneDNN) still run on the CPU. On a CPU runtime it
    prints nothing.
    """
    import torch

    from kvlib.validate import an_int, positive_int

    if threads is not None:
        positive_int("threads", threads)
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool, got {type(grad).__name__} {grad!r}")
    if seed is not None:
        an_int("seed", seed)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    if seed is not None:
        torch.manual_seed(seed)
    from .requires import register_magic

    register_magic()
    _sharp_figures()
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name(0)}. The cells that put the model on kvbook.device() "
              "run there (cuda); the cells about the CPU (its roofline, threads, AMX) run on the CPU.")


def device() -> torch.device:
    """Where a chapter's compute cells put the model and its inputs: ``cuda`` on a runtime
    with a CUDA GPU (Colab's T4, say), else ``cpu``.

    ``model, tok = kvlib.load_smollm2(device=kvbook.device())``, and every tensor the model
    meets goes there too (``torch.tensor(ids, device=model.device)``). A cell about the CPU
    itself (its roofline, its threads, AMX) keeps ``"cpu"`` and says so. Asked afresh on
    each call, so it follows ``torch.cuda.is_available()``.
    """
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def glue(**numbers: float) -> None:
    """Hand a cell's numbers to the website's prose: ``kvbook.glue(ch4_gb=gb, ch4_n=n)``.

    Each keyword becomes a name the page's text quotes as ``{glue:text}`ch4_gb:.1f```; the
    cell shows nothing more (the numbers it prints are the reader's own). Glue carries
    *numbers*: an int or a float (numpy's too), or a short string of numbers such as
    ``"2 of 3"`` or ``"0, 1 and 11"``; numpy's scalars are glued as Python's, whose text
    the prose's format spec (``:.1f``) reads. Words chosen from a measurement ("faster",
    "identical to") belong in the prose, which says what each value would mean, so a
    string with words in it is a ``TypeError``, and so is a bool.
    """
    import numbers as _numbers

    from myst_nb import glue as _glue

    for name, value in _checked(numbers).items():
        if type(value) not in (int, float, str):  # numpy's scalars: their repr is np.float64(...)
            value = int(value) if isinstance(value, _numbers.Integral) else float(value)
        _glue(name, value, display=False)


def _checked(values: dict) -> dict:
    """``values`` if every one is a number or a string of numbers; else a TypeError naming it."""
    import numbers
    import re

    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            raise TypeError(f"glue carries numbers: {name}={value!r} is a {type(value).__name__}; "
                            "pass an int or a float (float(x) for a tensor) and say the words in the prose")
        words = re.findall(r"[A-Za-z]{3,}", value) if isinstance(value, str) else []
        if [w for w in words if w != "and"]:
            raise TypeError(f"glue carries numbers, not words: {name}={value!r}; "
                            "put the words in the prose, which can say what each value would mean")
    return values


def _sharp_figures() -> None:
    """Inline figures at twice their pixels (IPython's "retina" format), outside IPython nothing."""
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: no inline figures to sharpen
        return
    import sys

    shell = get_ipython()
    if shell is None:
        return
    shell.config.InlineBackend.figure_formats = {"retina"}  # read when the inline backend starts
    inline = sys.modules.get("matplotlib_inline.backend_inline")
    if inline is not None:  # it started already: matplotlib was imported before setup()
        inline.set_matplotlib_formats("retina")
