# Set-up and checks. `make test` and `make demo` work on a fresh clone with nothing but python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here, for the dev/test set-up only: this exact CPU wheel is what the test
# machines have locally. The library itself declares torch>=2.3.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test lint e2e-loop bench demo venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check ckptools tests examples benchmarks
	$(VENV)/bin/ruff format --check ckptools tests examples benchmarks

# The flake check of the end-to-end resume tests: the whole file N times in a row (default 20).
e2e-loop: $(STAMP)
	for i in $$(seq 1 $${N:-20}); do $(PY) -m pytest -q -x -p no:cacheprovider tests/test_train_ddp_e2e.py || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

bench: $(STAMP)
	$(PY) benchmarks/bench_save.py --gib 1
	$(PY) benchmarks/bench_cli.py --gib 1

demo: $(STAMP)
	$(PY) examples/demo.py --workdir runs/demo
