PYTHON ?= python3
PIP := $(PYTHON) -m pip
# One install stamp per interpreter (hash of its sys.prefix): each virtual environment on the same clone
# gets its own install, and a stamp whose environment lost specdec is redone.
PY_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')
STAMP := .stamp-install-$(PY_ID)

# torch is pinned to the local CPU build: an unpinned torch pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	@touch $(STAMP)

install:
	@$(PYTHON) -c 'import specdec' 2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP) PYTHON="$(PYTHON)"

demo: install
	$(PYTHON) -m specdec demo

test: install
	$(PYTHON) -m pytest -q

.PHONY: install demo test
