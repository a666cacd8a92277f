"""CUDA jets for layout ops: views of device tensors (a copy only where a view cannot be had), the
indexed reads (take) that gather rows, and one Triton kernel for the copies each of whose outputs reads
one place of x found axis by axis (pad, tile, gather)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, device_jet
from soma_runtime.errors import GraphError
from soma_runtime.ir.jets import jet

ANY = "*"


@jet("reshape", CUDA, [(ANY,)])
@device_jet
def reshape(x, shape=()):
    return x.reshape(shape)


@jet("permute", CUDA, [(ANY,)])
@device_jet
def permute(x, perm=()):
    return x.permute(perm)


@jet("transpose", CUDA, [(ANY,)])
@device_jet
def transpose(x, dim0=-2, dim1=-1):
    return x.transpose(dim0, dim1)


@jet("slice", CUDA, [(ANY,)])
@device_jet
def slice_(x, axis=0, start=0, stop=None, step=1):
    if step < 0:                       # torch views take no negative steps: gather those positions
        positions = list(range(x.shape[axis]))[slice(start, stop, step)]
        return x.index_select(axis, torch.tensor(positions, dtype=torch.int64, device=x.device))
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop, step)
    return x[tuple(index)]


@jet("split", CUDA, [(ANY,)])
@device_jet
def split(x, sizes=(), axis=0):
    return tuple(torch.split(x, list(sizes), dim=axis))


@jet("concat", CUDA, [(ANY,)])
@device_jet
def concat(*xs, axis=0):
    return torch.cat(xs, dim=axis)


@jet("expand", CUDA, [(ANY,)])
@device_jet
def expand(x, shape=()):
    return x.expand(torch.broadcast_shapes(x.shape, tuple(shape)))


@jet("take", CUDA, [(ANY, INT)])
@device_jet
def take(x, index, axis=0):
    """x's slices along `axis` at `index` (any shape; negative counts from the end), as numpy's take."""
    axis = axis % x.ndim
    flat = index.reshape(-1).to(torch.int64)
    flat = torch.where(flat < 0, flat + x.shape[axis], flat)
    return x.index_select(axis, flat).reshape(x.shape[:axis] + index.shape + x.shape[axis + 1:])


RANK = 6                                                # the remap kernel's axes: fewer are led by unit ones
REMAP_BLOCK = 256                                       # outputs a program: 1024 spill six axes' int64 indices
REMAP = {"constant": 0, "edge": 1, "reflect": 2, "tile": 3, "gather": 4}


@triton.jit
def _axis_source(rest, size, n, before, stride, index, MODE: tl.constexpr, GATHERED: tl.constexpr):
    """One axis (the innermost left) of flat output positions `rest`: the rest of them, the offset in x its
    source index adds and whether that index lies in x (an axis of `size` outputs over n inputs)."""
    at = rest % size - before
    if GATHERED:
        at = tl.where(index < 0, index + n, index)
    elif MODE == 1:
        at = tl.minimum(tl.maximum(at, 0), n - 1)
    elif MODE == 2:
        at = n - 1 - tl.abs(n - 1 - tl.abs(at))
    elif MODE == 3:
        at = at % n
    return rest // size, at * stride, (at >= 0) & (at < n)


@chained
@triton.jit
def _remap_kernel(x_ptr, index_ptr, out_ptr, total, value, o0, o1, o2, o3, o4, o5, n0, n1, n2, n3, n4, n5,
                  b0, b1, b2, b3, b4, b5, s0, s1, s2, s3, s4, s5, MODE: tl.constexpr, AXIS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """out [o0..o5] from x [n0..n5] (strides s0..s5), each axis' output index less its `before` read as
    REMAP's MODE says: constant (outside x: `value`), edge, reflect, tile (wrapped); gather: axis AXIS read
    at `index` (contiguous, out's shape), the others at the output's own index."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < total
    index = tl.load(index_ptr + offs, mask=keep, other=0).to(tl.int64) if MODE == 4 else offs
    rest, a5, in5 = _axis_source(offs, o5, n5, b5, s5, index, MODE, AXIS == 5)
    rest, a4, in4 = _axis_source(rest, o4, n4, b4, s4, index, MODE, AXIS == 4)
    rest, a3, in3 = _axis_source(rest, o3, n3, b3, s3, index, MODE, AXIS == 3)
    rest, a2, in2 = _axis_source(rest, o2, n2, b2, s2, index, MODE, AXIS == 2)
    rest, a1, in1 = _axis_source(rest, o1, n1, b1, s1, index, MODE, AXIS == 1)
    rest, a0, in0 = _axis_source(rest, o0, n0, b0, s0, index, MODE, AXIS == 0)
    inside = keep & in0 & in1 & in2 & in3 & in4 & in5
    y = tl.load(x_ptr + (a0 + a1 + a2 + a3 + a4 + a5), mask=inside)
    if MODE == 0:
        y = tl.where(inside, y, value)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)


