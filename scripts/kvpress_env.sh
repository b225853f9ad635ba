#!/usr/bin/env bash
# `make kvpress`: NVIDIA's kvpress in a virtual environment of its own (it pins transformers<5.3; the book pins 5.24),
# with kvlib installed editable beside it, and SmolLM2 written in Hugging Face format (kvpress runs HF models).
# Usage: scripts/kvpress_env.sh [VENV]   (default .venv-kvpress). Safe to run again: it only adds what is missing.
# The install took 1 min 52 s on a loaded 2-core machine (58 wheels, 1.4 GB, from the local package index).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${1:-.venv-kvpress}")"  # a link kept by .ci/envcache: `python -m venv` refuses links
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  python -m venv "$venv"
fi
# Exactly the tried set, and nothing it does not list: --no-deps, so no other torch can be pulled in.
"$py" -m pip install -q --no-deps -r requirements-kvpress.txt
"$py" -m pip install -q --no-deps -e .
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error "$py" -c \
  "import kvpress, transformers, kvpresscheck.kvpress_side; print('kvpress imports, transformers', transformers.__version__)"
# Written again when the code that writes it changes (a kept environment, .ci/envcache, would else serve an old
# export): its source hash is stored beside it.
source_hash="$(cat kvlib/hf.py kvlib/pretrained.py vllmcheck/driver.py | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/smollm2-hf/.source" 2>/dev/null)" != "$source_hash" ]; then
  rm -rf "$venv/smollm2-hf"
  # Written by the book's python (${PY:-python}): it has the GGUF reader and SmolLM2's weights package, which this
  # environment does not need. The checkpoint is plain LlamaForCausalLM safetensors, read by transformers 5.2 too.
  HF_HUB_DISABLE_PROGRESS_BARS=1 "${PY:-python}" -m vllmcheck export "$venv/smollm2-hf"
  echo "$source_hash" > "$venv/smollm2-hf/.source"
fi
