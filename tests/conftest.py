"""Shared fixtures. The SmolLM2 fixtures are session-scoped: each test process
loads the real weights (kvlib's and Hugging Face's) once."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch
from hypothesis import settings

# `pytest --device cuda` (or KVLIB_TEST_DEVICE=cuda) runs the tests marked `device` there
# (tests/test_device.py: the reference cross-checks, written device-agnostic) and skips the
# CPU-only rest with a reason. Set once, in pytest_configure, from the option.
DEVICE = torch.device(os.environ.get("KVLIB_TEST_DEVICE", "cpu"))


def pytest_addoption(parser):
    parser.addoption("--device", default=None,
                     help="run the tests marked `device` on this torch device (cpu, cuda, cuda:1) and skip the "
                          "CPU-only rest; default $KVLIB_TEST_DEVICE, else cpu")


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
    elif device.type != "cpu":
        raise pytest.UsageError(f"--device {name}: the suite runs on cpu or cuda, got {device.type}")
    return device


def pytest_configure(config):
    global DEVICE
    config.addinivalue_line("markers", "device: runs on --device / KVLIB_TEST_DEVICE (default cpu)")
    DEVICE = requested_device(config.getoption("--device") or os.environ.get("KVLIB_TEST_DEVICE", "cpu"))


def pytest_collection_modifyitems(config, items):
    if DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU-only check; --device {DEVICE} runs only the tests marked `device`")
    for item in items:
        if "device" not in item.keywords:
            item.add_marker(skip)


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
def tiny_model():
    """A 2-layer GQA model with sharp random logits (no argmax ties), vocabulary 50."""
    from kvlib import ModelConfig, Transformer

    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=128)
    m = Transformer(cfg)
    m.reset_parameters(seed=0, std=0.2)
    return m.eval()
