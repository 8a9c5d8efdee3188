# pdmesh: `make run` and `make test` set everything up themselves on a fresh machine.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.pdmesh-installed
MODEL       ?= models/tiny-llama
PYTEST_ARGS ?=

.PHONY: install run test bench clean

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)

# CPU torch first (a file on local disk here; an unpinned torch would pull a CUDA build),
# then the project and its test extras.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,mooncake]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) -m services.cli generate --model $(MODEL)

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) bench/offline.py

clean:
	rm -rf $(VENV) models build *.egg-info
