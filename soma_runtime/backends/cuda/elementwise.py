"""CUDA jets for elementwise ops, activations, norms (of rows, groups and channels) and softmax: Triton
kernels over flat or row views, computing in f32 and storing in the op's dtype (broadcast operands are
expanded first)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import CUDA, INT, TORCH, F, device_jet
from soma_runtime.ir.jets import jet

BLOCK = 1024
BINARY = {"add": 0, "sub": 1, "mul": 2, "div": 3, "pow": 4, "minimum": 5, "maximum": 6}
UNARY = {"silu": 0, "sigmoid": 1, "tanh": 2, "relu": 3, "leaky_relu": 4, "gelu": 5, "exp": 7, "log": 8, "sqrt": 9,
         "rsqrt": 10, "reciprocal": 11, "erf": 12, "sin": 13, "cos": 14, "floor": 15, "ceil": 16, "round": 17, "neg": 18,
         "abs": 19, "clip": 20, "atan": 21}
GELU_TANH = 6                                      # `activate`'s kind for gelu's tanh approximation
MOD, FMOD = 7, 8                                   # `_binary_kernel`'s ops for the mod op: floored, truncated


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _erf(x):
    """erf to 1.2e-7 (Numerical Recipes' Chebyshev fit of erfc), in plain arithmetic for every target."""
    z = tl.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    r = t * tl.exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    return tl.where(x >= 0, 1.0 - r, r - 1.0)


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _power(a, b):
    """a ** b for any sign of a: |a| ** b through exp2 and log2, negated for a < 0 and an odd integer b,
    NaN for a < 0 and a fractional b, 1 for b = 0."""
    magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = whole & ((b - 2.0 * tl.floor(b * 0.5)) != 0.0)
    signed = tl.where(odd, -magnitude, magnitude)
    y = tl.where(a < 0, tl.where(whole, signed, float("nan")), magnitude)
    return tl.where(b == 0, 1.0, y)


@triton.jit
def _atan(x):
    """atan to about 2 ulp (Cephes' atanf): |x| reduced to [0, tan(pi/8)] about pi/2 or pi/4, an odd
    polynomial there, the sign put back (no sin or cos: they would spill the unary kernel's registers)."""
    size = tl.abs(x)
    big = size > 2.414213562373095
    mid = size > 0.4142135623730950
    t = tl.where(big, -1.0 / size, tl.where(mid, (size - 1.0) / (size + 1.0), size))
    z = t * t
    y = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    y += (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * t + t
    return tl.where(x < 0, -y, y)


@triton.jit
def activate(x, kind: tl.constexpr, a, b):
    """The unary function `kind` (UNARY's numbers) of x; `a` is leaky_relu's slope and clip's low bound,
    `b` clip's high one."""
    if kind == 0:
        y = x * tl.sigmoid(x)
    elif kind == 1:
        y = tl.sigmoid(x)
    elif kind == 2:
        y = _tanh(x)
    elif kind == 3:
        y = tl.maximum(x, 0.0)
    elif kind == 4:
        y = tl.where(x >= 0, x, x * a)
    elif kind == 5:
        y = 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))
    elif kind == 6:                                # gelu, tanh approximation
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif kind == 7:
        y = tl.exp(x)
    elif kind == 8:
        y = tl.log(x)
    elif kind == 9:
        y = tl.sqrt(x)
    elif kind == 10:
        y = 1.0 / tl.sqrt(x)
    elif kind == 11:
        y = 1.0 / x
    elif kind == 12:
        y = _erf(x)
    elif kind == 13:
        y = tl.sin(x)
    elif kind == 14:
        y = tl.cos(x)
    elif kind == 15:
        y = tl.floor(x)
    elif kind == 16:
        y = tl.ceil(x)
    elif kind == 17:
        y = _round_half_even(x)
    elif kind == 18:
        y = -x
    elif kind == 19:
        y = tl.abs(x)
    elif kind == 21:
        y = _atan(x)
    else:
        y = tl.minimum(tl.maximum(x, a), b)
    return y


