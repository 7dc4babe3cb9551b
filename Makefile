# Two commands on a fresh machine: `make demo` and `make test`. Both create the cached virtualenv first.
SHELL := /bin/bash
VENV_BIN := .venv/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline

.PHONY: venv demo test clean

venv:
	@bash tools/ensure_venv.sh

demo: venv
	$(VENV_BIN)/loop-train --config recipes/demo.yaml

test: venv
	$(VENV_BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf .venv outputs .pytest_cache
