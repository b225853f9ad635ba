"""The usage examples in kvlib's docstrings run, so a renamed argument breaks a test, not a reader.

Every kvlib module (packages included, walked with pkgutil) whose source holds a ``>>>`` example is
imported, its docstrings collected with `doctest.DocTestFinder`, and each docstring's examples run as
one test, named by the docstring's qualified name (``kvlib.generate.generate``). A module whose
import needs a package that is not installed (Hugging Face, vLLM, kvpress) is skipped, saying which.

An example sees what a reader who typed ``import torch`` and ``import kvlib`` sees, not the
module's own globals: a private helper it leans on would not be there for the reader either.

`LEARNER_FACING` lists the names a learner calls directly; each must keep at least one example.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest
import torch

import kvlib

pytestmark = pytest.mark.cpu_only("about the repository (layout, versions, CI, docstrings), not kvlib on a device")

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# The public names a learner calls directly, by the path a chapter uses: each carries an example.
LEARNER_FACING = (
    "kvlib.ModelConfig", "kvlib.Transformer", "kvlib.prefill", "kvlib.decode_step", "kvlib.SamplingParams",
    "kvlib.generate", "kvlib.generate_naive", "kvlib.stream",
    "kvlib.DynamicCache", "kvlib.StaticCache", "kvlib.PaddedBatch", "kvlib.PagedCache", "kvlib.PagedCache.step",
    "kvlib.check.check_cache", "kvlib.memory.kv_cache_bytes", "kvlib.memory.max_tokens", "kvlib.memory.max_batch",
    "kvlib.cost.step_flops", "kvlib.hardware.step_time", "kvlib.quant.QuantizedCache", "kvlib.quant.FP8Cache",
    "kvlib.gqa.convert_kv_heads", "kvlib.evict.WindowCache", "kvlib.evict.SinkCache", "kvlib.evict.H2OCache",
    "kvlib.press.prefill", "kvlib.speculative.speculative_generate", "kvlib.Engine", "kvlib.radix.RadixCache",
    "kvlib.layers.LayerKind", "kvlib.hybrid.HybridCache", "kvlib.distributed.tp.plan",
    "kvlib.distributed.cluster.transfer_time", "kvlib.distributed.disk.DiskStore",
)


TOOLING = ("kvbook", "kvbench", "vllmcheck", "kvpresscheck")  # beside kvlib: their examples run too


def modules_with_examples() -> list[str]:
    """Every kvlib module (and the tooling's beside it) whose source has a ``>>>`` line, found without importing
    the rest."""
    names = ["kvlib"] + [m.name for m in pkgutil.walk_packages(kvlib.__path__, "kvlib.")]
    for top in TOOLING:
        path = [str(Path(importlib.util.find_spec(top).origin).parent)]
        names += [top] + [m.name for m in pkgutil.walk_packages(path, f"{top}.")]
    found = []
    for name in sorted(names):
        if name.endswith("__main__"):
            continue
        origin = importlib.util.find_spec(name).origin
        if origin and origin.endswith(".py") and ">>>" in Path(origin).read_text():
            found.append(name)
    return found


def collect() -> list:
    """One entry per docstring with examples: a `doctest.DocTest`, or a skip for an absent package."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    out = []
    for name in modules_with_examples():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "kvlib":
                raise  # a broken kvlib import is a failure, not a skip
            out.append(pytest.param(None, id=name, marks=pytest.mark.skip(
                reason=f"{name} needs {e.name}, which is not installed")))
            continue
        for test in finder.find(module, name, globs={"torch": torch, "kvlib": kvlib}):
            if test.examples and (test.name == name or test.name.startswith(name + ".")):
                out.append(pytest.param(test, id=test.name))
    return sorted(out, key=lambda p: p.id)


DOCTESTS = collect()


@pytest.mark.parametrize("test", DOCTESTS)
def test_docstring_examples_run(test: doctest.DocTest):
    torch.manual_seed(0)  # an example that draws random numbers without a seed of its own still repeats
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report: list[str] = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {test.name} failed:\n" + "".join(report)


def resolve(path: str):
    """``"kvlib.memory.max_tokens"`` -> the object, reached attribute by attribute as a reader would."""
    parts = path.split(".")
    obj = kvlib
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):  # a subpackage's module that its package does not import (kvlib.distributed.tp)
            importlib.import_module(".".join(parts[: i + 1]))
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path", LEARNER_FACING)
def test_learner_facing_names_have_an_example(path: str):
    doc = getattr(resolve(path), "__doc__", None) or ""
    examples = doctest.DocTestParser().get_examples(doc)
    assert examples, f"{path} has no >>> example in its docstring"


def test_every_listed_example_is_collected():
    """The examples the names above carry are among those run (none hides in an unwalked module)."""
    collected = {p.id for p in DOCTESTS}
    for path in LEARNER_FACING:
        obj = resolve(path)
        qualname = f"{obj.__module__}.{obj.__qualname__}"
        assert qualname in collected, f"{path} ({qualname}) has an example that no test runs"


@pytest.mark.parametrize("path", LEARNER_FACING)
def test_docstrings_with_examples_are_valid_restructuredtext(path: str):
    """Sphinx renders these docstrings (and builds with -W): an example must not break the markup."""
    import inspect
    import io

    docutils_core = pytest.importorskip("docutils.core")
    warnings = io.StringIO()
    tree = docutils_core.publish_doctree(inspect.getdoc(resolve(path)), settings_overrides={
        "report_level": 2, "halt_level": 5, "warning_stream": warnings})
    assert not warnings.getvalue(), f"{path}'s docstring is not clean reStructuredText:\n{warnings.getvalue()}"
    assert any(node.tagname == "doctest_block" for node in tree.findall()), f"{path}: no doctest block rendered"