@chained
@triton.jit
def _binary_kernel(a_ptr, b_ptr, out_ptr, n, op: tl.constexpr, FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """Floats in f32; integers (add, sub, mul, min, max) in their own width, wrapping as C and numpy do."""
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    a = tl.load(a_ptr + offs, mask=keep)
    b = tl.load(b_ptr + offs, mask=keep)
    if FLOAT:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if op == 0:
        y = a + b
    elif op == 1:
        y = a - b
    elif op == 2:
        y = a * b
    elif op == 3:
        y = tl.div_rn(a, b)                 # IEEE division: "/" is the approximate div.full.f32
    elif op == 4:
        y = _power(a, b)
    elif op == 5:
        y = tl.minimum(a, b)
    elif op == 6:
        y = tl.maximum(a, b)
    else:                                   # mod: C's remainder (a float's exact fmod), an integer's by 0 being 0
        if FLOAT:
            y = a % b
        else:
            y = tl.where(b == 0, 0, a % tl.where(b == 0, 1, b))
        if op == 7:                         # floored, as Python's: the divisor's sign
            y = tl.where((y != 0) & ((y < 0) != (b < 0)), y + b, y)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _unary_kernel(x_ptr, out_ptr, n, kind: tl.constexpr, a, b, BLOCK: tl.constexpr):
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + offs, mask=keep).to(tl.float32)
    tl.store(out_ptr + offs, activate(x, kind, a, b).to(out_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _gated_kernel(gate_ptr, up_ptr, out_ptr, n, step, kind: tl.constexpr, BLOCK: tl.constexpr):
    """out = act(gate) * up, gate and up read `step` apart (2: a matmul's interleaved column pairs)."""
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    g = tl.load(gate_ptr + offs * step, mask=keep).to(tl.float32)
    u = tl.load(up_ptr + offs * step, mask=keep).to(tl.float32)
    tl.store(out_ptr + offs, (activate(g, kind, 0.0, 0.0) * u).to(out_ptr.dtype.element_ty), mask=keep)


@chained
@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    after_prior()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=keep).to(out_ptr.dtype.element_ty), mask=keep)


def flat_grid(n: int):
    return (triton.cdiv(max(n, 1), BLOCK),)


def binary(a, b, op: int):
    a, b = (t.contiguous() for t in torch.broadcast_tensors(a, b))
    out = torch.empty_like(a)
    _binary_kernel[flat_grid(a.numel())](a, b, out, a.numel(), op=op, FLOAT=a.is_floating_point(), BLOCK=BLOCK)
    return out


def binary_jet(op: int):
    return device_jet(lambda a, b: binary(a, b, op))


for _name, _op in BINARY.items():
    jet(_name, CUDA, [(F, F)])(binary_jet(_op))


for _name in ("add", "sub", "mul", "minimum", "maximum"):     # an exported graph's shape arithmetic stays here
    jet(_name, CUDA, [(INT, INT)])(binary_jet(BINARY[_name]))


def unary(x, kind: int, negative_slope=0.01, approximate="none", min=None, max=None):
    x = x.contiguous()
    out = torch.empty_like(x)
    code = GELU_TANH if kind == UNARY["gelu"] and approximate == "tanh" else kind
    low = float(negative_slope) if kind == UNARY["leaky_relu"] else -float("inf") if min is None else float(min)
    _unary_kernel[flat_grid(x.numel())](x, out, x.numel(), kind=code, a=low, b=float("inf") if max is None else float(max),
                                        BLOCK=BLOCK)
    return out


def unary_jet(kind: int):
    return device_jet(lambda x, **attrs: unary(x, kind, **attrs))


for _name, _kind in UNARY.items():
    jet(_name, CUDA, [(F,)])(unary_jet(_kind))


@jet("mod", CUDA, [(F, F), (INT, INT)])
@device_jet
def mod(a, b, fmod=False):
    """a mod b: floored (the divisor's sign, as Python and numpy's mod) or, with fmod, truncated (C's)."""
    return binary(a, b, FMOD if fmod else MOD)


def gated_jet(gelu: bool):
    @device_jet
    def run(gate, up, approximate="none"):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        kind = (GELU_TANH if approximate == "tanh" else UNARY["gelu"]) if gelu else UNARY["silu"]
        _gated_kernel[flat_grid(gate.numel())](gate, up, out, gate.numel(), 1, kind=kind, BLOCK=BLOCK)
        return out
    return run


def gated_pairs(y: torch.Tensor, kind: int) -> torch.Tensor:
    """act(y[..., 2i]) * y[..., 2i + 1] -> [..., N / 2]: a gated matmul epilogue after the product."""
    y = y.contiguous()
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
    flat = y.reshape(-1)
    _gated_kernel[flat_grid(out.numel())](flat, flat[1:], out, out.numel(), 2, kind=kind, BLOCK=BLOCK)
    return out


