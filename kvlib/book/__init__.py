"""What serves the book rather than teaches the cache: figures, diagrams, the widget panel, the website's data.

* `kvlib.book.plot`: the book's one figure style (`subplots`, `COLORS`, `plain_ticks`);
* `kvlib.book.diagrams`: pictures of the ideas, drawn before they are measured;
* `kvlib.book.explorer`: the ipywidgets panel over `kvlib.memory`'s arithmetic;
* `kvlib.book.web`: the website explorers' data (``python -m kvlib.book.web OUT.json``).

These pull in matplotlib or ipywidgets, so ``import kvlib`` never imports them; import
each on its own (``import kvlib.book.plot``). This package itself holds only `setup`,
the one line every chapter starts with, and imports neither.
"""

from __future__ import annotations


def setup(threads: int = 1, grad: bool = False, seed: int | None = 0) -> None:
    """Put torch in the state every chapter runs in: ``kvlib.book.setup(threads=1)``.

    * ``torch.set_num_threads(threads)``: a chapter that times small steps picks one
      thread (a busy second core cannot stall it mid-step); one that times big
      matrix products picks the build machine's two cores. For a few lines on another
      count, use ``with kvlib.timing.threads(n):``, which puts the count back.
    * ``torch.set_grad_enabled(grad)``: off by default. The book only runs models
      forward, and without autograd no timing pays for recording a backward pass.
    * ``torch.manual_seed(seed)``: every ``torch.randn`` without a generator of its own
      draws the same numbers on every run. ``seed=None`` leaves the generator alone.

    The settings are process-wide, so calling it again simply sets them again.
    ``threads`` must be a positive int (``TypeError``/``ValueError`` otherwise, checked
    before anything changes). Returns ``None``, so a notebook cell ending with it
    prints nothing.
    """
    import torch

    from ..validate import an_int, positive_int

    positive_int("threads", threads)
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool, got {type(grad).__name__} {grad!r}")
    if seed is not None:
        an_int("seed", seed)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    if seed is not None:
        torch.manual_seed(seed)
