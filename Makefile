# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU torch wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(BIN)/gptrun prepare --corpus shakespeare --out data/shakespeare
	$(BIN)/gptrun sweep experiments/configs/quickstart.toml --name demo --storage sweeps --restart
	$(BIN)/gptrun report sweeps/demo

test: install
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) data runs sweeps
