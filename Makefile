# The README's two commands: `make run` and `make test`. Both set up .venv first when needed.
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup test-tools run smoke test test-matrix test-unit docker-check
setup:
	PARBENCH_VENV=$(VENV) scripts/setup-env.sh

# Slurm, munge, iproute2 and openssh-server for the multi-node tests, chromium for the report-rendering test
# (apt, where root; they skip with the reason elsewhere).
test-tools:
	scripts/install-test-tools.sh

run: setup
	$(PYTHON) -m harness run --matrix full

smoke: setup
	$(PYTHON) -m harness run --matrix smoke

# Everything but the matrix tier's tests (under 10 minutes here): those judge cells of every strategy in bf16 and
# fp16, checkpointed, at 4 ranks, on ResNet-20 and with planted faults, and .ci/run runs them after this.
test: setup test-tools
	$(PYTHON) -m pytest -m "not matrix"

test-matrix: setup test-tools
	$(PYTHON) -m pytest -m matrix

# The unit tier: the tests that start no process (marked otherwise `launch`; tests/launch_guard.py), under a minute.
test-unit: setup
	$(PYTHON) -m pytest -m "not launch"

# Build the reproduction image on a local Debian base and run cells in it (root; docs/setup.md). CI runs it
# when the image's inputs changed since the commit recorded in .ci/docker-check-passed.
docker-check:
	scripts/docker-check.sh
