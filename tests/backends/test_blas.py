"""The CPU backend's f32 products on its one thread pool (backends/cpu/blas.py) against numpy in f64: every
layout BLAS reads in place (row-major, transposed, row and column views), stacks of products and one
matrix shared by a stack, accumulation, sizes that split into blocks over the pool and sizes that do not;
and BLAS's own pool held to one thread."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from soma_runtime.backends.cpu import blas

RNG = np.random.default_rng(0)


def close(got, a, b, accumulated=0.0):
    want = np.matmul(a.astype(np.float64), b.astype(np.float64)) + accumulated
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def draw(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("M,K,N", [(1, 7, 5), (3, 64, 300), (300, 64, 3), (200, 150, 170), (64, 0, 9)])
@pytest.mark.parametrize("layout", ["plain", "a transposed", "b transposed", "views"])
def test_products_in_every_layout_blas_reads_in_place(M, K, N, layout):
    a, b = draw(M, K), draw(K, N)
    if layout == "a transposed":
        a = np.ascontiguousarray(a.T).T
    elif layout == "b transposed":
        b = np.ascontiguousarray(b.T).T
    elif layout == "views":                              # rows and columns out of wider arrays
        a, b = draw(M + 2, K + 3)[1:M + 1, 2:K + 2], draw(K + 1, N + 4)[1:, 3:N + 3]
    wide = np.full((M, N + 2), np.nan, np.float32)
    out = wide[:, 1:N + 1]
    assert blas.matmul(a, b, out) is out
    close(out, a, b)
    assert np.isnan(wide[:, [0, -1]]).all()             # nothing written beside the view
    start = draw(M, N)
    summed = start.copy()
    close(blas.matmul(a, b, summed, accumulate=True), a, b, start)


@pytest.mark.parametrize("items", [1, 3, 16])
def test_stacks_of_products_and_one_matrix_shared_by_a_stack(items):
    a, b = draw(items, 40, 70), draw(items, 70, 90)
    close(blas.matmul(a, b, np.empty((items, 40, 90), np.float32)), a, b)
    close(blas.matmul(a[0], b, np.empty((items, 40, 90), np.float32)), a[0], b)
    close(blas.matmul(a, b[0], np.empty((items, 40, 90), np.float32)), a, b[0])
    heads = draw(2, items, 30, 16)                       # attention's heads, keys transposed in place
    keys = np.swapaxes(draw(2, items, 50, 16), -1, -2)
    flat = lambda x: x.reshape(-1, *x.shape[-2:])
    close(blas.matmul(flat(heads), flat(keys), np.empty((2 * items, 30, 50), np.float32)), flat(heads), flat(keys))


def test_a_large_product_splits_over_the_pool_as_one_thread_computes_it():
    a, b = draw(512, 256), draw(256, 384)
    threads = numba.get_num_threads()
    alone = np.empty((512, 384), np.float32)
    numba.set_num_threads(1)
    try:
        blas.matmul(a, b, alone)
    finally:
        numba.set_num_threads(threads)
    pooled = blas.matmul(a, b, np.empty((512, 384), np.float32))
    close(pooled, a, b)
    assert np.array_equal(pooled, alone) or threads == 1 or np.abs(pooled - alone).max() <= 1e-5 * np.abs(alone).max()


def test_layouts_blas_cannot_read_go_through_numpy():
    a, b = draw(6, 8)[:, ::2], draw(4, 5)                # a's rows strided: no leading dimension
    close(blas.matmul(a, b, np.empty((6, 5), np.float32)), a, b)
    ints = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert np.array_equal(blas.matmul(ints, ints.T, np.empty((3, 3), np.int64)), ints @ ints.T)


def test_blas_keeps_no_pool_of_its_own():
    """numpy's OpenBLAS runs on the thread that calls it: the backend's pool is numba's alone."""
    assert blas.SGEMM, "numpy's OpenBLAS was not found: products fall back to numpy's own pool"
    openblas = [lib for lib in threadpool_info() if lib["internal_api"] == "openblas" and "numpy" in lib["filepath"]]
    assert openblas and all(lib["num_threads"] == 1 for lib in openblas)
