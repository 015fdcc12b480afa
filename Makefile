# Two commands matter: `make run` (serve the embedded default) and `make test` (the whole suite).
# Each sets up what it needs on a fresh machine: a venv with the locked packages (torch first, pinned,
# so no CUDA build is pulled by accident), and for tests a redis-server binary and two small venvs.
#
# Dependencies: pyproject.toml says what the code needs (runtime + extras), requirements.txt is the one
# lock `make` installs from. TORCH_INDEX_URL picks torch's build where no local wheel is there:
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu     (CPU only)
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128   (CUDA 12.8)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
EXTRAS := test,dev,plot,bench
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
# A second, minimal venv holding the client SDK installed from sdk/ (grpcio and protobuf, nothing else): the SDK
# test runs in it. Rebuilt when the lock, the SDK's build file or its source change (their hash names the stamp).
SDK_VENV := .venv-sdk
SDK_HASH := $(shell cat requirements.txt sdk/pyproject.toml $(sort $(filter-out %/__pycache__,$(wildcard splitserve_client/*.py \
	splitserve_client/protocol/*))) | sha1sum | cut -c1-12)
SDK_STAMP := $(SDK_VENV)/.installed-$(SDK_HASH)
# A third venv holding exactly the lower bounds of the runtime dependencies: tests/test_lower_bounds.py
# serves a request from it, so the bounds in pyproject.toml are a tested claim.
LOWER_VENV := .venv-lower
LOWER_HASH := $(shell $(PYTHON) scripts/lower_bounds.py pyproject.toml | sha1sum | cut -c1-12)
LOWER_STAMP := $(LOWER_VENV)/.installed-$(LOWER_HASH)
PYTEST_ARGS ?=

.PHONY: setup sdk-venv lower-venv lock run lint lint-block test suite test-deps bench-engine demo-model clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_INDEX) $(TORCH_PIN)
	$(PY) -m pip install -q -c requirements.txt -e '.[$(EXTRAS)]'
	touch $@

sdk-venv: $(SDK_STAMP)

$(SDK_STAMP):
	rm -rf $(SDK_VENV)
	$(PYTHON) -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/python -m pip install -q -c requirements.txt ./sdk
	rm -rf sdk/build sdk/*.egg-info
	touch $@

lower-venv: $(LOWER_STAMP)

# Rebuilt only when the lower bounds themselves change (their hash names the stamp).
$(LOWER_STAMP):
	rm -rf $(LOWER_VENV)
	$(PYTHON) -m venv $(LOWER_VENV)
	$(LOWER_VENV)/bin/python -m pip install -q $(TORCH_INDEX) $(TORCH_PIN)
	$(PYTHON) scripts/lower_bounds.py pyproject.toml > $(LOWER_VENV)/lower-bounds.txt
	$(LOWER_VENV)/bin/python -m pip install -q -r $(LOWER_VENV)/lower-bounds.txt
	touch $@

# Rewrites requirements.txt from a fresh resolve of pyproject.toml under the current pins (delete a
# package's line first to move it to the newest version its bounds allow).
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q $(TORCH_INDEX) $(TORCH_PIN)
	.venv-lock/bin/python -m pip install -q -c requirements.txt -e '.[$(EXTRAS)]'
	{ grep '^#' requirements.txt; echo '$(TORCH_PIN)'; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > requirements.txt.new
	mv requirements.txt.new requirements.txt
	rm -rf .venv-lock

test-deps: sdk-venv lower-venv
	@command -v redis-server >/dev/null 2>&1 || scripts/install_redis.sh
	@command -v promtool >/dev/null 2>&1 || scripts/install_prometheus.sh

# The router serves inside the loopback sandbox on unix sockets in .run/; a forwarder outside it makes
# 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000 (OpenAI HTTP) reach them from other shells (scripts/run_local.sh).
run: setup
	scripts/run_local.sh $(SERVE_ARGS)

# Lint (ruff: rules and format), type-check (mypy) and check the layering (import-linter) of the product packages
# and benchmarks; the rules and the
# paths mypy checks are in pyproject.toml. `make test` runs it first, so CI does.
LINT_PATHS := engine kvtransfer splitserve_client common prefix_index kv_store policies sim prefill_worker decode_worker cluster router \
	loadtest splitserve benchmarks

lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The three venvs install side by side; lint (one core, mostly mypy) runs beside the suite, whose cluster
# tests leave the CPU idle while they wait on rates and timeouts. Either failing fails `make test`; a
# lint failure is reported once the suite ends (`make lint` alone fails fast). Lint's output is printed in
# one block when it ends, so that the suite's progress streams as it runs.
test:
	$(MAKE) --no-print-directory -j3 lint-block suite

lint-block: setup
	@out=$$($(MAKE) --no-print-directory lint 2>&1); status=$$?; printf '%s\n' "$$out"; exit $$status

# TEST_WORKERS=2 runs the suite on two pytest-xdist processes, each module whole on one of them (its
# module-scoped cluster starts once): about a fifth faster on 2 cores, since the cluster tests spend much
# of their time waiting on rates, timeouts and process starts. One process is the default: under two,
# the fault tests' replacements start on a busier machine, and one of them (a TP=2 rank killed with the
# shared store) has stalled past its timeout.
TEST_WORKERS ?= 0
suite: setup test-deps
	PY=$(PY) scripts/run_tests.sh $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope) $(PYTEST_ARGS)

bench-engine: setup
	scripts/in_sandbox.sh $(PY) -m benchmarks.bench_engine

clean:
	rm -rf $(VENV) $(SDK_VENV) $(LOWER_VENV) .venv-lock build *.egg-info
