# The two commands of the README, each doing its own set-up on a fresh machine:
#   make test   every notebook (nbdev's runner, slowest first: dev/test_notebooks.py), pytest, and a check that the library matches the notebooks
#   make demo   SFT -> reward model -> PPO-ptx -> eval on the built-in task (about a minute on 2 CPU cores)
# README.md is written from nbs/index.ipynb by `make readme` (nbdev_readme needs Quarto).
# torch is installed before the project so pip takes the CPU build from this machine's disk
# instead of fetching a multi-GB CUDA build.
# Versions: `make install` (and so test, demo, CI) installs the exact versions of constraints.txt, the set the suite last
# passed with; the library's own requirements (settings.ini) stay ranges. `make test-latest` runs the suite on the newest
# releases in a venv of its own, `make lock` does the same and rewrites constraints.txt only if it passes,
# `make test-oldest` runs it on the lower bounds settings.ini declares.

PYTHON ?= python3
VENV   ?= .venv
LOCK   := constraints.txt
# what the venv is installed with: torch first (the CPU build on this disk), then the project under these constraints
TORCH       ?= torch==2.13.0
CONSTRAINTS ?= -c $(LOCK)
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BNB    := $(VENV)/bnb

.PHONY: test demo install check-export readme test-latest lock test-oldest lint lint-check test-trl

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# bitsandbytes (the 8-bit optimizers' tests) goes apart from the venv, in $(BNB): peft imports it whenever it is
# installed, 2 s more for every process; tests/test_training_arguments.py puts it on the path of the process that needs it.
$(STAMP): $(BIN)/python setup.py settings.ini $(LOCK)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(BNB) bitsandbytes==0.50.2
	touch $(STAMP)

install: $(STAMP)

check-export: $(STAMP)
	@echo "== nbdev_export must leave instruct_goose/ unchanged"
	@before=$$(mktemp -d) && cp -r instruct_goose "$$before/" && \
	$(BIN)/nbdev_export && \
	if diff -r -x __pycache__ "$$before/instruct_goose" instruct_goose; then rm -rf "$$before"; \
	else rm -rf "$$before"; echo "nbdev_export changed instruct_goose/: export the notebooks and commit the library with them"; exit 1; fi
	$(BIN)/python dev/readme.py --check

# The house formatter (ruff.toml: 110 columns, over the notebooks and the tests), then no line over 120 (what a formatter
# cannot wrap, a string without a space, is the only reason a line passes 110).
lint: $(STAMP)
	$(BIN)/ruff format
	$(BIN)/nbdev_export

lint-check: $(STAMP)
	@echo "== ruff format --check: run make lint to format"
	$(BIN)/ruff format --check
	$(BIN)/ruff check --select E501 --line-length 120 nbs

readme: $(STAMP)
	$(BIN)/python dev/readme.py

# Tiny models on 2 cores: one intra-op thread per process is faster than threads fighting (5 min -> 50 s);
# pytest runs on both cores (pytest-xdist, a file per worker; torchrun tests pick a free port with --standalone).
test: export OMP_NUM_THREADS := 1
test: check-export lint-check
	@echo "== every notebook, as nbdev_test runs them, the slowest first"
	$(BIN)/python dev/test_notebooks.py --n_workers 2 --timing
	@echo "== pytest"
	$(BIN)/python -m pytest tests -q -n 2 --dist loadfile --durations=10

# The newest releases of every dependency (torch included: the newest pip may take here), in a venv made anew each time,
# so that the next release that breaks the suite is found here before a user finds it.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(MAKE) test VENV=$(LATEST) TORCH=torch CONSTRAINTS=

# The same on the newest releases of all but torch (kept at $(TORCH), the CPU build CI takes from disk; `make lock
# TORCH=torch` for the newest), and constraints.txt rewritten from that venv only once its suite has passed.
lock:
	rm -rf $(LATEST)
	$(MAKE) test VENV=$(LATEST) CONSTRAINTS=
	(echo '# The exact versions `make test` last passed with (written by `make lock`; `make install` installs them).'; \
	 $(LATEST)/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$$//') > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# The lower bounds settings.ini declares (dev/oldest.py writes them as == constraints), in a venv of their own.
OLDEST := .venv-oldest
test-oldest:
	rm -rf $(OLDEST)
	$(PYTHON) dev/oldest.py > $(OLDEST).txt
	$(MAKE) test VENV=$(OLDEST) TORCH="$$(grep '^torch==' $(OLDEST).txt)" CONSTRAINTS="-c $(OLDEST).txt"

# TRL's own trainer tests (GRPO, RLOO, DPO, reward, SFT) as the measure of the drop-in trainers: each file on TRL and on
# a copy importing the trainer and its config from instruct_goose, offline, on stand-ins for the Hub's tiny models and
# data sets (tests/trl/make_standins.py); writes tests/trl/results.md. Not part of `make test` (it takes long).
# TRL_SRC: a TRL git repository (bare or not) whose tests are copied, at the tag of the installed TRL where it has one.
# TRL_ARGS: more options for tests/trl/run.py, e.g. TRL_ARGS="--files grpo --every 4".
test-trl: export OMP_NUM_THREADS := 1
test-trl: $(STAMP)
	$(BIN)/python tests/trl/run.py $(if $(TRL_SRC),--trl-src $(TRL_SRC)) $(TRL_ARGS)

demo: $(STAMP)
	$(BIN)/goose pipeline --config configs/demo.yaml --output_dir runs/demo --overwrite_output_dir

# The documentation site, built without Quarto (dev/docs.py: nbdev's processors run every notebook -> MkDocs -> _site/,
# KaTeX from npm bundled so it works offline), then checked page by page in Debian's headless Chromium.
# Executed notebooks are cached in build/docs-cache/ by a hash of the notebook and the library, so a rebuild runs only
# what changed (cold: every chapter and tutorial, several minutes on 2 cores). DOCS_ARGS=--no-execute skips running them.
.PHONY: docs docs-check
docs: export OMP_NUM_THREADS := 1
docs: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	$(BIN)/python dev/docs.py $(DOCS_ARGS)

docs-check: docs
	@command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(BIN)/python -m pip install --quiet playwright==1.65.2
	$(BIN)/python dev/docs_check.py
