"""Loads and runs each ONNX model a fuzz test made, under an address-space cap and a run budget that fits
it, and compares what it computes with onnxruntime; prints one JSON line per case. A case is a folder
holding model.onnx (its external data beside it) and, where it is to be run, inputs.npz. Run as
`python -m tests.hardening.fuzz_graph_worker CAP_BYTES FOLDER...` from the repository root.

Outcomes: ModelLoadError (the load, or a build for the inputs, refused), RequestError (the run refused),
equal (onnxruntime computes the same), unchecked (onnxruntime refuses what we ran), loaded (no inputs
to run), differs, hung, or the name and message of any other exception."""
from __future__ import annotations

import functools
import os
import sys

import numpy as np

from tests.hardening.fuzz_worker import capped, report

BUDGET_SHARE = 8                 # any one tensor a run computes: at most this share of the cap


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
    capped(cap)
    for folder in folders:
        report(folder, functools.partial(one, ort, backend, budget))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