jet("swiglu", CUDA, [(F, F)])(gated_jet(False))
jet("geglu", CUDA, [(F, F)])(gated_jet(True))


@jet("cast", CUDA, [(F,), (INT,), ("bool",)])
@device_jet
def cast(x, dtype="f32"):
    if dtype not in (*F, *INT) or not x.is_floating_point():   # the rarer targets (bool, f64, narrow ints) and
        return x.to(TORCH[dtype])                              # integer sources (an exported mask's): torch's own
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=TORCH[dtype], device=x.device)
    _cast_kernel[flat_grid(x.numel())](x, out, x.numel(), BLOCK=BLOCK)
    return out


@chained
@triton.jit
def _norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                 CENTER: tl.constexpr, BLOCK: tl.constexpr):
    """One row: rmsnorm (CENTER=False) or layernorm (CENTER=True), then weight and bias if given."""
    after_prior()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
    if CENTER:
        x = tl.where(keep, x - tl.sum(x, 0) / n, 0.0)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=keep).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=keep).to(tl.float32)
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=keep)


def normalize(x, weight, bias, eps, center):
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    _norm_kernel[(x.numel() // max(n, 1),)](x, weight if weight is not None else x, bias if bias is not None else x, out, n,
                                            float(eps), HAS_W=weight is not None, HAS_B=bias is not None, CENTER=center,
                                            BLOCK=triton.next_power_of_2(n))
    return out


@jet("rmsnorm", CUDA, [(F, F), (F, "none")])
@device_jet
def rmsnorm(x, weight, eps=1e-6):
    return normalize(x, weight, None, eps, center=False)


@jet("layernorm", CUDA, [(F, F, F), (F, "none", "none"), (F, F, "none")])
@device_jet
def layernorm(x, weight, bias, eps=1e-5):
    return normalize(x, weight, bias, eps, center=True)


@chained
@triton.jit
def _channel_affine_kernel(x_ptr, mean_ptr, var_ptr, w_ptr, b_ptr, out_ptr, total, channels, spatial, eps,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    """batchnorm of x [N, C, spatial]: each value less its channel's mean, over sqrt(var + eps), then the
    channel's weight and bias if given."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < total
    c = offs // spatial % channels
    x = tl.load(x_ptr + offs, mask=keep).to(tl.float32)
    mean = tl.load(mean_ptr + c, mask=keep).to(tl.float32)
    var = tl.load(var_ptr + c, mask=keep, other=1.0).to(tl.float32)
    y = tl.div_rn(x - mean, tl.sqrt_rn(var + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=keep).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + c, mask=keep).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)


@jet("batchnorm", CUDA, [(F, F, F, a, b) for a in (F, "none") for b in (F, "none")])
@device_jet
def batchnorm(x, mean, var, weight, bias, eps=1e-5):
    x = x.contiguous()
    out = torch.empty_like(x)
    spatial = x[0, 0].numel() if x.ndim > 2 else 1
    _channel_affine_kernel[flat_grid(x.numel())](x, mean, var, weight if weight is not None else x,
                                                 bias if bias is not None else x, out, x.numel(), x.shape[1], spatial,
                                                 float(eps), HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=BLOCK)
    return out


@chained
@triton.jit
def _groupnorm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, group_channels, spatial, groups, eps, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    """One (sample, group) row of n values (its channels' spatial values, in order): the mean, then the
    variance about it, BLOCK values at a time, then the row normalized and each channel's weight and bias."""
    after_prior()
    row = tl.program_id(0).to(tl.int64)
    first = (row % groups) * group_channels
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    mean = tl.sum(total, 0) / n
    squares = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0).to(tl.float32)
        d = tl.where(cols < n, x - mean, 0.0)
        squares += d * d
    scale = 1.0 / tl.sqrt_rn(tl.sum(squares, 0) / n + eps)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n
        y = (tl.load(x_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32) - mean) * scale
        channel = first + cols // spatial
        if HAS_W:
            y = y * tl.load(w_ptr + channel, mask=keep).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + channel, mask=keep).to(tl.float32)
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=keep)


