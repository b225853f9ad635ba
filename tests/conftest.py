"""Shared fixtures. The SmolLM2 fixtures are session-scoped: each test process
loads the real weights (kvlib's and Hugging Face's) once."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch
from hypothesis import settings

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
