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

.PHONY: install demo chat-demo test test-fast test-train test-ray test-system test-services lint clean

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

# Load an exported folder with transformers, offline, and generate a chat reply greedily.
define HF_GENERATE
import sys, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
chat = [{"role": "user", "content": "Hamlet in Hamlet: To be, or not to be, that is the question:"}]
ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=60, do_sample=False)
print("transformers:", tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
endef
export HF_GENERATE

# The rest of the recipe on the built-in data: pretrain, SFT with LoRA on the toy conversations,
# a chat reply, export to Hugging Face and generate with transformers (offline).
chat-demo: install
	$(BIN)/gptrun prepare --corpus shakespeare --out data/shakespeare
	$(BIN)/gptrun train experiments/configs/quickstart.toml --local
	$(BIN)/gptrun prepare --corpus shakespeare --sft --tokenizer data/shakespeare/tokenizer.json \
		--out data/shakespeare-chat
	$(BIN)/gptrun train experiments/configs/quickstart-sft.toml --local \
		--set lora.rank=8 --set optim.lr=1e-3 --set train.out=runs/quickstart-lora
	$(BIN)/gptrun sample runs/quickstart-lora/checkpoints/best.pt --chat \
		--prompt "Romeo in Romeo and Juliet: But soft, what light through yonder window breaks?"
	$(BIN)/gptrun export runs/quickstart-lora/checkpoints/best.pt --hf exports/quickstart-lora --force
	HF_HUB_OFFLINE=1 $(BIN)/python -c "$$HF_GENERATE" exports/quickstart-lora

# Every test (CI), in two sessions. The tiers (tests/conftest.py marks each test from what it uses):
# fast (no training, no Ray: a couple of minutes), train (CPU training), ray (local Ray), system
# (kill-and-resume, clusters, PostgreSQL, S3, Slurm).
# The fast and train tiers run on every core (pytest-xdist; no Ray there, nothing shared between
# tests but read-only fixtures); the ray and system tiers one test at a time on one shared Ray and
# clusters of their own. PARALLEL= runs the first two serially too.
PARALLEL ?= -n auto
test: install test-services
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=20 -m "fast or train" tests
	$(BIN)/python -m pytest -q --durations=30 -m "ray or system" tests

test-fast: install
	$(BIN)/python -m pytest -q $(PARALLEL) -m fast tests

test-train: install
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=10 -m train tests

test-ray: install
	$(BIN)/python -m pytest -q --durations=10 -m ray tests

test-system: install test-services
	$(BIN)/python -m pytest -q --durations=10 -m system tests

# Debian packages, installed as root with apt when missing (as on CI); elsewhere a note says how.
define apt_install
if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(1); \
else echo "note: missing $(1); run 'apt-get install $(1)' as root" >&2; fi
endef

# Servers the tests start in temp folders: PostgreSQL (tests/test_backends.py: initdb + pg_ctl)
# and Slurm (tests/test_slurm.py: munged, slurmctld, slurmd, sbatch). Without them those tests
# fail with the reason; they are never skipped.
PG_INITDB = $(wildcard $(addsuffix /initdb,$(shell pg_config --bindir 2>/dev/null) /usr/lib/postgresql/*/bin))
SLURM_PACKAGES = slurmctld slurmd slurm-client munge
test-services:
	@if [ -z "$(PG_INITDB)" ] && ! command -v initdb >/dev/null; then \
		$(call apt_install,postgresql); fi
	@for cmd in munged slurmctld slurmd sbatch; do \
		command -v $$cmd >/dev/null || { $(call apt_install,$(SLURM_PACKAGES)); break; }; done

# ruff format also checks the python code blocks of every Markdown file (README.md, docs/*.md,
# cluster/README.md); tests/test_docs.py checks their links and their gptrun command lines.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests/test_docs.py
	@command -v shellcheck >/dev/null || { $(call apt_install,shellcheck); }
	shellcheck cluster/*.sh

clean:
	rm -rf $(VENV) data runs sweeps exports
