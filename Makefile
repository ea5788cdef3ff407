# The README's two commands: `make run` and `make test`. Both set up .venv first when needed.
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup run smoke test
setup:
	PARBENCH_VENV=$(VENV) scripts/setup-env.sh

run: setup
	$(PYTHON) -m harness run --matrix full

smoke: setup
	$(PYTHON) -m harness run --matrix smoke

test: setup
	$(PYTHON) -m pytest