@jet("groupnorm", CUDA, [(F, a, b) for a in (F, "none") for b in (F, "none")])
@device_jet
def groupnorm(x, weight, bias, groups=32, eps=1e-5):
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.shape[0] * groups
    n = x.numel() // max(rows, 1)
    if out.numel():
        _groupnorm_kernel[(rows,)](x, weight if weight is not None else x, bias if bias is not None else x, out, n,
                                   x.shape[1] // groups, n // (x.shape[1] // groups), groups, float(eps),
                                   HAS_W=weight is not None, HAS_B=bias is not None,
                                   BLOCK=min(BLOCK, triton.next_power_of_2(max(n, 1))))
    return out


@chained
@triton.jit
def _softmax_kernel(x_ptr, mask_ptr, out_ptr, n, rows, causal: tl.constexpr, window, HAS_MASK: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One row; with `causal`/`window`, query row i of each [rows, n] matrix sees key j when
    j <= i + n - rows and i + n - rows - j < window (bottom-right aligned, as the op says)."""
    after_prior()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=keep, other=-float("inf")).to(tl.float32)
    if HAS_MASK:
        x = x + tl.load(mask_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
    q = row % rows + n - rows
    if causal:
        x = tl.where(cols <= q, x, -float("inf"))
    if window > 0:
        x = tl.where(q - cols < window, x, -float("inf"))
    e = tl.exp(x - tl.max(x, 0))
    tl.store(out_ptr + row * n + cols, (e / tl.sum(e, 0)).to(out_ptr.dtype.element_ty), mask=keep)


@jet("softmax", CUDA, [(F, F), (F, "none")])
@device_jet
def softmax(x, mask, axis=-1, causal=False, window=0):
    if mask is not None:
        x, mask = torch.broadcast_tensors(x, mask.to(x.dtype))
    last = axis in (-1, x.ndim - 1)
    x = (x if last else x.movedim(axis, -1)).contiguous()
    if mask is not None:
        mask = (mask if last else mask.movedim(axis, -1)).contiguous()
    n, rows = x.shape[-1], x.shape[-2] if x.ndim >= 2 else 1
    out = torch.empty_like(x)
    _softmax_kernel[(x.numel() // max(n, 1),)](x, mask if mask is not None else x, out, n, rows, causal=bool(causal),
                                               window=int(window), HAS_MASK=mask is not None, BLOCK=triton.next_power_of_2(n))
    return out if last else out.movedim(-1, axis)


@chained
@triton.jit
def _argmax_kernel(x_ptr, best_ptr, where_ptr, n, parts, BLOCK: tl.constexpr):
    """Part p of row r: the largest of its BLOCK values and the first index holding it (as numpy)."""
    after_prior()
    r, p = tl.program_id(0), tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * n + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
    x = tl.where(cols < n, x, -float("inf"))
    top = tl.max(x, 0)
    tl.store(best_ptr + r * parts + p, top)
    tl.store(where_ptr + r * parts + p, tl.min(tl.where((x == top) & (cols < n), cols, n), 0))


@chained
@triton.jit
def _argmax_parts_kernel(best_ptr, where_ptr, out_ptr, n, parts, PARTS: tl.constexpr):
    """Row r: the best of its parts, the first (lowest index) on ties."""
    after_prior()
    r = tl.program_id(0)
    p = tl.arange(0, PARTS)
    best = tl.load(best_ptr + r * parts + p, mask=p < parts, other=-float("inf"))
    where = tl.load(where_ptr + r * parts + p, mask=p < parts, other=n)
    top = tl.max(best, 0)
    tl.store(out_ptr + r, tl.min(tl.where(best == top, where, n), 0).to(tl.int64))


@jet("argmax", CUDA, [(F,)])
@device_jet
def argmax(x, axis=-1):
    """Greedy decoding's token choice on the device (only the ids cross to the host, not the logits):
    rows split in parts reduced in parallel, then the parts."""
    moved = x.movedim(axis, -1).contiguous()
    n = moved.shape[-1]
    out = torch.empty(moved.shape[:-1], dtype=torch.int64, device=x.device)
    rows, block = out.numel(), min(4096, triton.next_power_of_2(max(n, 1)))
    parts = triton.cdiv(max(n, 1), block)
    if rows:
        best = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
        where = torch.empty((rows, parts), dtype=torch.int32, device=x.device)
        _argmax_kernel[(rows, parts)](moved, best, where, n, parts, BLOCK=block)
        _argmax_parts_kernel[(rows,)](best, where, out, n, parts, PARTS=max(2, triton.next_power_of_2(parts)))
    return out
