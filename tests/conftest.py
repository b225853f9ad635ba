"""Shared fixtures, and where each test runs. The SmolLM2 fixtures are session-scoped: each test
process loads the real weights (kvlib's and Hugging Face's) once.

``pytest --device cuda tests`` runs the tests marked `device` on the GPU; each other test is marked
``cpu_only("why")``, and a module CPU-only as a whole is not imported there (the GPU machine has only
torch, transformers, pytest, hypothesis, numpy, matplotlib, safetensors and tokenizers) but listed,
with its reason, at the end of the run. Every test must carry one of the two markers: a test with
neither fails to collect. With ``--device cuda`` TF32 is off (``torch.backends.cuda.matmul.allow_tf32``
and ``torch.backends.cudnn.allow_tf32``), so fp32 reference comparisons hold at the fp32 tolerances
of tests/devices.py."""

import ast
import functools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch
from hypothesis import settings

# Every test says where it can run, with one of two markers (enforced at collection, on every run):
#   @pytest.mark.device            runs on --device (cpu, cuda): takes the `device` fixture and puts
#                                  its model, inputs and caches there;
#   @pytest.mark.cpu_only("why")   CPU-only by nature, and the reason says why (SmolLM2's GGUF, the
#                                  book's build, vLLM/kvpress records, the CPU itself, Chromium).
# A module that is CPU-only as a whole says so in one line, `pytestmark = pytest.mark.cpu_only("...")`;
# a marker on a test (or class) overrides its module's. `pytest --device cuda tests` runs the `device`
# tests on the GPU, skips the cpu_only tests of mixed modules with their reason, and does not even
# import a module that is cpu_only as a whole (the GPU machine lacks gguf, nbformat, playwright, ...):
# it reads the module's pytestmark line from the file's text and lists the module, with its reason,
# in a terminal summary section. KVLIB_TEST_COLLECT_AS=cuda collects that way while running on the
# CPU, for the tests of this machinery and for checking the GPU machine's imports in an emulated venv.
#
# Tolerances on CUDA: with --device cuda, pytest_configure turns TF32 off (matmuls and cuDNN), so
# fp32 reference comparisons hold at fp32 tolerances; tests/devices.py states the tolerance used.
DEVICE = torch.device(os.environ.get("KVLIB_TEST_DEVICE", "cpu"))
MARKERS = ("device", "cpu_only")
COLLECT_AS = pytest.StashKey()  # the device collection behaves as for: DEVICE's, or KVLIB_TEST_COLLECT_AS's
NOT_COLLECTED = pytest.StashKey()  # [(path relative to rootdir, reason)]: cpu_only modules left unimported


def pytest_addoption(parser, pluginmanager):
    parser.addoption("--device", default=None,
                     help="run the tests marked `device` on this torch device (cpu, cuda, cuda:1) and skip the "
                          "ones marked cpu_only; default $KVLIB_TEST_DEVICE, else cpu")
    if not pluginmanager.hasplugin("nbval"):
        # pyproject's addopts name nbval's options (the book's notebooks run as tests); where nbval is
        # missing (the GPU machine), accept and ignore them, so `pytest --device cuda tests` runs there as is
        group = parser.getgroup("nbval (absent: options accepted and ignored)")
        group.addoption("--nbval-lax", action="store_true")
        group.addoption("--nbval-current-env", action="store_true")
        group.addoption("--nbval-cell-timeout", default=None)


def requested_device(name: str) -> torch.device:
    """The device ``--device name`` asks for, or a ``pytest.UsageError`` that says why it cannot run:
    a device this machine lacks must stop the run, never pass by skipping everything."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"--device {name!r} is not a torch device ({e}): use cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise pytest.UsageError(f"--device {name}: this torch ({torch.__version__}) sees {count} CUDA "
                                    f"device(s), so nothing would run there; run on a machine with a GPU, or "
                                    f"drop --device to test on the CPU")
        device = torch.device("cuda", device.index or 0)  # concrete (cuda:0), as a tensor's .device reads
    elif device.type != "cpu":
        raise pytest.UsageError(f"--device {name}: the suite runs on cpu or cuda, got {device.type}")
    return device


def pytest_configure(config):
    global DEVICE
    config.addinivalue_line("markers", "device: runs on --device / KVLIB_TEST_DEVICE (default cpu); the test "
                                       "takes the `device` fixture")
    config.addinivalue_line("markers", "cpu_only(reason): CPU-only by nature, and the reason says why; "
                                       "--device cuda skips it (a whole module: does not import it)")
    DEVICE = requested_device(config.getoption("--device") or os.environ.get("KVLIB_TEST_DEVICE", "cpu"))
    as_ = os.environ.get("KVLIB_TEST_COLLECT_AS", "")
    if as_ not in ("", "cpu", "cuda"):
        raise pytest.UsageError(f"KVLIB_TEST_COLLECT_AS={as_!r}: use cuda (collect as --device cuda does, "
                                f"running on the CPU) or leave it unset")
    config.stash[COLLECT_AS] = as_ or DEVICE.type
    config.stash[NOT_COLLECTED] = []
    if DEVICE.type == "cuda":  # fp32 references at fp32 tolerances: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@functools.lru_cache(maxsize=None)
def module_cpu_only_reason(path) -> str | None:
    """The reason in a module's ``pytestmark = pytest.mark.cpu_only("...")`` line, read from the file's
    text without importing it; None when the module is not CPU-only as a whole."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None  # let pytest import it and report the error
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                 for t in node.targets)):
            marks = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            for call in marks:
                if (isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.mark.cpu_only"
                        and call.args and isinstance(call.args[0], ast.Constant)
                        and isinstance(call.args[0].value, str) and call.args[0].value.strip()):
                    return call.args[0].value.strip()
    return None