def remap_axes(sizes, dims, starts, strides, gathered: int) -> list[tuple[int, int, int, int, bool]]:
    """The remap's axes as (outputs, inputs, before, stride, gathered), each run of neighbours that it
    copies as they are (as many outputs as inputs, none before, not the gathered axis) and that lie one
    after another in x merged into one, and axes of one value left out: how a tensor of more than RANK
    axes fits."""
    axes: list[tuple[int, int, int, int, bool]] = []
    for i, (size, n, start, stride) in enumerate(zip(sizes, dims, starts, strides)):
        plain = size == n and start == 0 and i != gathered
        if plain and n == 1:
            continue
        last = axes[-1] if axes else None
        if plain and last and last[0] == last[1] and last[2] == 0 and not last[4] and last[3] == stride * n:
            axes[-1] = (last[0] * n, last[1] * n, 0, stride, False)
        else:
            axes.append((size, n, start, stride, i == gathered))
    return axes


def remap(x, shape, mode: str, before=(), value=0.0, index=None, axis=-1):
    """`_remap_kernel`'s output of `shape` from x (read where it lies, however strided)."""
    out = torch.empty(tuple(shape), dtype=x.dtype, device=x.device)
    if not out.numel():
        return out
    gathered = axis % x.ndim if mode == "gather" else -1
    axes = remap_axes(out.shape, x.shape, tuple(before) or (0,) * x.ndim, x.stride(), gathered)
    if len(axes) > RANK and not x.is_contiguous():           # its axes may merge once copied in order
        x = x.contiguous()
        axes = remap_axes(out.shape, x.shape, tuple(before) or (0,) * x.ndim, x.stride(), gathered)
    if len(axes) > RANK:
        raise GraphError(f"{mode} of x {list(x.shape)} into {list(out.shape)}: more than the {RANK} axes the cuda "
                         "remap kernel reads")
    axes = [(1, 1, 0, 0, False)] * (RANK - len(axes)) + axes
    sizes, dims, starts, strides, gathered = zip(*axes)
    index = out if index is None else index.contiguous()
    value = float(value) if x.is_floating_point() else int(value)      # an integer x's pads stay exact
    _remap_kernel[(triton.cdiv(out.numel(), REMAP_BLOCK),)](
        x, index, out, out.numel(), value, *sizes, *dims, *starts, *strides, MODE=REMAP[mode],
        AXIS=gathered.index(True) if mode == "gather" else -1, BLOCK=REMAP_BLOCK)
    return out


@jet("pad", CUDA, [(ANY,)])
@device_jet
def pad(x, pads=(), mode="constant", value=0.0):
    """Constant pads with `value` (a negative pad crops: a view, sliced first); edge repeats the end
    values, reflect mirrors about them."""
    pads = tuple(pads) or ((0, 0),) * x.ndim
    if mode == "constant":
        x = x[tuple(slice(max(0, -a), x.shape[i] - max(0, -b)) for i, (a, b) in enumerate(pads))]
        pads = tuple((max(0, a), max(0, b)) for a, b in pads)
    return remap(x, [n + a + b for n, (a, b) in zip(x.shape, pads)], mode, before=[a for a, _ in pads], value=value)


@jet("tile", CUDA, [(ANY,)])
@device_jet
def tile(x, repeats=()):
    return remap(x, [n * r for n, r in zip(x.shape, repeats)], "tile")


@jet("gather", CUDA, [(ANY, INT)])
@device_jet
def gather(x, index, axis=0):
    """numpy's take_along_axis: out[..., i, ...] = x[..., index[..., i, ...], ...] along `axis` (negative
    indices count from the end)."""
    return remap(x, index.shape, "gather", index=index, axis=axis)
