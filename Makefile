# The README's two commands: `make run` and `make test`. Both set up .venv first when needed.
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup test-tools run smoke test test-launch test-matrix test-unit docker-check
setup:
	PARBENCH_VENV=$(VENV) scripts/setup-env.sh

# Slurm, munge, iproute2 and openssh-server for the multi-node tests, chromium for the report-rendering test
# (apt, where root; they skip with the reason elsewhere): the launch tier's.
test-tools:
	scripts/install-test-tools.sh

run: setup
	$(PYTHON) -m harness run --matrix full

smoke: setup
	$(PYTHON) -m harness run --matrix smoke

# The README's test command: the unit tier (no process started) and tests/test_core_launch.py, which starts each
# launcher once end to end (torchrun, DeepSpeed's, horovodrun), spread over the cores: 4.3 minutes from a fresh clone
# on the 2-core VM, setup (1.3) included (2026-11-29).
test: setup
	$(PYTHON) -m pytest -m "not launch or core" -n auto

# Every other test that launches ranks: about an hour on a 2-core machine. CI takes a budget of them a commit, the
# change's own first and the rest in turn (.ci/run's launch tier, tests/launch_budget.py); run this in full after a
# change to the suite's own machinery or before a release. Slurm, munge, iproute2, openssh-server and chromium first
# (apt, where root; the tests that need them skip with the reason elsewhere).
test-launch: setup test-tools
	$(PYTHON) -m pytest -m "launch and not core"

# The launch tests that judge cells beyond gpt-tiny in fp32 (ResNet-20, bf16, fp16, checkpointed, 4 ranks) or plant
# faults: a part of test-launch.
test-matrix: setup test-tools
	$(PYTHON) -m pytest -m matrix

# The unit tier: the tests that start no process (marked otherwise `launch`; tests/launch_guard.py), under a minute.
test-unit: setup
	$(PYTHON) -m pytest -m "not launch" -n auto

# Build the reproduction image on a local Debian base and run cells in it (root; docs/setup.md). CI runs it
# when the image's inputs changed since the commit recorded in .ci/docker-check-passed.
docker-check:
	scripts/docker-check.sh
