"""CUDA jets for the primitive ops beyond elementwise.py's float functions: comparisons and logic (one
kernel, the relation a compile-time constant, a bool out), where, reductions (reduced axes moved last,
each row reduced by one program, in f32), running sums and products (likewise, a row scanned by one
program BLOCK values at a time), and scatters (each output reading the updates aimed at it, in index order:
no atomics, the CPU jet's order of combining)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, F, device_jet
from soma_runtime.backends.cuda.elementwise import BLOCK, flat_grid
from soma_runtime.ir.jets import jet

COMPARE = {"less": 0, "less_equal": 1, "greater": 2, "greater_equal": 3, "equal": 4, "logical_and": 5, "logical_or": 6}
REDUCE = {"reduce_sum": 0, "reduce_mean": 1, "reduce_max": 2, "reduce_min": 3, "reduce_prod": 4}
REDUCE_BLOCK = 1024


@chained
@triton.jit
def _compare_kernel(a_ptr, b_ptr, out_ptr, n, kind: tl.constexpr, BLOCK: tl.constexpr):
    """A comparison or logic of two tensors of one dtype (numbers compared as they are), a bool out."""
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    a = tl.load(a_ptr + offs, mask=keep)
    b = tl.load(b_ptr + offs, mask=keep)
    if kind == 0:
        y = a < b
    elif kind == 1:
        y = a <= b
    elif kind == 2:
        y = a > b
    elif kind == 3:
        y = a >= b
    elif kind == 4:
        y = a == b
    elif kind == 5:
        y = (a != 0) & (b != 0)
    else:
        y = (a != 0) | (b != 0)
    tl.store(out_ptr + offs, y, mask=keep)


def compare_jet(kind: int):
    @device_jet
    def run(a, b):
        a, b = (t.contiguous() for t in torch.broadcast_tensors(a, b))
        out = torch.empty(a.shape, dtype=torch.bool, device=a.device)
        _compare_kernel[flat_grid(a.numel())](a, b, out, a.numel(), kind=kind, BLOCK=BLOCK)
        return out
    return run


for _name, _kind in COMPARE.items():
    jet(_name, CUDA, [("bool", "bool")] if _name.startswith("logical") else [(F, F), (INT, INT)])(compare_jet(_kind))


@chained
@triton.jit
def _where_kernel(c_ptr, a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    c = tl.load(c_ptr + offs, mask=keep)
    tl.store(out_ptr + offs, tl.where(c, tl.load(a_ptr + offs, mask=keep), tl.load(b_ptr + offs, mask=keep)), mask=keep)


@jet("where", CUDA, [("bool", "*", "*")])
@device_jet
def where(condition, a, b):
    """a where the condition holds, else b, in any dtype (the three broadcast together)."""
    condition, a, b = (t.contiguous() for t in torch.broadcast_tensors(condition, a, b))
    out = torch.empty_like(a)
    _where_kernel[flat_grid(a.numel())](condition, a, b, out, a.numel(), BLOCK=BLOCK)
    return out


@chained
@triton.jit
def _not_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=keep) == 0, mask=keep)


@jet("logical_not", CUDA, [("bool",)])
@device_jet
def logical_not(x):
    x = x.contiguous()
    out = torch.empty_like(x)
    _not_kernel[flat_grid(x.numel())](x, out, x.numel(), BLOCK=BLOCK)
    return out


@chained
@triton.jit
def _reduce_kernel(x_ptr, out_ptr, n, kind: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of [rows, n]: its sum (mean), max, min or product, over BLOCK values at a time."""
    after_prior()
    row = tl.program_id(0).to(tl.int64)
    identity = 0.0 if kind <= 1 else (-float("inf") if kind == 2 else (float("inf") if kind == 3 else 1.0))
    acc = tl.full((BLOCK,), identity, tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=identity).to(tl.float32)
        if kind <= 1:
            acc = acc + x
        elif kind == 2:
            acc = tl.maximum(acc, x)
        elif kind == 3:
            acc = tl.minimum(acc, x)
        else:
            acc = acc * x
    if kind <= 1:
        y = tl.sum(acc, 0)
    elif kind == 2:
        y = tl.max(acc, 0)
    elif kind == 3:
        y = tl.min(acc, 0)
    else:
        y = tl.reduce(acc, 0, _times)
    if kind == 1:
        y = y / n
    tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _times(a, b):
    return a * b


