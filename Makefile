# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the project with its pinned dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= resnet50
PYTEST_ARGS ?=
PROFILE_ARGS ?=

.PHONY: demo test lint bench profile clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python setup.cfg constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The trained PaddleOCR models of the test corpus: only the wheel's files, not its app.
	$(BIN)/python -m pip install --quiet --no-deps rapidocr-onnxruntime==1.4.4
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tvm_bnfold.cli demo --model $(MODEL)

test: $(STAMP)
	$(BIN)/ruff check python tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check python tests

bench: $(STAMP)
	$(BIN)/python -m tvm_bnfold.bench

profile: $(STAMP)
	$(BIN)/python -m tvm_bnfold.profile $(MODEL) $(PROFILE_ARGS)

clean:
	rm -rf $(VENV) build python/*.egg-info .pytest_cache .ruff_cache
