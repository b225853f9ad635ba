#!/usr/bin/env bash
# `make vllm`: vLLM's CPU build in a virtual environment of its own (it pins transformers<5.20; the book pins 5.24),
# with kvlib installed editable beside it, and SmolLM2 written in Hugging Face format (vLLM does not read our GGUF).
# Usage: scripts/vllm_env.sh [VENV]   (default .venv-vllm). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${1:-.venv-vllm}")"  # a link kept by .ci/envcache: `python -m venv` refuses links
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  python -m venv "$venv"
fi
# Exactly the tried set, and nothing it does not list (see requirements-vllm.txt for why --no-deps).
"$py" -m pip install -q --no-deps -r requirements-vllm.txt
"$py" -m pip install -q --no-deps -e .
"$py" -c "import vllm, vllmcheck.vllm_side; print('vLLM', vllm.__version__, 'imports')"
# Written again when the code that writes it changes (a kept environment, .ci/envcache, would else serve an old
# export): its source hash is stored beside it.
source_hash="$(cat kvlib/hf.py kvlib/pretrained.py vllmcheck/driver.py | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/smollm2-hf/.source" 2>/dev/null)" != "$source_hash" ]; then
  rm -rf "$venv/smollm2-hf" "$venv/kvlib-cache"
  # A conversion cache of its own: the book's (~/.cache/kvlib) is made by the book's transformers
  KVLIB_CACHE_DIR="$venv/kvlib-cache" "$py" -m vllmcheck export "$venv/smollm2-hf"
  echo "$source_hash" > "$venv/smollm2-hf/.source"
fi