def reduce_jet(kind: int):
    @device_jet
    def run(x, axes=(-1,), keepdims=False):
        rank = x.ndim
        reduced = sorted({a % rank for a in (range(rank) if axes is None else axes)})
        kept = [a for a in range(rank) if a not in reduced]
        rows = x.permute(*kept, *reduced).contiguous()
        shape = [x.shape[a] for a in kept]
        n = math.prod(x.shape[a] for a in reduced)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        if out.numel():
            _reduce_kernel[(out.numel(),)](rows, out, n, kind=kind, BLOCK=min(REDUCE_BLOCK, triton.next_power_of_2(max(n, 1))))
        if keepdims:
            out = out.reshape([1 if a in reduced else x.shape[a] for a in range(rank)])
        return out
    return run


for _name, _kind in REDUCE.items():
    jet(_name, CUDA, [(F,)])(reduce_jet(_kind))


@chained
@triton.jit
def _running_kernel(x_ptr, out_ptr, n, PRODUCT: tl.constexpr, FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of [rows, n]: its running sums (products), floats in f32, integers in their own width
    (wrapping), each block's scan carried on from the blocks before."""
    after_prior()
    row = tl.program_id(0).to(tl.int64)
    carry = tl.full((), 1 if PRODUCT else 0, tl.float32 if FLOAT else out_ptr.dtype.element_ty)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=1 if PRODUCT else 0).to(carry.dtype)
        if PRODUCT:
            run = tl.cumprod(x, 0) * carry
            carry = carry * tl.reduce(x, 0, _times)
        else:
            run = tl.cumsum(x, 0) + carry
            carry = carry + tl.sum(x, 0)
        tl.store(out_ptr + row * n + cols, run.to(out_ptr.dtype.element_ty), mask=cols < n)


def running_jet(product: bool):
    @device_jet
    def run(x, axis=-1):
        rows = x.movedim(axis, -1).contiguous()
        n = rows.shape[-1]
        out = torch.empty_like(rows)
        if out.numel():
            _running_kernel[(out.numel() // n,)](rows, out, n, PRODUCT=product, FLOAT=x.is_floating_point(),
                                                 BLOCK=min(REDUCE_BLOCK, triton.next_power_of_2(n)))
        return out.movedim(-1, axis)
    return run


jet("cumsum", CUDA, [(F,), (INT,)])(running_jet(False))
jet("cumprod", CUDA, [(F,), (INT,)])(running_jet(True))


SCATTER = {"replace": 0, "add": 1, "mul": 2, "max": 3, "min": 4}


@chained
@triton.jit
def _scatter_kernel(x_ptr, index_ptr, updates_ptr, out_ptr, total, n, m, inner, REDUCE: tl.constexpr,
                    FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """out [outer, n, inner]: x, each of its slices j taking the update slices i of [outer, m, inner] whose
    index (negative: from the end) is j, in order of i: in place of it (REDUCE 0: the last one stays) or
    combined with it (SCATTER's add, mul, max, min; NaN wins a max or min, as numpy's)."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < total
    at, j, outer = offs % inner, offs // inner % n, offs // (inner * n)
    y = tl.load(x_ptr + offs, mask=keep)
    if FLOAT:
        y = y.to(tl.float32)
    for i in range(m):
        slot = tl.load(index_ptr + i).to(tl.int64)
        hit = keep & (j == tl.where(slot < 0, slot + n, slot))
        u = tl.load(updates_ptr + (outer * m + i) * inner + at, mask=hit, other=0).to(y.dtype)
        if REDUCE == 0:
            z = u
        elif REDUCE == 1:
            z = y + u
        elif REDUCE == 2:
            z = y * u
        elif REDUCE == 3:
            z = tl.maximum(y, u, propagate_nan=tl.PropagateNan.ALL)
        else:
            z = tl.minimum(y, u, propagate_nan=tl.PropagateNan.ALL)
        y = tl.where(hit, z, y)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)


def scattered(x, index, updates, axis, reduction):
    axis = axis % x.ndim
    x, updates, index = x.contiguous(), updates.contiguous(), index.contiguous()
    out = torch.empty_like(x)
    if out.numel():
        inner = math.prod(x.shape[axis + 1:])
        _scatter_kernel[flat_grid(out.numel())](x, index, updates, out, out.numel(), x.shape[axis], index.shape[0], inner,
                                                REDUCE=SCATTER[reduction], FLOAT=x.is_floating_point(), BLOCK=BLOCK)
    return out


@jet("scatter", CUDA, [("*", INT, "*")])
@device_jet
def scatter(x, index, updates, axis=0):
    return scattered(x, index, updates, axis, "replace")


@jet("scatter_reduce", CUDA, [("*", INT, "*")])
@device_jet
def scatter_reduce(x, index, updates, axis=0, reduction="add"):
    return scattered(x, index, updates, axis, reduction)
