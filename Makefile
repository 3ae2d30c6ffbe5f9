PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .venv-stamp

# torch is pinned to the local CPU build: an unpinned torch pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) -m specdec demo

test: install
	$(PYTHON) -m pytest -q

.PHONY: install demo test