def pytest_ignore_collect(collection_path, config):
    if config.stash[COLLECT_AS] == "cpu" or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    reason = module_cpu_only_reason(collection_path)
    if reason is None:
        return None
    config.stash[NOT_COLLECTED].append((os.path.relpath(collection_path, config.rootpath), reason))
    return True


def marker_choice(item):
    """The marker that decides where ``item`` runs: the closest of `device` / `cpu_only` (test, then class,
    then module), and a message when there is none, its reason is empty, or the choice contradicts a module
    that is CPU-only as a whole."""
    chosen = next(((node, m) for node, m in item.iter_markers_with_node() if m.name in MARKERS), None)
    if chosen is None:
        return None, f"{item.nodeid}: marked neither `device` nor `cpu_only`"
    node, mark = chosen
    if mark.name == "cpu_only":
        reason = mark.args[0] if mark.args else mark.kwargs.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return None, (f"{item.nodeid}: cpu_only needs a non-empty reason, e.g. "
                          f"@pytest.mark.cpu_only(\"needs SmolLM2's weights (the GGUF), which the GPU machine lacks\")")
    elif isinstance(node, pytest.Function | pytest.Class) and module_cpu_only_reason(item.path):
        return None, (f"{item.nodeid}: marked `device` in a module that is cpu_only as a whole (its pytestmark), "
                      f"which --device cuda never imports; mark the module's tests one by one instead")
    return mark, None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A collector (module, class) whose tests do not say where they run fails to collect, naming them."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.passed:
        return
    errors = [err for item in rep.result if isinstance(item, pytest.Item) for _, err in [marker_choice(item)] if err]
    if errors:
        rep.outcome = "failed"
        rep.longrepr = "\n".join(errors + [
            "each test says where it runs; choose one of the two markers: @pytest.mark.device (the test takes "
            "the `device` fixture and runs on --device cuda) or @pytest.mark.cpu_only(\"why it cannot run on "
            "a GPU\"); a module-level `pytestmark = pytest.mark.cpu_only(\"...\")` covers a whole module"])
        rep.result = []


def pytest_collection_modifyitems(config, items):
    if config.stash[COLLECT_AS] == "cpu":
        return
    for item in items:
        mark, _ = marker_choice(item)
        if mark is not None and mark.name == "cpu_only":
            reason = mark.args[0] if mark.args else mark.kwargs["reason"]
            item.add_marker(pytest.mark.skip(reason=f"cpu_only: {reason}"))


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(NOT_COLLECTED, [])
    if config.stash.get(COLLECT_AS, "cpu") == "cpu":
        return
    terminalreporter.section(f"cpu_only modules not collected (--device {config.stash[COLLECT_AS]})")
    for path, reason in sorted(left):
        terminalreporter.write_line(f"{path}: {reason}")
    terminalreporter.write_line(f"{len(left)} module(s) not collected: CPU-only as a whole")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


# Two cores: under xdist each of the two workers gets one thread; alone, use both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

settings.register_profile("kvlib", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("kvlib")


@pytest.fixture(scope="session")
def smollm2():
    import kvlib

    return kvlib.load_smollm2()


@pytest.fixture(scope="session")
def hf_smollm2():
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlib.pretrained import smollm2_gguf_path

    transformers.logging.set_verbosity_error()
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.fixture(scope="module")
def tiny_model(device):
    """A 2-layer GQA model on the test device, with sharp random logits (no argmax ties: greedy tokens
    agree across devices and kernels), vocabulary 50."""
    from kvlib import ModelConfig, Transformer

    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=128)
    m = Transformer(cfg, device=device)
    m.reset_parameters(seed=0, std=0.2)
    return m.eval()
