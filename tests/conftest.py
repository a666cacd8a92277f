"""Test-session settings: the autotune table lives in a fresh directory, never the user's cache, and
loads do not tune: a choice made by timing would let reference comparisons vary from run to run
(the integer block dots, llama.cpp's own arithmetic, stay the kernel; tests/test_schedule.py and
the CLI test exercise tuning itself). Without a GPU, the CUDA backend's Triton kernels run in
Triton's interpreter, so the cross-backend op test checks them everywhere."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

os.environ["SOMA_CACHE_DIR"] = tempfile.mkdtemp(prefix="soma-test-cache-")
os.environ["SOMA_AUTOTUNE"] = "0"
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Interpreted, every launch of a CUDA kernel is recorded, to be compiled for the GPU at the end, and
    device functions skip the interpreter's re-patching (tests/fixtures/interpreter.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from soma_runtime.backends.cuda.chain import chained
    from tests.cuda.sm90 import LAUNCHES, launch_record
    from tests.fixtures.interpreter import skip_repatching
    skip_repatching()
    launcher = chained.__getitem__

    def recording(self, grid):
        launch = launcher(self, grid)

        def run(*args, **meta):
            LAUNCHES.add(launch_record(self.kernel, args, meta))
            return launch(*args, **meta)
        return run
    chained.__getitem__ = recording


def pytest_collection_modifyitems(items):
    """The compile check of every launch runs after the tests that launch them."""
    items.sort(key=lambda item: "test_sm90" in item.nodeid)


def pytest_sessionfinish(session):
    """Where the tests run in several processes (`make test`: pytest-xdist), each leaves its launches in
    SOMA_TEST_LAUNCHES for the compile check, which then runs after them all (tests/cuda/test_sm90.py)."""
    from tests.cuda.sm90 import LAUNCHES
    folder = os.environ.get("SOMA_TEST_LAUNCHES")
    if folder and LAUNCHES:
        with open(os.path.join(folder, f"launches-{os.getpid()}.json"), "w") as f:
            json.dump(sorted(LAUNCHES), f)


@pytest.fixture(scope="module")
def smol():
    """The bundled SmolLM2 through the Python API, loaded once per test module (imported here, after
    the settings above)."""
    from soma_runtime.tasks import Runtime
    return Runtime().load("default", progress=False)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    """A models directory holding a copy of the bundled GGUF (a symlink out of it would be refused)."""
    from soma_runtime.loaders import default_model_path
    directory = tmp_path_factory.mktemp("models")
    shutil.copyfile(default_model_path(), directory / "smollm2.gguf")
    return str(directory)


@pytest.fixture(scope="session")
def server(models_dir):
    """One `soma-runtime serve` of the bundled model for the session, model management on."""
    from tests.server.conftest import ServerProcess
    s = ServerProcess("--allow-model-management", "--models-dir", models_dir)
    yield s
    assert s.stop() == 0, s.output()
