"""Adapter ops (SPEC "adapter ops"): `lora_apply`, a low-rank update added beside a linear layer's product,
each row with an adapter of its own (Punica's BGMV shape: many adapters, one batch).

Its decomposition is the dense definition: every row gathers its adapter's factors and all but the rows
with one are weighted by zero. Jets run each row's own low-rank product only (rows without one are
copied). Knows tensors, nothing of adapters' files or requests.
"""
from __future__ import annotations

from soma_runtime.ir.graph import TensorMeta, same_dim
from soma_runtime.ir.ops.base import check, float_dtype, op
from soma_runtime.ir.ops.norm import rmsnorm


def lora_apply_rule(metas, attrs):
    y, x, a, b, index, scale = metas[:6]
    magnitude, residual, norm = (metas + [None] * 3)[6:9]
    dt = float_dtype(y, "product")
    float_dtype(x, "activation")
    check(y.ndim == 2 and x.ndim == 2, f"lora_apply takes y [rows, out] and x [rows, in], got {list(y.shape)}, {list(x.shape)}")
    check(same_dim(y.shape[0], x.shape[0]) is not False, f"{y.shape[0]} product rows for {x.shape[0]} input rows")
    check(a.ndim == 3 and b.ndim == 3, f"adapter factors must be a [adapters, rank, in], b [adapters, out, rank], "
                                       f"got {list(a.shape)}, {list(b.shape)}")
    float_dtype(a, "adapter factor a")
    float_dtype(b, "adapter factor b")
    check(same_dim(a.shape[0], b.shape[0]) is not False and same_dim(a.shape[1], b.shape[2]) is not False,
          f"a {list(a.shape)} and b {list(b.shape)} differ in adapters or rank")
    check(same_dim(a.shape[2], x.shape[1]) is not False, f"a takes {a.shape[2]} inputs, x has {x.shape[1]}")
    check(same_dim(b.shape[1], y.shape[1]) is not False, f"b gives {b.shape[1]} outputs, y has {y.shape[1]}")
    check(index.dtype in ("i32", "i64") and index.ndim == 1, f"adapter index must be integer [rows], got {index.dtype}")
    check(scale.dtype == "f32" and scale.ndim == 1, f"adapter scale must be f32 [rows], got {scale.dtype}")
    check(same_dim(index.shape[0], y.shape[0]) is not False and same_dim(scale.shape[0], y.shape[0]) is not False,
          f"index {list(index.shape)} and scale {list(scale.shape)} must have one entry per row ({y.shape[0]})")
    if magnitude is not None:
        check(magnitude.dtype == "f32" and magnitude.ndim == 2 and same_dim(magnitude.shape[0], a.shape[0]) is not False
              and same_dim(magnitude.shape[1], y.shape[1]) is not False,
              f"magnitude must be f32 [adapters, out], got {magnitude.dtype} {list(magnitude.shape)}")
    if residual is not None:
        fits = residual.ndim == 2 and all(same_dim(p, q) is not False for p, q in zip(residual.shape, y.shape))
        check(residual.dtype == dt and fits,
              f"residual must be {dt} {list(y.shape)}, got {residual.dtype} {list(residual.shape)}")
    if norm is not None:
        float_dtype(norm, "norm weight")
        check(norm.ndim == 1 and same_dim(norm.shape[0], x.shape[1]) is not False,
              f"norm weight must be [{x.shape[1]}], got {list(norm.shape)}")
    return [TensorMeta(tuple(y.shape), dt)]


@op("lora_apply", ["y", "x", "a", "b", "index", "scale", "magnitude?", "residual?", "norm?"], lora_apply_rule,
    attrs={"norm_eps": 1e-6}, tol=4.0, ranks=(2, 2, 3, 3, 1, 1, 2, 2, 1))
def lora_apply(A, y, x, a, b, index, scale, magnitude, residual, norm, norm_eps):
    """y + scale[s] * (x[s] @ a[i].T) @ b[i].T for each row s whose adapter i = index[s] is >= 0; rows of
    index -1 are y's as they are. a [adapters, rank, in] and b [adapters, out, rank] are PEFT's lora_A and
    lora_B per adapter; a smaller rank is padded with zeros. With a `magnitude` [adapters, out]
    (DoRA's m / ||W + BA|| per output), an adapter's row is that times the sum, column by column. As the
    matmul it sits beside, it may take x before its rmsnorm (`norm`: the norm's weight) and add a `residual`
    (the stream the layer's output joins) last, so the fuse pass keeps those folds."""
    if norm is not None:
        x = rmsnorm(A, x, norm, norm_eps)
    # a row of no adapter (-1) reads the last one's factors, weighted by zero below
    down = A.reduce("sum", A.mul(A.read("expand", x, axis=1), A.read("take", a, index, axis=0)), axis=-1, keepdims=False)
    up = A.reduce("sum", A.mul(A.read("expand", down, axis=1), A.read("take", b, index, axis=0)), axis=-1, keepdims=False)
    adapted = A.cmp("le", A.lit(0), index)
    out = A.add(y, A.mul(up, A.read("expand", A.cmp("select", adapted, scale, A.lit(0)), axis=-1)))
    if magnitude is not None:
        out = A.mul(out, A.cmp("select", A.read("expand", adapted, axis=-1), A.read("take", magnitude, index, axis=0), A.lit(1)))
    return out if residual is None else A.add(out, residual)
