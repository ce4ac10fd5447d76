# Both entry points create and reuse .venv and install everything they need.
# GPU users: TORCH_SPEC="torch" (or any pip requirement, plus PIP_TORCH_ARGS="--index-url ...") keeps
# pip from pulling the CPU build; the default takes the CPU torch 2.13.0 wheel.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adalncache-installed
# The test-only extras (compose: quantization libraries and a step cache; bnb: bitsandbytes) go into a
# directory of their own that only `make test` puts on the path: diffusers, transformers and peft import
# whichever of them is installed, and their import-time warnings would open every `adalncache` command.
TEST_EXTRAS = $(abspath $(VENV))/test-extras
TEST_STAMP := $(TEST_EXTRAS)/.installed
TEST_PATH = $(shell $(PY) -c "import sysconfig as s; v = {'base': '$(TEST_EXTRAS)', 'platbase': '$(TEST_EXTRAS)'}; print(s.get_path('purelib', 'posix_prefix', v) + ':' + s.get_path('platlib', 'posix_prefix', v))")

.PHONY: demo test lint bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[diffusers,dev]"
	touch $(STAMP)

# The extras' requirements are read from pyproject.toml (their one home); what the venv already has
# (torch, numpy, ...) satisfies their dependencies and is not installed twice.
$(TEST_STAMP): $(STAMP)
	mkdir -p $(TEST_EXTRAS)
	$(PY) -m pip install -q --prefix $(TEST_EXTRAS) $$($(PY) scripts/extras.py compose bnb)
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/adalncache demo $(ARGS)

test: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	PYTHONPATH="$(TEST_PATH)" $(PY) -m pytest -q -x -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/adalncache bench $(ARGS)

soak: $(TEST_STAMP)
	PYTHONPATH="$(TEST_PATH)" ADALNCACHE_SOAK=1 $(PY) -m pytest -q -p no:cacheprovider -m soak tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
