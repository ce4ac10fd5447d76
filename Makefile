# Both entry points create and reuse .venv and install everything they need.
# GPU users: TORCH_SPEC="torch" (or any pip requirement, plus PIP_TORCH_ARGS="--index-url ...") keeps
# pip from pulling the CPU build; the default takes the CPU torch 2.13.0 wheel.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adalncache-installed

.PHONY: demo test lint bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[diffusers,dev,compose,bnb]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/adalncache demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -x -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/adalncache bench $(ARGS)

soak: $(STAMP)
	ADALNCACHE_SOAK=1 $(PY) -m pytest -q -p no:cacheprovider -m soak tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
