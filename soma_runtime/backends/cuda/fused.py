"""The steps fused around a matmul's product: rmsnorm before it, and after it the gate over (gate, up)
column pairs, the residual and the store. The matrix-vector kernels run them inside (`store_products`);
the other products take them as kernels of their own (`normalized`, `finished`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.elementwise import BINARY, GELU_TANH, UNARY, activate, binary, gated_pairs, normalize

GATES = {"swiglu": UNARY["silu"], "geglu_tanh": GELU_TANH}    # a gated epilogue's activation (`activate`'s kind)
NO_GATE = -1                                                   # ... none: the product as it is


@triton.jit
def store_products(out_ptr, res_ptr, m, N, pn, y, HAS_RES: tl.constexpr, GATE: tl.constexpr, BN: tl.constexpr):
    """Program pn's BN products y of activation row m (of N) stored; with a GATE, rows (and products)
    come in (gate, up) pairs: BN / 2 activated results, of N / 2."""
    PAIRS: tl.constexpr = 1 if GATE < 0 else 2
    if GATE >= 0:
        gate, up = tl.split(tl.reshape(y, (BN // 2, 2)))
        y = activate(gate, GATE, 0.0, 0.0) * up
    _store_row(out_ptr, res_ptr, m, N // PAIRS, pn * (BN // PAIRS) + tl.arange(0, BN // PAIRS), y, HAS_RES)


@triton.jit
def _store_row(out_ptr, res_ptr, m, width, n, y, HAS_RES: tl.constexpr):
    """Matrix-vector results y, columns n of row m (of `width`), stored in the output's dtype, the
    residual added first if there is one."""
    keep = n < width
    at = m * width + n
    if HAS_RES:
        y += tl.load(res_ptr + at, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=keep)


def with_residual(out: torch.Tensor, residual):
    return out if residual is None else binary(out, residual, BINARY["add"])


def finished(y: torch.Tensor, gate: int, residual) -> torch.Tensor:
    """A product outside the matrix-vector kernels, gated (interleaved column pairs) and joined to the residual."""
    return with_residual(y if gate == NO_GATE else gated_pairs(y, gate), residual)


def gemv_residual(residual, like: torch.Tensor) -> torch.Tensor:
    """The residual as the matrix-vector kernels read it: [rows, N], contiguous (else `like`, unread)."""
    return like if residual is None else residual.reshape(like.shape).contiguous()


def normalized(rows: torch.Tensor, norm) -> torch.Tensor:
    """rmsnorm(rows) with norm = (weight, eps), for the kernels that do not fold it in (None: as is)."""
    return rows if norm is None else normalize(rows, norm[0], None, norm[1], center=False)
