"""CUDA jets for layout ops: views of device tensors (a copy only where a view cannot be had), and the
indexed reads (take) that gather rows."""
from __future__ import annotations

import torch

from soma_runtime.backends.cuda.device import CUDA, INT, device_jet
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
