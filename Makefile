# Two commands on a fresh clone: `make demo` and `make test`. Both build .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; a bare `torch` would pull CUDA.
TORCH   ?= torch==2.13.0
PEERS   := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 muon-fsdp2==0.3.0

.PHONY: demo test test-heavy lint bench plan gpu-check docs-figures docs-map clean

# --no-compile: no bytecode for all of torch at install (some 15 s here); what the suite
# and the demo import is compiled once, at first import.
$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile "$(TORCH)" -e ".[test,bench]"
	$(BIN)/pip install -q --no-compile --no-deps $(PEERS)
	touch $@

demo: $(BIN)/.installed
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/matrixfsdp train --ranks 4 --steps 60 --out runs/demo

# Two pytest workers, one test file each at a time (a file's ranks and module fixtures stay
# in one worker): the suite is CPU-bound, and two keep both cores of a small machine busy.
# Bytecode is cached even where the environment says not to: the suite starts some 30
# fresh interpreters and many more rank processes that import the package and tests.
test: $(BIN)/.installed lint
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

# The heavier comparisons (pytest marker `heavy`): one case per feature stays in `make test`.
test-heavy: $(BIN)/.installed
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m heavy tests

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks studies tools examples

bench: $(BIN)/.installed
	OMP_NUM_THREADS=1 $(BIN)/matrixfsdp bench --out runs/bench

# The checks only a GPU shows (docs/gpu.md), one command, one report, a nonzero exit on any
# failure. On a GPU machine, with its own CUDA build of torch: `make gpu-check GPU_PY=python3`
# (every GPU visible; NGPU=N for fewer). Without a GPU, or with `make gpu-check --dry-run`
# (or ARGS=--dry-run), a dry run: every check with its bound, each one's CPU path on 2 gloo
# ranks. The script starts its own ranks (no torchrun). ARGS: more flags (--record, --list).
GPU_PY  ?= $(BIN)/python
NGPU    ?=
ARGS    ?=
GPU_DRY := $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run)
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PY)),$(BIN)/.installed)
	+PYTHONPATH=src:. OMP_NUM_THREADS=1 $(GPU_PY) -m tools.gpu_check $(if $(NGPU),--ngpu $(NGPU)) \
		--out runs/gpu-check $(GPU_DRY) $(ARGS)

# Every measured figure of README.md and docs/ from the command that produces it: outputs in
# runs/docs-figures, tables in docs/figures (spliced into the pages' marked blocks); about half
# an hour on 2 cores. One or a few: `make docs-figures FIGURES="ep tp"`.
docs-figures: $(BIN)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m tools.docs_figures $(FIGURES)

# docs/architecture.md's file map, one entry per module, from the modules' docstrings
# (tests/test_docs_file_map.py fails when it drifts from the tree). Needs no environment.
docs-map:
	$(PY) -m tools.file_map

plan: $(BIN)/.installed
	$(BIN)/matrixfsdp plan --model paper --ranks 8

clean:
	rm -rf $(VENV) runs
