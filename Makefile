# Set-up from nothing, then the main job or the test suite (README: the two commands).
# TORCH_SPEC: on a CUDA machine with torch already in your environment, use `make VENV_FLAGS=--system-site-packages`.
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test lint docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/fp8kit train

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=20

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

docs: $(VENV)/.installed
	$(VENV)/bin/fp8kit config-docs --output docs/config.md
