# The two set-up commands of the README. Each works from a fresh clone: it creates .venv,
# installs NInfer into it and runs the job. torch is pinned (==2.13.0) in pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)

demo: $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(BIN)/ninfer demo

# pytest's exit status 5 ("no tests collected") is not a failure of the suite. Two pytest-xdist workers
# (one per core: most tests run one torch thread); the Ray tests share one worker (tests/conftest.py).
test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc
