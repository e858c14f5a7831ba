# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strop-installed

.PHONY: setup demo test test-slow bench clean

setup: $(STAMP)

# CPU machines get torch's CPU build first so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@start=$$(date +%s); \
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi && \
	$(BIN)/pip install -q -e '.[dev]' && \
	echo "setup: $$(( $$(date +%s) - start )) s" && touch $(STAMP)

demo: setup
	$(BIN)/strop demo

test: setup
	$(BIN)/python -m pytest

test-slow: setup
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf runs .pytest_cache
