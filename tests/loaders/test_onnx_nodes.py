"""ONNX conformance: every node test case the `onnx` package generates, run on the CPU backend, on the
reference backend (the atoms) and, where there is a GPU, on CUDA, and by onnxruntime in the same run,
each compared with its expected outputs at the case's tolerances.

A case passes, or fails to load with a typed UnsupportedModelError naming why (the list is written out);
a wrong answer, or any other error, fails the test. A half-precision output may sit two ulps from the
expected one (its last bits depend on the order of the steps rounded before it): those are listed too.
"""
from __future__ import annotations

import collections
import json
import logging
import warnings

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.errors import UnsupportedModelError
from soma_runtime.ir.jets import REGISTRY
from soma_runtime.loaders.onnx import onnx_graph

ort = pytest.importorskip("onnxruntime")

CASES_IN_ONNX_1_23_2 = 1884
PASSING_NOW = 1558            # what this runtime passes: fewer is a regression


def array(value) -> np.ndarray:
    """A case's input or output (the cast cases store TensorProtos)."""
    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else value


MANTISSA_BITS = {"float16": 10, "bfloat16": 7}
HALF_ULPS = 2                 # steps rounded to half precision: the last bits depend on their order


def ulp_of(want: np.ndarray) -> np.ndarray | None:
    """The spacing of half-precision numbers at each expected value; None for other dtypes."""
    if want.dtype.name not in MANTISSA_BITS:
        return None
    _, exponent = np.frexp(want.astype(np.float32))
    return np.ldexp(1.0, exponent - 1 - MANTISSA_BITS[want.dtype.name])


def compare(got: np.ndarray, want: np.ndarray, case) -> str | None:
    """None when equal at the case's tolerance; 'ulp' when half-precision values are ulps off; else why not."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
    if want.dtype.kind in "fcV" or want.dtype.name == "bfloat16":
        g, w = got.astype(np.float64), want.astype(np.float64)
        close = np.isclose(g, w, rtol=case.rtol, atol=case.atol, equal_nan=True)
        if close.all():
            return None
        ulp = ulp_of(want)
        if ulp is not None and (np.abs(g - w)[~close] <= HALF_ULPS * ulp[~close] + case.atol).all():
            return "ulp"
        i = np.flatnonzero(~close)[0]
        return f"{(~close).sum()} of {close.size} values differ, e.g. {g.flat[i]} for {w.flat[i]}"
    return None if np.array_equal(got, want) else "values differ"


RANDOM = {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"}


def run_case(case, backend) -> tuple[str, str]:
    """('pass' | 'ulp' | 'random' | 'unsupported' | 'wrong', detail) for one case on our runtime. A case
    that samples ('random') cannot give the values numpy drew for it: its outputs' dtypes and shapes count."""
    sampled = any(node.op_type in RANDOM for node in case.model.graph.node)
    try:
        runner = graph_runner(onnx_graph(case.model, ".", case.name), backend)
    except UnsupportedModelError as e:
        return "unsupported", str(e).split(": ", 1)[-1]
    names = [i.name for i in case.model.graph.input]
    outcome = "pass"
    for inputs, outputs in case.data_sets:
        try:
            got = runner.run(dict(zip(names, map(array, inputs))))
        except UnsupportedModelError as e:          # a family member built at run time
            return "unsupported", str(e).split(": ", 1)[-1]
        for name, want in zip(runner.outputs, map(array, outputs)):
            want = np.asarray(want)
            if sampled:
                if (got[name].dtype, got[name].shape) != (want.dtype, want.shape):
                    return "wrong", f"{name}: {got[name].dtype}{list(got[name].shape)}, expected {want.dtype}{list(want.shape)}"
                outcome = "random"
                continue
            why = compare(got[name], want, case)
            if why == "ulp":
                outcome = "ulp"
            elif why:
                return "wrong", f"{name}: {why}"
    return outcome, ""


def run_onnxruntime(case) -> bool:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(case.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for inputs, outputs in case.data_sets:
            got = session.run(None, dict(zip(names, map(array, inputs))))
            for y, want in zip(got, map(array, outputs)):
                want = np.asarray(want)
                if want.dtype != object and compare(np.asarray(y), want, case) not in (None, "ulp"):
                    return False
    except Exception:                           # noqa: BLE001  (the peer's failures are counted, not raised)
        return False
    return True


@pytest.fixture(scope="module")
def cases():
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = collect_testcases()
    assert len(found) == CASES_IN_ONNX_1_23_2
    return found


@pytest.fixture(scope="module")
def onnxruntime_passes(cases) -> dict[str, bool]:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {case.name: run_onnxruntime(case) for case in cases}


def backends():
    import torch
    return ["cpu", "reference", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("backend", backends())
def test_the_onnx_node_tests_pass_where_onnxruntime_passes_them(backend, cases, onnxruntime_passes, request, capsys,
                                                                tmp_path):
    logging.disable(logging.WARNING)            # "no cpu jet for ...; running its atoms" per exotic dtype
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = {case.name: run_case(case, get(backend)) for case in cases}
    finally:
        logging.disable(logging.NOTSET)
    counts = collections.Counter(outcome for outcome, _ in ours.values())
    passed, peer = counts["pass"] + counts["ulp"], sum(onnxruntime_passes.values())
    missed = REGISTRY.missed(backend)
    report = {"backend": backend, "passed": passed, "onnxruntime_passed": peer,
              "half_precision_ulps_off": sorted(name for name, (o, _) in ours.items() if o == "ulp"),
              "random_values_not_compared": sorted(name for name, (o, _) in ours.items() if o == "random"),
              "unsupported": {name: why for name, (o, why) in sorted(ours.items()) if o == "unsupported"},
              "onnxruntime_passes_we_do_not": sorted(name for name, ok in onnxruntime_passes.items()
                                                     if ok and ours[name][0] not in ("pass", "ulp", "random")),
              "ops_without_a_jet": [f"{op}{list(dtypes)}" for op, dtypes in missed]}
    cache = getattr(request.config, "cache", None)              # absent under -p no:cacheprovider
    path = (cache.mkdir("onnx") if cache else tmp_path) / f"node-tests-{backend}.json"
    path.write_text(json.dumps(report, indent=1))
    with capsys.disabled():
        print(f"\n{backend}: {passed} of {len(cases)} passed (onnxruntime: {peer}); {counts['ulp']} of them half-precision "
              f"ulps off; {counts['random']} sampling (dtypes and shapes checked); {counts['unsupported']} unsupported and "
              f"{len(missed)} op signatures without a {backend} jet, each listed in {path}")
    wrong = {name: why for name, (outcome, why) in ours.items() if outcome == "wrong"}
    assert not wrong, f"wrong answers on {backend}: {wrong}"
    assert passed >= PASSING_NOW
