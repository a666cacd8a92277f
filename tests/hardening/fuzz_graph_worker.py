"""Loads and runs each ONNX model a fuzz test made, under an address-space cap and a run budget that fits
it, and compares what it computes with onnxruntime; prints one JSON line per case. A case is a folder
holding model.onnx (its external data beside it) and, where it is to be run, inputs.npz. Run as
`python -m tests.hardening.fuzz_graph_worker CAP_BYTES FOLDER...` from the repository root.

Outcomes: ModelLoadError (the load, or a build for the inputs, refused), RequestError (the run refused),
equal (onnxruntime computes the same), unchecked (onnxruntime refuses what we ran), loaded (no inputs
to run), differs, hung, or the name and message of any other exception."""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

import numpy as np

HANG_SECONDS = 20                # a case still going after this is reported as hung (the test's guard, not a speed target)
BUDGET_SHARE = 8                 # any one tensor a run computes: at most this share of the cap


class Hung(BaseException):       # not an Exception: no handler for a refusal may swallow it
    pass


def on_alarm(signum, frame):
    raise Hung()


def same(ours: np.ndarray, theirs: np.ndarray) -> bool:
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    if ours.dtype.kind in "fc":
        return bool(np.allclose(ours, theirs, rtol=1e-4, atol=1e-5, equal_nan=True))
    return bool(np.array_equal(ours, theirs))


def reference(ort, path: str, inputs: dict) -> list | None:
    """onnxruntime's outputs, or None where it refuses the model or the inputs."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = 1, 1, 4
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return session.run(None, inputs)
    except Exception:                                 # noqa: BLE001  (any refusal: the case cannot be compared)
        return None


def one(ort, backend, budget, folder: str) -> tuple[str, str]:
    from soma_runtime.engine.graph import graph_runner
    from soma_runtime.errors import ModelLoadError, RequestError
    from soma_runtime.loaders.onnx import load_onnx
    path = os.path.join(folder, "model.onnx")
    try:
        runner = graph_runner(load_onnx(path).graph, backend, budget=budget)
        if not os.path.exists(os.path.join(folder, "inputs.npz")):
            return "loaded", ""
        with np.load(os.path.join(folder, "inputs.npz")) as archive:
            inputs = {name: archive[name] for name in archive.files}
        ours = runner.run(dict(inputs))
    except ModelLoadError as e:
        return "ModelLoadError", str(e)[:300]
    except RequestError as e:
        return "RequestError", str(e)[:300]
    theirs = reference(ort, path, inputs)
    if theirs is None:
        return "unchecked", ""
    for (name, got), want in zip(ours.items(), theirs):
        if not same(np.asarray(got), np.asarray(want)):
            return "differs", f"{name}: ours {got.dtype}{list(got.shape)}, onnxruntime {want.dtype}{list(np.shape(want))}"
    return "equal", ""


def main(cap: int, folders: list[str]) -> None:
    import onnxruntime as ort

    from soma_runtime.backends import get
    from soma_runtime.ir.plan import RunBudget
    backend = get("cpu")
    budget = RunBudget(tensor_bytes=cap // BUDGET_SHARE, output_bytes=cap // BUDGET_SHARE, work_bytes=cap // 4)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap, mapped + cap))
    signal.signal(signal.SIGALRM, on_alarm)
    for folder in folders:
        start = time.perf_counter()
        signal.alarm(HANG_SECONDS)
        try:
            outcome, detail = one(ort, backend, budget, folder)
        except Hung:
            outcome, detail = "hung", ""
        except Exception as e:                        # noqa: BLE001  (what the test looks for: reported, never hidden)
            outcome, detail = type(e).__name__, str(e)[:300]
        finally:
            signal.alarm(0)
        print(json.dumps({"case": folder, "outcome": outcome, "detail": detail, "seconds": time.perf_counter() - start}),
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
