"""Jets generated from a formula: an op with no hand-written CPU kernel whose atoms are all elementwise
(a `chain` of them above all) compiled into one numba loop over its output.

The atom DAG is written out as scalar code, one line per atom, in f32 where its floats are f32 (exp and
tanh as plain arithmetic, so the loop vectorizes) and rounded once into the output. The loop walks the
output as rows of its last (merged) axis; each input is read whole, as a value per row (a per-channel
bias), a value per column or one value, whichever its broadcast is (copied into one of those where it
is none of them). The
source is a module in $SOMA_CACHE_DIR/formulas, named by the hash of its text, and numba caches its
machine code beside it: a formula compiles once per machine. Anything else (views, reductions,
lookups, quantized inputs, outputs other than f32/f64) is not generated: the registry runs atoms.
Knows atoms and numpy; nothing of graphs or ops.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys

import numpy as np

from soma_runtime.backends.cpu.common import cache_root
from soma_runtime.ir.atoms import AtomGraph

OUTPUTS = {"f32": np.float32, "f64": np.float64}
UNARY = {"exp": "exp_f32({})", "log": "np.log({})", "sqrt": "np.sqrt({})", "rsqrt": "{one} / np.sqrt({})",
         "recip": "{one} / {}", "sin": "np.sin({})", "cos": "np.cos({})", "tanh": "tanh_f32({})",
         "erf": "math.erf({})", "floor": "np.floor({})", "round": "np.rint({})"}
WIDE = {"exp": "np.exp({})", "tanh": "np.tanh({})"}          # in f64: libm's
BINARY = {"mul": "{} * {}", "add": "{} + {}", "sub": "{} - {}", "lt": "{} < {}", "le": "{} <= {}",
          "eq": "{} == {}", "max": "_max({}, {})", "min": "_min({}, {})", "pow": "{} ** {}"}
HEADER = '''"""A generated jet (soma_runtime.backends.cpu.generated): {what}"""
import math
import numba
import numpy as np

from soma_runtime.backends.cpu.simd import exp_f32


@numba.njit(inline="always")
def _max(a, b):
    return a if a != a or a >= b else b       # a NaN either side is the result, as np.maximum


@numba.njit(inline="always")
def _min(a, b):
    return a if a != a or a <= b else b


@numba.njit(inline="always", error_model="numpy")
def tanh_f32(x):
    """tanh in f32 within a few ulp (Cephes' tanhf): an odd polynomial below 0.625, else through exp_f32."""
    a = abs(x)
    if a < np.float32(0.625):
        z = x * x
        p = np.float32(-5.70498872745e-3) * z + np.float32(2.06390887954e-2)
        p = p * z - np.float32(5.37397155531e-2)
        p = p * z + np.float32(1.33314422036e-1)
        p = p * z - np.float32(3.33332819422e-1)
        return p * z * x + x
    e = exp_f32(np.float32(-2) * a)           # in (0, 0.29): no overflow, no cancellation
    t = (np.float32(1) - e) / (np.float32(1) + e)
    return t if x >= 0 else -t
'''


def scalar_code(graph: AtomGraph, kinds: list[str], wide: bool) -> list[str] | None:
    """The DAG as lines of scalar code (`v{i} = ...`; input k read by `kinds[k]`'s expression), computed in
    f32 (vectorizable: exp and tanh as simd.exp_f32 makes them) or with `wide` in f64; None where an atom
    is not elementwise."""
    lines, real = [], "np.float64" if wide else "np.float32"
    nodes = graph.nodes
    for i, n in enumerate(nodes):
        args = [f"v{j}" for j in n.args]
        divisor = [k for k, j in enumerate(n.args) if nodes[j].atom == "exp" and nodes[j].mode == "recip"]
        if n.atom == "mul" and divisor:          # a * recip(b) is a / b, as the op it came from rounds it
            k = divisor[0]
            lines.append(f"v{i} = {args[1 - k]} / v{nodes[n.args[k]].args[0]}")
            continue
        if n.atom == "input":
            expr = kinds[n.mode]
        elif n.atom in ("literal", "param"):
            if isinstance(n.mode, bool) or not isinstance(n.mode, (int, float)) or not math.isfinite(n.mode):
                return None
            expr = f"{real}({float(n.mode)!r})"
        elif n.atom == "mul" or n.atom == "add" or n.atom == "cmp" and n.mode != "select" or n.mode == "pow":
            expr = BINARY[n.atom if n.atom == "mul" else n.mode].format(*args)
        elif n.atom == "cmp":
            expr = f"{args[1]} if {args[0]} else {args[2]}"
        elif n.atom == "exp":
            expr = (WIDE if wide else {}).get(n.mode, UNARY[n.mode]).format(*args, one=f"{real}(1)")
        elif n.atom == "read" and n.mode == "cast" and n.struct in (("f32",), ("f64",)):
            expr = f"{real}({args[0]})"            # the arithmetic's own width: a cast to it is a no-op
        else:
            return None
        lines.append(f"v{i} = {expr}")
    return lines


def loop_source(graph: AtomGraph, dtypes: tuple[str, ...], wide: bool, kinds: tuple[str, ...]) -> str | None:
    """`loop(x0, ..., out)`: the formula at every place of `out` ([rows, inner], contiguous), input k read
    as `kinds[k]` says: "whole" ([rows, inner]), "row" (a value a row, [rows]), "col" (a value an inner
    index, [inner]) or "one" (one value, [1]); the inner loop is one LLVM vectorizes."""
    value = {"whole": "x{k}[r, i]", "row": "s{k}", "col": "x{k}[i]", "one": "s{k}"}
    body = scalar_code(graph, [read(value[kind].format(k=k), d, wide) for k, (d, kind) in enumerate(zip(dtypes, kinds))],
                       wide)
    if body is None:
        return None
    lines = ["@numba.njit(cache=True, error_model='numpy', nogil=True, fastmath={'contract', 'nsz'})",
             f"def loop({', '.join([*(f'x{k}' for k in range(len(dtypes))), 'out'])}):"]
    lines += [f"    s{k} = x{k}[0]" for k, kind in enumerate(kinds) if kind == "one"]
    lines.append("    for r in range(out.shape[0]):")
    lines += [f"        s{k} = x{k}[r]" for k, kind in enumerate(kinds) if kind == "row"]
    lines.append("        for i in range(out.shape[1]):")
    lines += ["            " + line for line in body]
    lines.append(f"            out[r, i] = v{graph.outputs[0]}")
    return "\n".join(lines) + "\n"


def operand(view: np.ndarray, rows: int, inner: int) -> tuple[str, np.ndarray]:
    """How the loop reads one input broadcast to the output (`view`, its axes merged), and the array it
    reads: itself where its layout allows, else its distinct values copied out (a row's or a column's)."""
    step = view.strides[-1]
    outer = all(s == 0 for s in view.strides[:-1])
    if step == 0:
        return ("one", view.reshape(-1)[:1]) if outer else ("row", np.ascontiguousarray(view[..., 0]).reshape(-1))
    if outer and step == view.itemsize:
        return "col", view[(0,) * (view.ndim - 1)]
    return "whole", np.ascontiguousarray(view).reshape(rows, inner)


def read(value: str, dtype: str, wide: bool) -> str:
    """An input's value as the arithmetic takes it: floats at its width, bools and integers as they are."""
    if dtype in ("f32", "f64"):
        return f"np.float64({value})" if wide else f"np.float32({value})"
    return value


def load(source: str):
    """The module of this source, written to the cache once (named by its hash) and imported."""
    name = "soma_formula_" + hashlib.sha256(source.encode()).hexdigest()[:24]
    if name in sys.modules:
        return sys.modules[name]
    path = cache_root() / "formulas" / f"{name}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(source)
        partial.replace(path)                  # whole or absent, whoever writes it at once
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def merged(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Views of same-shaped arrays with size-1 axes dropped and each pair of adjacent axes merged where
    every array's strides let it (as numpy's iterator coalesces)."""
    keep = [a for a in range(arrays[0].ndim) if arrays[0].shape[a] != 1]
    shape = [arrays[0].shape[a] for a in keep]
    strides = [[x.strides[a] for a in keep] for x in arrays]
    a = len(shape) - 1
    while a > 0:
        if all(s[a - 1] == s[a] * shape[a] for s in strides):
            shape[a - 1:a + 1] = [shape[a - 1] * shape[a]]
            for s in strides:
                s[a - 1:a + 1] = [s[a]]
        a -= 1
    return [np.lib.stride_tricks.as_strided(x, shape, s, writeable=x is arrays[-1]) for x, s in zip(arrays, strides)]


READS_KEPT = 256      # a generated jet's input layouts remembered (how each is read), past which they are forgotten


def direct_read(inputs: list[np.ndarray]) -> tuple[tuple, tuple[str, ...] | None]:
    """(the output's shape, how each input is read) where every input is either the output's shape laid out
    contiguously ("whole") or one value ("one"): the loop then runs over them in place, as one row, with no
    views built per call (an exported graph's elementwise chains are mostly so, and small: building the views
    cost 20 times the loop). None for the kinds where some input is broadcast otherwise."""
    shape = np.broadcast_shapes(*(x.shape for x in inputs))
    size = math.prod(shape)
    kinds = tuple("one" if x.size == 1 else "whole" if x.shape == shape and x.flags.c_contiguous else None for x in inputs)
    return shape, (None if None in kinds or size == 0 else kinds)


def remember(table: dict, key, value):
    if len(table) >= READS_KEPT:
        table.clear()
    table[key] = value
    return value


def generate(graph: AtomGraph, dtypes: tuple[str, ...], out_dtype: str):
    """A kernel for a one-output DAG of elementwise atoms over inputs of `dtypes`, or None. It computes in
    f32 where every float is f32 (as the ops it replaces do), else in f64."""
    if len(graph.outputs) != 1 or out_dtype not in OUTPUTS or \
            not all(d in ("f32", "f64", "bool", "i32", "i64") for d in dtypes):
        return None
    wide = out_dtype == "f64" or "f64" in dtypes
    if scalar_code(graph, ["x"] * len(dtypes), wide) is None:
        return None
    what = f"{len(graph.nodes)} atoms over {', '.join(dtypes) or 'nothing'} -> {out_dtype}"
    target, loops = OUTPUTS[out_dtype], {}
    direct: dict[tuple, tuple] = {}                # the inputs' shapes and strides -> (output shape, kinds or None)

    def loop_for(kinds: tuple[str, ...]):
        if kinds not in loops:
            loops[kinds] = load(HEADER.format(what=what) + "\n\n" + loop_source(graph, dtypes, wide, kinds)).loop
        return loops[kinds]

    def run(*inputs, out=None, **attrs):            # the attrs are in the formula already
        inputs = [x if isinstance(x, np.ndarray) else np.asarray(x) for x in inputs]
        key = tuple((x.shape, x.strides) for x in inputs)
        shape, kinds = direct.get(key) or remember(direct, key, direct_read(inputs))
        if out is None or out.shape != shape or out.dtype != target or not out.flags.c_contiguous:
            out = np.empty(shape, target)
        if out.size == 0:
            return out
        if kinds is not None:                      # each input whole in place, or one value: no views to build
            n = out.size
            loop_for(kinds)(*(x.reshape(1, n) if kind == "whole" else x.reshape(1) for x, kind in zip(inputs, kinds)),
                            out.reshape(1, n))
            return out
        views = merged([*(np.broadcast_to(x, shape) for x in inputs), out])
        inner = views[-1].shape[-1] if views[-1].ndim else 1
        rows = out.size // inner
        views = [v.reshape(1) for v in views] if views[-1].ndim == 0 else views
        kinds, arrays = zip(*[operand(v, rows, inner) for v in views[:-1]]) if inputs else ((), ())
        loop_for(kinds)(*arrays, out.reshape(rows, inner))
        return out
    return run
