"""f32 matrix products on the CPU backend's one thread pool: numba's (TBB) workers each call BLAS's sgemm,
single-threaded, on a block of the product. BLAS keeps no pool of its own: two pools on the same cores
(OpenBLAS's spinning workers beside numba's) collapse once anything else runs on the machine (ResNet-18
at 2 threads, a test suite beside it: 3.4 s a run, against 0.14 s with BLAS on one thread).

The sgemm is numpy's own OpenBLAS (its CBLAS entry, 64-bit integers), found beside numpy; where numpy
carries another BLAS, products go through numpy as they are (its pool then is BLAS's own)."""
from __future__ import annotations

import ctypes
import glob
import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
PARALLEL_WORK = 1 << 21        # multiply-adds under which a product runs on the calling thread alone
MIN_BLOCK = 16                 # the fewest rows (or columns) a block of a product takes


def openblas() -> int:
    """The address of numpy's OpenBLAS sgemm (its CBLAS entry), the library set to one thread; 0 where numpy
    carries another BLAS."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas64_*.so"))):
        lib = ctypes.CDLL(path)                        # the library numpy loaded: the same handle
        if all(hasattr(lib, name) for name in ("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_")):
            lib.scipy_openblas_set_num_threads64_.argtypes = [ctypes.c_int]
            lib.scipy_openblas_set_num_threads64_(1)
            return ctypes.cast(lib.scipy_cblas_sgemm64_, ctypes.c_void_p).value
    return 0


SGEMM = openblas()
# cblas_sgemm's parameters (order, transposes, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), pointers as integers
SGEMM_TYPES = (types.int32,) * 3 + (types.int64,) * 3 + (types.float32,) + (types.int64,) * 4 + (types.float32,) \
    + (types.int64,) * 2


@intrinsic
def _sgemm(typingctx, fn, order, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the sgemm at address `fn` (a run-time argument: the kernels calling it stay in numba's disk cache)."""
    given = (order, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, values):
        fnty = ir.FunctionType(ir.VoidType(), [context.get_value_type(t) for t in SGEMM_TYPES])
        target = builder.inttoptr(values[0], fnty.as_pointer())
        builder.call(target, [context.cast(builder, v, t, want) for v, t, want in zip(values[1:], given, SGEMM_TYPES)])
        return context.get_dummy_value()
    return types.void(fn, *given), codegen


@njit(cache=True, nogil=True)
def _block(fn, a, b, c, M, N, K, lda, ldb, ldc, ta, tb, beta, rows, first, last):
    """c[first:last] (rows) or c[:, first:last] (columns) of c = a @ b (+ beta c), pointers and leading
    dims as CBLAS takes them."""
    if rows:
        a_at = a + (first * lda if ta == NO_TRANS else first) * 4
        _sgemm(fn, ROW_MAJOR, ta, tb, last - first, N, K, 1.0, a_at, lda, b, ldb, beta, c + first * ldc * 4, ldc)
    else:
        b_at = b + (first if tb == NO_TRANS else first * ldb) * 4
        _sgemm(fn, ROW_MAJOR, ta, tb, M, last - first, K, 1.0, a, lda, b_at, ldb, beta, c + first * 4, ldc)


@njit(parallel=True, cache=True, nogil=True)
def _blocks(fn, a, b, c, M, N, K, lda, ldb, ldc, ta, tb, beta, rows, step, count, total, items, sa, sb, sc):
    """Each of `items` products (a, b, c `sa`, `sb`, `sc` bytes apart) in `count` blocks of `step`."""
    for i in prange(items * count):
        item, block = divmod(i, count)
        _block(fn, a + item * sa, b + item * sb, c + item * sc, M, N, K, lda, ldb, ldc, ta, tb, beta, rows,
               block * step, min(total, (block + 1) * step))


def operand(x: np.ndarray) -> tuple[int, int] | None:
    """(transposed, leading dim) of a 2-D f32 operand BLAS reads in place; None where it cannot."""
    if x.dtype != np.float32 or x.ndim != 2:
        return None
    s0, s1 = x.strides
    if s1 == 4 and s0 % 4 == 0 and s0 // 4 >= max(1, x.shape[1]):
        return NO_TRANS, s0 // 4
    if s0 == 4 and s1 % 4 == 0 and s1 // 4 >= max(1, x.shape[0]):
        return TRANS, s1 // 4
    return None


def stacked(x: np.ndarray, items: int) -> int | None:
    """Bytes between a 2-D or 3-D operand's matrices over `items` products (0: one matrix for all); None
    where it is neither."""
    if x.ndim == 2:
        return 0
    if x.ndim == 3 and x.shape[0] == items:
        return x.strides[0] if items > 1 else 0
    return None


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, accumulate: bool = False) -> np.ndarray:
    """out = a @ b (out += a @ b where `accumulate`) for f32 arrays, 2-D or a stack of them ([items, M, N]
    out; a and b each a stack or one matrix for all), split into products and row or column blocks over the
    pool where the work is large enough to repay waking it. Other layouts go through numpy."""
    items = out.shape[0] if out.ndim == 3 else 1
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    layout = [operand(x[0] if x.ndim == 3 else x) if x.size else None for x in (a, b, out)]
    strides = [stacked(x, items) for x in (a, b, out)]
    if not SGEMM or out.ndim not in (2, 3) or None in layout or None in strides or layout[2][0] != NO_TRANS:
        if accumulate:
            out += a @ b
        else:
            np.matmul(a, b, out=out)
        return out
    (ta, lda), (tb, ldb), (_, ldc) = layout
    beta = 1.0 if accumulate else 0.0
    args = (SGEMM, a.ctypes.data, b.ctypes.data, out.ctypes.data, M, N, K, lda, ldb, ldc, ta, tb, beta)
    threads = numba.get_num_threads()
    if items == 1 and (M * N * K < PARALLEL_WORK or threads == 1):
        _block(*args, True, 0, M)
        return out
    rows = M >= N
    total = M if rows else N
    count = 1 if items >= threads else max(1, min(-(-threads // items), total // MIN_BLOCK))
    step = -(-total // count)
    _blocks(*args, rows, step, -(-total // step), total, items, *strides)
    return out
