"""What serves the book rather than teaches the cache: figures, diagrams, the widget panel, the website's data.

* `kvlib.book.plot`: the book's one figure style (`subplots`, `COLORS`, `plain_ticks`);
* `kvlib.book.diagrams`: pictures of the ideas, drawn before they are measured;
* `kvlib.book.explorer`: the ipywidgets panel over `kvlib.memory`'s arithmetic;
* `kvlib.book.web`: the website explorers' data (``python -m kvlib.book.web OUT.json``).

These pull in matplotlib or ipywidgets, so ``import kvlib`` never imports them; import
each on its own (``import kvlib.book.plot``).
"""
