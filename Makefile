# `make demo` and `make test` work on a fresh machine with nothing but Python 3.10+:
# they create .venv, install the pinned torch, then this package: `make demo` with what the demo
# needs only (torch, Lightning, the package's own dependencies and its demo extra, scikit-learn), `make test` (and lint, bench)
# with the dev and deepspeed extras on top (DeepSpeed builds from source: a much larger environment).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every pip call after torch goes through this constraints file, so no dependency's
# version range can replace the pinned torch (an unpinned torch is several GB of CUDA).
CONSTRAINTS := $(VENV)/torch-constraint.txt
TORCH_STAMP := $(VENV)/.torch-$(TORCH_VERSION)
DEMO_STAMP := $(VENV)/.installed-demo-$(TORCH_VERSION)
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
DOCS_STAMP := $(VENV)/.installed-docs-$(TORCH_VERSION)
PYTEST_ARGS ?=

.PHONY: install install-demo demo test test-slow test-no-cpu-fp16 lint bench gpu-check gpu-check-dry docs docs-serve clean

install: $(STAMP)

install-demo: $(DEMO_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(TORCH_STAMP): $(PY)
	echo "torch==$(TORCH_VERSION)" > $(CONSTRAINTS)
	$(PIP) install "torch==$(TORCH_VERSION)"
	touch $(TORCH_STAMP)

# The package, its dependencies and the `demo` extra (scikit-learn, for the bundled digits): what
# `python -m lightning_spdkfac.demo` imports.
$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[demo]"
	touch $(DEMO_STAMP)

# Tests, lint and benchmarks: the dev extras (pytest, ruff, mypy, the unified `lightning` package, ...;
# the `demo` extra is part of dev) and DeepSpeed. This environment also runs the demo.
$(STAMP): $(TORCH_STAMP) pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[dev,deepspeed]"
	touch $(STAMP) $(DEMO_STAMP)

# (An environment installed for the tests has what the demo needs: $(STAMP) touches $(DEMO_STAMP) too.)
demo: $(DEMO_STAMP)
	$(PY) -m lightning_spdkfac.demo

# The suite without the tests marked slow (multi-process trainings to an accuracy, concurrent CLI runs): under
# 10 minutes on 2 cores. test-slow runs those; CI runs both.
test: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The whole suite as a CPU without DeepSpeed fp16 support sees it (AMD EPYC, Intel before AVX512-FP16/AMX).
test-no-cpu-fp16: install
	$(PY) -m pytest -q --cpu-fp16=off $(PYTEST_ARGS)

# ruff on everything, a complexity ceiling of 15 on the package, mypy (strict on kfac/, schedule/, comm/).
lint: install
	$(PY) -m ruff check lightning_spdkfac tests examples benchmarks
	$(PY) -m ruff check --select C901 --config 'lint.mccabe.max-complexity=15' lightning_spdkfac
	$(PY) -m mypy

bench: install
	$(PY) benchmarks/overhead.py

# The GPU check (benchmarks/gpu_check.py, docs/guide/gpu-check.md; at most 6 minutes on one H100): a smoke
# section (versions, NCCL, TF32 state, the card), the tests marked cuda, then K-FAC's step time, host syncs, memory
# and phases against SGD and AdamW on a ResNet-18 and a GPT-2-small-sized transformer, and the overhead table;
# report.md and report.json in OUT (default: a fresh benchmarks/results/run-*-gpu_check/). Without CUDA it stops
# after the smoke section and fails; gpu-check-dry runs the dry mode (tiny models on the CPU), which CI runs.
# On a GPU machine with a CUDA PyTorch already installed and no package index: NO_INSTALL=1 (no .venv, no pip:
# PYTHON runs it, the package imported from this checkout), and WHEELS=DIR for wheels of pure-Python dependencies
# the machine lacks, installed for the run only (pip --no-index --no-deps --target a temporary folder):
#   make gpu-check PYTHON=python3 NO_INSTALL=1 [WHEELS=.whl] [OUT=gpu-report]
OUT ?=
NO_INSTALL ?=
WHEELS ?=
GPU_PY := $(if $(NO_INSTALL),$(PYTHON),$(PY))
GPU_DEPS := $(if $(NO_INSTALL),,install)
GPU_ARGS = $(if $(OUT),--out $(OUT)) $(if $(WHEELS),--wheels $(WHEELS))

gpu-check: $(GPU_DEPS)
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY) benchmarks/gpu_check.py $(GPU_ARGS)

gpu-check-dry: $(GPU_DEPS)
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY) benchmarks/gpu_check.py --dry $(GPU_ARGS)

# The documentation site (mkdocs.yml, docs/): the docs extra on top of the test environment (the API reference
# and the generated configuration reference import the package, Lightning and DeepSpeed included), built with
# warnings as errors (strict: a broken link, anchor or docstring reference fails the build) into site/.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[dev,deepspeed,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache site
