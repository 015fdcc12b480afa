# Two commands matter: `make run` (serve the embedded default) and `make test` (the whole suite).
# Each sets up what it needs on a fresh machine: a venv with pinned packages (torch first, pinned,
# so no CUDA build is ever pulled), and for tests a redis-server binary.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
# A second, minimal venv with only what the client SDK needs: the SDK test runs in it.
SDK_VENV := .venv-sdk
SDK_PINS := $(shell grep -E '^(grpcio|protobuf)==' requirements.txt | tr '\n' ' ')
SDK_STAMP := $(SDK_VENV)/.installed-$(REQ_HASH)
PYTEST_ARGS ?=

.PHONY: setup sdk-venv run test test-deps bench-engine demo-model clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

sdk-venv: $(SDK_STAMP)

$(SDK_STAMP): requirements.txt
	rm -rf $(SDK_VENV)
	$(PYTHON) -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/python -m pip install -q $(SDK_PINS)
	touch $@

test-deps: sdk-venv
	@command -v redis-server >/dev/null 2>&1 || scripts/install_redis.sh

# The router serves inside the loopback sandbox on unix sockets in .run/; a forwarder outside it makes
# 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000 (OpenAI HTTP) reach them from other shells (scripts/run_local.sh).
run: setup
	scripts/run_local.sh $(SERVE_ARGS)

test: setup test-deps
	PY=$(PY) scripts/run_tests.sh $(PYTEST_ARGS)

bench-engine: setup
	scripts/in_sandbox.sh $(PY) -m benchmarks.bench_engine

clean:
	rm -rf $(VENV) $(SDK_VENV) build *.egg-info
