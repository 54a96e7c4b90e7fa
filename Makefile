# xllm-eplb: the two commands that matter are `make test` and `make serve`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
EP_SIZE ?= 16
# EPLB is on by default (incremental, cost-aware); add --workload=synthetic for demo traffic
SERVE_ARGS ?= --ep-size $(EP_SIZE) --config configs/eplb.yaml --eplb_update_interval=20

.PHONY: help install test test-fast serve lint docs clean

help:  ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)  ## create .venv: torch==2.13.0 first, then the project with [dev]; build the C++ kernels
	$(BIN)/python -m xllm_eplb.kernels

test: install  ## run the whole test suite
	$(BIN)/python -m pytest tests

test-fast: install  ## the in-process core only (no test marked slow or oracle), ~40 s on a quiet 2-core machine
	$(BIN)/python -m pytest tests -m "not slow and not oracle"

# no --model: the launcher generates the default deepseek_v3 checkpoint from the config's sizes
# once into .cache/checkpoints/<family>-<hash>/ and serves it (reused by later runs)
serve: install  ## serve the generated tiny checkpoint at 16 EP ranks (EPLB on, no built-in workload)
	$(BIN)/xllm-eplb serve $(SERVE_ARGS)

lint: install  ## ruff check
	$(BIN)/ruff check xllm_eplb tests scripts

docs: install  ## regenerate docs/configuration.md from the config fields
	$(BIN)/xllm-eplb config docs --output docs/configuration.md

clean:  ## remove this project's unheld /dev/shm objects (no install needed)
	@if [ -x $(BIN)/xllm-eplb ]; then $(BIN)/xllm-eplb shm clean; \
	else echo "no $(BIN)/xllm-eplb: nothing installed, nothing to clean"; fi
