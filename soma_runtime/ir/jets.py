"""The jet registry: (formula hash, backend, input dtypes) -> kernel, with the atoms as fallback.

A backend registers a kernel for an op; the registry files it under the formula hash of every
structural variant of that op. Lookup hashes the node's own decomposition, so a kernel is found
by what it computes, never by a name. On a miss, a backend that compiles formulas is asked for a
kernel generated from the decomposition (an elementwise `chain` above all); else the atoms run
(logged once). With SOMA_VERIFY=1
every jet runs beside its atoms and a difference beyond the op's tolerance raises.

Kernel convention: `kernel(*inputs, out=None, **attrs)` returns the output (or a tuple); when
`out` is given (a planned arena buffer) it should write there.
"""
from __future__ import annotations

import itertools
import logging
import os

import numpy as np

from soma_runtime.dtypes import QTensor, dtype
from soma_runtime.errors import JetMismatchError
from soma_runtime.ir.atoms import interpret
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.graph import Sym, TensorMeta, meta_of
from soma_runtime.ir.ops import OPS, OpDef

log = logging.getLogger("soma_runtime.jets")

MAX_VARIADIC = 16
F32_TOL = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2}


def tolerance(opdef: OpDef, out_dtype: str) -> float:
    return opdef.tol * F32_TOL.get(out_dtype, 1e-5)


def _variants(opdef: OpDef, pattern: tuple, struct: dict):
    """Every structural variant of an op for one dtype pattern: (input metas, attrs)."""
    if opdef.any_rank:
        for rank in range(1, 7):
            yield from _variants_at(opdef, pattern, (rank, *opdef.ranks[1:]), struct)
    else:
        yield from _variants_at(opdef, pattern, opdef.ranks, struct)


def _variants_at(opdef: OpDef, pattern: tuple, ranks: tuple, struct: dict):
    n_inputs = len(pattern)
    struct_choices = [[(k, v) for v in values] for k, values in {**opdef.struct, **struct}.items()]
    for combo in itertools.product(*struct_choices):
        attrs = dict(combo)
        # an optional input is absent where the pattern says "none", present where it names dtypes
        optional = [i for i, spec in enumerate(opdef.inputs[:n_inputs]) if spec.endswith("?")]
        choices = [(False,) if pattern[i] == "none" else (True, False) if pattern[i] == "*" else (True,) for i in optional]
        for present in itertools.product(*choices):
            metas = []
            for i, dt in enumerate(pattern):
                if i in optional and not present[optional.index(i)]:
                    metas.append(None)
                    continue
                rank = ranks[i] if i < len(ranks) else 2
                name = dt[0] if isinstance(dt, tuple) else ("f32" if dt == "*" else dt)
                metas.append(TensorMeta(tuple(Sym(f"d{i}_{j}") for j in range(rank)), name))
            yield metas, attrs


class JetRegistry:
    def __init__(self):
        self._jets: dict[tuple[str, str], list[tuple[tuple, object]]] = {}
        self._missed: set = set()
        self._chosen: dict[tuple, object] = {}     # a formula never depends on sizes: look each up once

    def register(self, op: str, backend: str, dtypes: list[tuple], kernel, struct: dict | None = None) -> None:
        """File `kernel` under every variant of `op` for these dtype patterns; `struct` narrows the values
        of the op's structural attrs the kernel covers (default: all the op lists)."""
        opdef = OPS[op]
        for pattern in dtypes:
            arities = range(1, MAX_VARIADIC + 1) if opdef.variadic else [len(pattern)]
            for n in arities:
                full = pattern[:1] * n if opdef.variadic else tuple(pattern)
                for metas, attrs in _variants(opdef, full, struct or {}):
                    entries = self._jets.setdefault((opdef.formula_hash(metas, attrs), backend), [])
                    entry = (full, frozenset(opdef.attrs), kernel)
                    if entry not in entries:
                        entries.append(entry)
        self._chosen.clear()

    def lookup(self, formula_hash: str, backend: str, dtypes: tuple[str, ...], attrs=None):
        """The kernel registered for a formula on a backend for these input dtypes; with `attrs` (names),
        only one that takes them: two ops may compute one formula with other attributes (a split into
        one part is a slice)."""
        for pattern, takes, kernel in self._jets.get((formula_hash, backend), ()):
            if (attrs is None or takes == frozenset(attrs)) and len(pattern) == len(dtypes) and \
                    all(_matches(p, d) for p, d in zip(pattern, dtypes)):
                return kernel
        return None

    def kernel_for(self, opdef: OpDef, metas: list, attrs: dict, backend: Backend):
        """The kernel that runs this op on `backend`: its jet, else its fallback's (inputs carried over), else
        the atoms; wrapped by verify mode."""
        dtypes = tuple("none" if m is None else m.dtype for m in metas)
        key = (opdef.name, backend.name, dtypes, repr(sorted(opdef.full_attrs(attrs).items())), os.environ.get("SOMA_VERIFY"))
        if key not in self._chosen:
            self._chosen[key] = self._choose(opdef, metas, attrs, backend, dtypes)
        return self._chosen[key]

    def _choose(self, opdef: OpDef, metas: list, attrs: dict, backend: Backend, dtypes: tuple):
        jet = None
        if backend.name != "reference":
            jet = self.lookup(opdef.formula_hash(metas, attrs), backend.name, dtypes, opdef.attrs)
            if jet is None and backend.formulas:
                outputs = opdef.infer(metas, attrs)
                if len(outputs) == 1:
                    jet = backend.generated(opdef.decomposition(metas, attrs), dtypes, outputs[0].dtype)
            fallback = backend.fallback
            if jet is None and fallback is not None:
                self._miss(opdef, backend, dtypes, f"running it on {fallback.name} (inputs copied there)")
                return on_other_backend(self._choose(opdef, metas, attrs, fallback, dtypes), backend)
            if jet is None:
                self._miss(opdef, backend, dtypes, "running its atoms")
        if jet is None:
            return reference_kernel(opdef)
        if os.environ.get("SOMA_VERIFY") == "1":
            return verified(opdef, jet, backend.name)
        return jet

    def missed(self, backend: str) -> list[tuple[str, tuple]]:
        """The (op, input dtypes) that found no jet on `backend` so far (run elsewhere, or by their atoms)."""
        return sorted((op, dtypes) for op, name, dtypes in self._missed if name == backend)

    def _miss(self, opdef: OpDef, backend: Backend, dtypes: tuple, what: str) -> None:
        if (opdef.name, backend.name, dtypes) not in self._missed:
            self._missed.add((opdef.name, backend.name, dtypes))
            log.warning("no %s jet for %s%s; %s", backend.name, opdef.name, dtypes, what)


