# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first, pinned, when the venv has none. On a stock PyPI index torch for Linux
# is the multi-GB CUDA build: TORCH_INDEX (pip's --index-url, for the torch install only) picks
# another index, e.g. `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU
# build. Empty by default: pip's configured index is used.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install demo test test-services lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q \
		$(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(BIN)/gptrun prepare --corpus shakespeare --out data/shakespeare
	$(BIN)/gptrun sweep experiments/configs/quickstart.toml --name demo --storage sweeps --restart
	$(BIN)/gptrun report sweeps/demo

test: install test-services
	$(BIN)/python -m pytest -q tests

# tests/test_backends.py starts a real PostgreSQL server (initdb + pg_ctl in a temp folder): install
# Debian's server package when its binaries are missing (needs root and apt, as on CI). Without
# them those tests fail with the reason; they are never skipped.
PG_INITDB = $(wildcard $(addsuffix /initdb,$(shell pg_config --bindir 2>/dev/null) /usr/lib/postgresql/*/bin))
test-services:
	@if [ -n "$(PG_INITDB)" ] || command -v initdb >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; \
	else echo "note: no PostgreSQL server binaries; run 'apt-get install postgresql' as root" >&2; fi

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) data runs sweeps
