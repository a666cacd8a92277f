# make run: set up and run the main job; make test: set up and pass the tests; make bench: benchmarks.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/soma-runtime backends

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) bench/ops.py

clean:
	rm -rf $(VENV) bench/out
