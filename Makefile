# graphmend developer commands. `make demo` and `make test` set up .venv first
# when it is missing (or when the dependency files changed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphmend-installed

.PHONY: setup demo test fuzz clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e '.[dev,zoo,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/graphmend explain demo; test $$? -le 1
	$(VENV)/bin/graphmend mend demo; test $$? -le 1

test: $(STAMP)
	$(PY) -m pytest -q --durations=30

# Long-mode differential fuzzing (tests/fuzz): 5,000 generated programs by default, in
# chunks of 100 per fresh worker process, one per core at a time;
# FUZZ_ARGS="--programs N --seed S --jobs J --resume" to change.
# Failing programs go to build/fuzz-failures/, the summary to build/fuzz-summary.txt.
FUZZ_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --jobs $(FUZZ_JOBS) $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