def on_other_backend(kernel, backend: Backend):
    """Run a host kernel for a device backend: inputs fetched to the host, results placed back."""
    def run(*inputs, out=None, **attrs):
        result = kernel(*[backend.fetch(x) for x in inputs], **attrs)
        return tuple(backend.place(r) for r in result) if isinstance(result, tuple) else backend.place(result)
    run.hosted = True
    return run


def _matches(pattern, dt: str) -> bool:
    if pattern == "*":
        return True
    return dt in pattern if isinstance(pattern, tuple) else dt == pattern


def _out_dtypes(opdef, inputs, attrs):
    metas = [None if x is None else meta_of(x) for x in inputs]
    return [m.dtype for m in opdef.infer(metas, attrs)]


def reference_kernel(opdef: OpDef):
    """Run an op by interpreting its atom decomposition (the reference backend)."""
    def run(*inputs, out=None, **attrs):
        metas = [None if x is None else meta_of(x) for x in inputs]
        results = interpret(opdef.decomposition(metas, attrs), list(inputs))
        results = [np.asarray(r).astype(dtype(dt).numpy) for r, dt in zip(results, _out_dtypes(opdef, inputs, attrs))]
        if out is not None and len(results) == 1:
            out[...] = results[0]
            return out
        return results[0] if len(results) == 1 else tuple(results)
    run.backend = "reference"
    return run


def max_error(got, want) -> tuple[float, float]:
    """The largest difference and the scale it is judged at; infinite where a value that is not finite
    (NaN, an infinity) stands in one and not as the same in the other."""
    with np.errstate(invalid="ignore"):
        got = np.asarray(got).astype(np.float64)
        want = np.asarray(want).astype(np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return float("inf"), 1.0
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
    return err, scale


def verified(opdef: OpDef, jet, backend: str):
    reference = reference_kernel(opdef)

    def run(*inputs, out=None, **attrs):
        snapshot = [np.array(x, copy=True) if opdef.stateful and not isinstance(x, QTensor) and x is not None else x
                    for x in inputs]
        got = jet(*inputs, out=out, **attrs)
        want = reference(*snapshot, **attrs)
        pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
        for g, w in pairs:
            err, scale = max_error(g, w)
            tol = tolerance(opdef, str(meta_of(w).dtype))
            if not err <= tol * scale:
                raise JetMismatchError(f"{backend} jet for {opdef.name} differs from its atoms: "
                                       f"max error {err:.3g} > {tol * scale:.3g}")
        return got
    return run


REGISTRY = JetRegistry()


def jet(op: str, backend: str, dtypes: list[tuple], struct: dict | None = None):
    """Decorator a backend uses to register a kernel: `@jet("rmsnorm", "cpu", [("f32", "f32")])`; `struct`
    narrows the structural attr values it covers (`{"codec": ("none",)}`)."""
    def register(kernel):
        REGISTRY.register(op, backend, dtypes, kernel, struct)
        return kernel
    return register
