"""CPU jets for convolution (im2col blocks into BLAS; Winograd for 3x3 stride 1; depthwise and other thin
ones by direct loops over stride phases), each with its residual and activation applied to an output block
while it is in cache; transposed convolution, pooling and interpolation."""
from __future__ import annotations

import itertools
import math
import weakref
from contextlib import contextmanager

import numba
import numpy as np
from numba import njit, prange

from soma_runtime.backends.cpu import blas
from soma_runtime.backends.cpu.common import CPU, F, all_f32, dense, float_kernel, out_f32, padded
from soma_runtime.backends.cpu.linear import product
from soma_runtime.backends.cpu.simd import exp_f32
from soma_runtime.ir.jets import jet
from soma_runtime.ir.ops import as_tuple, source_scale
from soma_runtime.ir.ops.conv import CONV_EPILOGUES


def windows(x, kernel, stride, dilation):
    """[N, C, *spatial] -> [N, C, *out, *kernel] strided view, no copy."""
    outs = tuple((n - (k - 1) * d - 1) // s + 1 for n, k, s, d in zip(x.shape[2:], kernel, stride, dilation))
    steps = x.strides[2:]
    strides = x.strides[:2] + tuple(b * s for b, s in zip(steps, stride)) + tuple(b * d for b, d in zip(steps, dilation))
    return np.lib.stride_tricks.as_strided(x, x.shape[:2] + outs + tuple(kernel), strides, writeable=False)


@njit(cache=True, inline="always")
def _span(n_out, n_in, start, stride):
    """The outputs [lo, hi) whose input start + o * stride falls inside [0, n_in)."""
    lo = 0 if start >= 0 else (-start + stride - 1) // stride
    hi = 0 if start >= n_in else min(n_out, (n_in - 1 - start) // stride + 1)
    return lo, max(lo, hi)


RELU, RELU6, SILU = (CONV_EPILOGUES.index(name) for name in ("relu", "relu6", "silu"))   # numba's codes for them


@njit(cache=True, inline="always")
def _activate(v, code):
    """CONV_EPILOGUES[code] of one sum."""
    if code == RELU:
        return max(v, np.float32(0))
    if code == RELU6:
        return min(max(v, np.float32(0)), np.float32(6))
    if code == SILU:
        return v / (np.float32(1) + exp_f32(-v))          # vectorizable (libm's expf is a call a value)
    return v


@njit(parallel=True, cache=True, error_model="numpy")
def _finish(y, bias, residual, code, first, last):
    """y[:, first:last] = epilogue(y + bias + residual) over a block of columns still in cache: y [O, P] (one
    image's rows), bias [O] and residual [O, P] (or empty)."""
    for o in prange(y.shape[0]):
        b = bias[o] if bias.size else np.float32(0)
        row = y[o, first:last]
        if residual.size:
            joined = residual[o, first:last]
            for k in range(last - first):
                row[k] = _activate(row[k] + b + joined[k], code)
        else:
            for k in range(last - first):
                row[k] = _activate(row[k] + b, code)


@njit(parallel=True, cache=True)
def _im2col(x, kh, kw, sh, sw, ph, pw, dh, dw, first, last, width, cols):
    """cols[c * kh * kw + i * kw + j, p - first] = x[c, oh * sh - ph + i * dh, ow * sw - pw + j * dw] (zero
    outside x) for output positions first <= p = oh * width + ow < last: x [C, H, W] -> cols [C * kh * kw,
    last - first] (a block of a long 1-D convolution's positions, or of an image's rows)."""
    C, H, W = x.shape
    for r in prange(C * kh * kw):
        c, i, j = r // (kh * kw), (r // kw) % kh, r % kw
        start = j * dw - pw
        lo, hi = _span(width, W, start, sw)
        for oh in range(first // width, (last - 1) // width + 1):
            a, b = max(first - oh * width, 0), min(last - oh * width, width)      # this row's outputs in the block
            base = oh * width - first
            h = oh * sh - ph + i * dh
            if h < 0 or h >= H:
                cols[r, base + a:base + b] = 0
                continue
            inner_lo, inner_hi = min(max(lo, a), b), max(min(hi, b), min(max(lo, a), b))
            cols[r, base + a:base + inner_lo] = 0
            row, src = cols[r, base + inner_lo:base + inner_hi], x[c, h, inner_lo * sw + start::sw]
            for k in range(inner_hi - inner_lo):
                row[k] = src[k]
            cols[r, base + inner_hi:base + b] = 0


ROW_VIEWS = 32    # phase rows at least this long are copied through views (a view costs more than a short row's copy)


@njit(parallel=True, cache=True)
def _phases(x, sh, sw, ph, pw, fill, planes):
    """x [planes, H, W] padded and split by stride phase: planes[t, a * sw + b, u, v] = x[t, u * sh + a - ph,
    v * sw + b - pw] (`fill` outside x), so that a strided convolution or pooling reads each phase at stride 1.
    Short rows are written by index: a view made per row costs more than their copy."""
    T, H, W = x.shape
    Hq, Wq = planes.shape[2], planes.shape[3]
    for t in prange(T):
        for a in range(sh):
            for b in range(sw):
                p = a * sw + b
                lo, hi = _span(Wq, W, b - pw, sw)
                for u in range(Hq):
                    h = u * sh + a - ph
                    if h < 0 or h >= H:
                        for v in range(Wq):
                            planes[t, p, u, v] = fill
                        continue
                    for v in range(lo):
                        planes[t, p, u, v] = fill
                    for v in range(hi, Wq):
                        planes[t, p, u, v] = fill
                    if Wq < ROW_VIEWS:
                        for v in range(lo, hi):
                            planes[t, p, u, v] = x[t, h, v * sw + b - pw]
                    else:                           # a long row: copied through 1-D views, the loop LLVM vectorizes
                        row, src = planes[t, p, u], x[t, h]
                        for v in range(hi - lo):
                            row[lo + v] = src[(lo + v) * sw + b - pw]


@njit(parallel=True, cache=True, error_model="numpy")
def _direct(planes, w, bias, residual, code, C, Wq, sh, sw, dh, dw, KH, KW, scratch, y):
    """A convolution of few outputs per group (depthwise) by direct loops over stride phases (planes [N * C,
    phases, rows * Wq], Wq its row pitch): each tap adds a weighted phase plane, read as one flat run, to a row-padded output
    plane (scratch [N * O, span >= OH * pitch]; its pad columns and the run's rounding dropped after) of
    y [N * O, OH, OW] (residual the same, or empty); w [O, Cg * KH * KW]. No views made in the loops."""
    T, OH, OW = y.shape
    O, depth = w.shape
    Cg = depth // (KH * KW)
    Og = O // (C // Cg)
    span = scratch.shape[1]
    for t in prange(T):
        n, o = t // O, t % O
        wide = scratch[t]
        wide[:] = bias[o] if bias.size else np.float32(0)
        for c in range(Cg):
            plane = n * C + (o // Og) * Cg + c
            for i in range(KH):
                for j in range(KW):
                    weight = w[o, (c * KH + i) * KW + j]
                    first = ((i * dh) // sh) * Wq + (j * dw) // sw
                    run = planes[plane, ((i * dh) % sh) * sw + (j * dw) % sw, first:first + span]
                    for k in range(span):           # over 1-D views: the loop LLVM vectorizes (2-D indexing: 8x slower)
                        wide[k] += weight * run[k]
        for oh in range(OH):
            for k in range(OW):
                v = wide[oh * Wq + k]
                if residual.size:
                    v += residual[t, oh, k]
                y[t, oh, k] = _activate(v, code)


def phase_width(W, sw, pw) -> int:
    """The row pitch of x's stride phase planes (W wide, padded by pw each side)."""
    return -(-(W + 2 * pw) // sw)


def phases(x, st, pd, fill, slack: int = 1) -> np.ndarray:
    """x [N, C, H, W] f32 padded by `fill` and split by stride phase (_phases): [N, C, phases, rows, pitch], with
    `slack` rows of fill after (the last taps' flat runs read past the plane's end)."""
    (sh, sw), (ph, pw) = st, pd
    N, C, H, W = x.shape
    planes = np.empty((N, C, sh * sw, -(-(H + 2 * ph) // sh) + slack, phase_width(W, sw, pw)), np.float32)
    _phases(x.reshape(N * C, H, W), sh, sw, ph, pw, np.float32(fill), planes.reshape(N * C, *planes.shape[2:]))
    return planes


RUN = 64    # a tap's flat run is rounded up to this many floats: numba's vector loop (16 lanes x 4) then has no scalar tail


def direct(x, w, bias, residual, code, st, pd, dl, y):
    """y = epilogue(conv(x, w) + bias + residual) by stride phases (x [N, C, H, W] f32)."""
    N, C = x.shape[:2]
    O, _, KH, KW = w.shape
    pitch = phase_width(x.shape[3], st[1], pd[1])
    span = -(-(y.shape[2] * pitch) // RUN) * RUN
    planes = phases(x, st, pd, 0, slack=1 + -(-(span - y.shape[2] * pitch) // pitch))
    scratch = np.empty((N * O, span), np.float32)
    flat = lambda a: a.reshape(N * O, *a.shape[2:]) if a.size else NO_IMAGE
    _direct(planes.reshape(N * C, planes.shape[2], -1), w.reshape(O, -1), bias, flat(residual), code, C, pitch, *st,
            *dl, KH, KW, scratch, flat(y))


# --- Winograd F(2x2, 3x3): a 3x3 stride-1 convolution as 16 products over 4x4 input tiles, 2.25x fewer
# multiplies than its im2col product (Lavin & Gray, 2015); the transforms' constants are exact in binary.
WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
WINOGRAD_MIN_CHANNELS = 64     # below this many input or output channels the transforms cost more than they save,
WINOGRAD_MIN_OUTPUTS = 100     # ... and below this many outputs an image (its products too narrow for BLAS)
TILE_BYTES = 1 << 20           # a block of tile rows whose transformed inputs stay in cache through the products
_transformed: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def winograd_weights(w: np.ndarray) -> np.ndarray:
    """U[4a + b, o, c] = (G w[o, c] G^T)[a, b], made once per weight (the model's constant) and kept beside it."""
    key = id(w)
    if key in _transformed and _transformed[key][0]() is w:
        return _transformed[key][1]
    U = np.einsum("ai,ocij,bj->aboc", WINOGRAD_G, w.astype(np.float64), WINOGRAD_G)
    U = np.ascontiguousarray(U.reshape(16, *w.shape[:2]).astype(np.float32))
    _transformed[key] = (weakref.ref(w, lambda _, key=key: _transformed.pop(key, None)), U)
    return U


@njit(parallel=True, cache=True, error_model="numpy")
def _winograd_in(x, pad, first, last, TW, V):
    """V[4a + b, c, (th - first) * TW + tw] = (B^T d B)[a, b] for the 4x4 tile d of x [C, H, W] at
    (2 th - pad, 2 tw - pad) (zero outside x), tile rows first <= th < last: rows combined first, then
    columns, each a loop over whole rows."""
    C, H, W = x.shape
    width = 2 * TW + 2
    lo, hi = pad, min(width, W + pad)
    for c in prange(C):
        rows = np.zeros((4, width), np.float32)
        comb = np.empty((4, width), np.float32)
        for th in range(first, last):
            for i in range(4):
                h = 2 * th - pad + i
                rows[i, :] = 0
                if 0 <= h < H:
                    rows[i, lo:hi] = x[c, h, :hi - lo]
            for k in range(width):
                comb[0, k] = rows[0, k] - rows[2, k]
                comb[1, k] = rows[1, k] + rows[2, k]
                comb[2, k] = rows[2, k] - rows[1, k]
                comb[3, k] = rows[1, k] - rows[3, k]
            t0 = (th - first) * TW
            for a in range(4):
                r = comb[a]
                v0, v1 = V[4 * a, c, t0:t0 + TW], V[4 * a + 1, c, t0:t0 + TW]
                v2, v3 = V[4 * a + 2, c, t0:t0 + TW], V[4 * a + 3, c, t0:t0 + TW]
                for tw in range(TW):
                    v0[tw] = r[2 * tw] - r[2 * tw + 2]
                    v1[tw] = r[2 * tw + 1] + r[2 * tw + 2]
                    v2[tw] = r[2 * tw + 2] - r[2 * tw + 1]
                    v3[tw] = r[2 * tw + 1] - r[2 * tw + 3]


@njit(parallel=True, cache=True, error_model="numpy")
def _winograd_out(M, bias, residual, code, first, last, TW, y):
    """y [O, OH, OW] rows 2 first <= h < 2 last = epilogue(A^T m A + bias + residual) of each tile's 16
    products m = M[:, o, (th - first) * TW + tw]."""
    O, OH, OW = y.shape
    for o in prange(O):
        b = bias[o] if bias.size else np.float32(0)
        s = np.empty((2, 4, TW), np.float32)
        for th in range(first, last):
            t0 = (th - first) * TW
            for j in range(4):
                m0, m1, m2, m3 = M[j, o, t0:t0 + TW], M[4 + j, o, t0:t0 + TW], M[8 + j, o, t0:t0 + TW], M[12 + j, o, t0:t0 + TW]
                for tw in range(TW):
                    s[0, j, tw] = m0[tw] + m1[tw] + m2[tw]
                    s[1, j, tw] = m1[tw] - m2[tw] - m3[tw]
            for a in range(min(2, OH - 2 * th)):
                row = y[o, 2 * th + a]
                for ow in range(OW):
                    tw = ow // 2
                    if ow % 2:
                        v = s[a, 1, tw] - s[a, 2, tw] - s[a, 3, tw] + b
                    else:
                        v = s[a, 0, tw] + s[a, 1, tw] + s[a, 2, tw] + b
                    if residual.size:
                        v += residual[o, 2 * th + a, ow]
                    row[ow] = _activate(v, code)


def winograd(x, w, bias, residual, code, pad, y):
    """y = epilogue(conv(x, w) + bias + residual), w 3x3 at stride 1: per image, blocks of tile rows
    transformed, multiplied (16 BLAS products [O, C] @ [C, tiles]) and transformed back."""
    N, C = x.shape[:2]
    OH, OW = y.shape[2:]
    TH, TW = -(-OH // 2), -(-OW // 2)
    U = winograd_weights(w)
    rows = max(1, min(TH, TILE_BYTES // (64 * C * TW)))
    V = np.empty((16, C, rows * TW), np.float32)
    M = np.empty((16, U.shape[1], rows * TW), np.float32)
    for n in range(N):
        for first in range(0, TH, rows):
            last = min(TH, first + rows)
            tiles = (last - first) * TW
            _winograd_in(x[n], pad, first, last, TW, V[:, :, :tiles])
            blas.matmul(U, V[:, :, :tiles], M[:, :, :tiles])
            _winograd_out(M[:, :, :tiles], bias, residual[n] if residual.size else NO_IMAGE, code, first, last, TW, y[n])


COLUMN_BYTES = 4 << 20         # a convolution's im2col is built this many bytes of columns at a time
SERIAL_WORK = 1 << 19          # multiply-adds under which a convolution's kernels run on one thread
SERIAL_DIRECT = 1 << 16        # ... where they are direct loops (slower a multiply-add: the others repay sooner)
NO_ROWS, NO_IMAGE = np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.float32)   # an absent residual, to numba
DIRECT_OUTPUTS = 4             # up to this many outputs per group (depthwise: a product too thin for BLAS): direct loops


@jet("conv1d", CPU, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
@jet("conv2d", CPU, [(F, F, b, r) for b in (F, "none") for r in (F, "none")])
def conv(x, weight, bias, residual, stride, padding, dilation, groups, epilogue, out=None):
    """conv1d and conv2d share one formula (hence one jet): the spatial rank comes from x."""
    nd = x.ndim - 2
    st, pd, dl = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
    outputs = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(x.shape[2:], weight.shape[2:], st, pd, dl)]
    work = x.shape[0] * weight.size * math.prod(outputs)                  # multiply-adds
    given = [t for t in (x, weight, bias, residual) if t is not None]
    if not all_f32(*given) or groups == 1 and work < SERIAL_WORK:
        return _conv_numpy(x, weight, bias, residual, stride=st, padding=pd, dilation=dl, groups=groups,
                           epilogue=epilogue, out=out)
    planar = (lambda a: a[:, :, None]) if nd == 1 else (lambda a: a)     # a 1-D convolution is a 2-D one of height 1
    x4, w4 = planar(dense(x)), planar(dense(weight))
    st, pd, dl, (OH, OW) = ((1,) + st, (0,) + pd, (1,) + dl, [1] + outputs) if nd == 1 else (st, pd, dl, outputs)
    N, O, Cg = x4.shape[0], *w4.shape[:2]
    y = out_f32(out, (N, O, *outputs))
    y4 = y.reshape(N, O, OH, OW)
    b = np.zeros(0, np.float32) if bias is None else dense(bias)
    r = np.zeros((0,) * 4, np.float32) if residual is None else dense(residual).reshape(y4.shape)
    code = CONV_EPILOGUES.index(epilogue)
    thin = O // groups <= DIRECT_OUTPUTS
    with threads_for(work, SERIAL_DIRECT if thin else SERIAL_WORK):
        if thin:
            direct(x4, w4, b, r, code, st, pd, dl, y4)
        elif (*w4.shape[2:], groups, *st, *dl) == (3, 3, 1, 1, 1, 1, 1) and pd[0] == pd[1] \
                and min(Cg, O) >= WINOGRAD_MIN_CHANNELS and OH * OW >= WINOGRAD_MIN_OUTPUTS:
            winograd(x4, w4, b, r, code, pd[0], y4)
        else:
            _im2col_gemm(x4, w4, b, r, code, st, pd, dl, groups, y4)
    return y


@contextmanager
def threads_for(work: int, serial: int):
    """numba's kernels on one thread for a convolution of less `work` (multiply-adds) than `serial`: waking
    the others costs more than they save (a streaming model's chunk)."""
    threads = numba.get_num_threads()
    if work >= serial or threads == 1:
        yield
        return
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)


def _im2col_gemm(x, w, bias, residual, code, st, pd, dl, groups, y):
    """Per image and group: output rows' im2col columns, a block at a time, times the group's [O/G, C/G * k]
    weight by BLAS straight into y's rows, then bias, residual and epilogue on the block while it is in cache
    (a 1x1 stride-1 convolution reads x itself as its columns)."""
    N, H, W = x.shape[0], *x.shape[2:]
    O, Cg, KH, KW = w.shape
    OH, OW = y.shape[2:]
    Og, depth = O // groups, Cg * KH * KW
    weights = w.reshape(groups, Og, depth)
    pointwise = KH == KW == 1 and st == (1, 1) and pd == (0, 0)
    P = OH * OW
    span = P if pointwise else max(1, min(P, COLUMN_BYTES // (4 * depth)))
    cols = None if pointwise else np.empty((depth, span), np.float32)
    finish = bias.size or residual.size or code
    for n, g in itertools.product(range(N), range(groups)):
        into = y[n, g * Og:(g + 1) * Og].reshape(Og, P)
        image = x[n, g * Cg:(g + 1) * Cg]
        for first in range(0, P, span):
            last = min(P, first + span)
            if pointwise:
                blas.matmul(weights[g], image.reshape(Cg, H * W), into)
            else:
                block = cols[:, :last - first]
                _im2col(image, KH, KW, *st, *pd, *dl, first, last, OW, block)
                blas.matmul(weights[g], block, into[:, first:last])
            if finish:
                joined = residual[n, g * Og:(g + 1) * Og].reshape(Og, P) if residual.size else NO_ROWS
                _finish(into, bias[g * Og:(g + 1) * Og] if bias.size else bias, joined, code, first, last)


ACTIVATIONS = {"none": lambda y: y, "relu": lambda y: np.maximum(y, 0), "relu6": lambda y: np.clip(y, 0, 6),
               "silu": lambda y: y / (1 + np.exp(-y))}


@float_kernel
def _conv_numpy(x, weight, bias, residual, stride, padding, dilation, groups, epilogue):
    """Half inputs and small convolutions, with their epilogue after."""
    y = _conv_sum(x, weight, bias, stride, padding, dilation, groups)
    return ACTIVATIONS[epilogue](y if residual is None else y + residual)


def _conv_sum(x, weight, bias, stride, padding, dilation, groups):
    """Windows of the padded input through batched BLAS, or through the matmul jet's product of a few rows
    on one thread (a streaming model's chunk: no thread woken)."""
    nd = x.ndim - 2
    N, C = x.shape[:2]
    O, kernel = weight.shape[0], weight.shape[2:]
    cols = windows(padded(x, [(p, p) for p in padding], 0), kernel, stride, dilation)                    # [N, C, *out, *k]
    spatial = cols.shape[2:2 + nd]
    P, K, G = math.prod(spatial), math.prod(kernel), groups
    cols = cols.reshape(N, G, C // G, P, K).transpose(1, 0, 3, 2, 4).reshape(G, N * P, (C // G) * K)
    w = weight.reshape(G, O // G, (C // G) * K)
    y = product(cols[0], w[0], None, True, "f32")[None] if G == 1 else \
        blas.matmul(cols, w.transpose(0, 2, 1), np.empty((G, N * P, O // G), np.float32))              # [G, N*P, O/G]
    y = y.reshape(G, N, P, O // G).transpose(1, 0, 3, 2).reshape(N, O, *spatial)
    return y if bias is None else y + bias.reshape((O,) + (1,) * nd)


@jet("conv_transpose1d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv_transpose2d", CPU, [(F, F, F), (F, F, "none")])
@jet("conv_transpose3d", CPU, [(F, F, F), (F, F, "none")])
@float_kernel
def conv_transpose(x, weight, bias, stride, dilation, groups, crop):
    """Each input times the kernel, overlap-added `stride` apart: one matmul per group ([O/g * K, C/g] @
    [C/g, N * spatial]), then one strided add per kernel offset (no zeros multiplied, as a zero-spread
    input convolved would)."""
    nd = x.ndim - 2
    N, C, spatial = x.shape[0], x.shape[1], x.shape[2:]
    kernel, G = weight.shape[2:], groups
    Og = weight.shape[1]
    st, dl = as_tuple(stride, nd), as_tuple(dilation, nd)
    crops = tuple(crop) or ((0, 0),) * nd
    xs = x.reshape(N, G, C // G, -1).transpose(1, 2, 0, 3).reshape(G, C // G, -1)
    w = weight.reshape(G, C // G, -1).transpose(0, 2, 1)
    z = blas.matmul(w, xs, np.empty((G, w.shape[1], xs.shape[2]), np.float32))     # [G, Og * K, N * P]
    z = np.moveaxis(z.reshape(G * Og, *kernel, N, *spatial), 1 + nd, 0)               # [N, O, *kernel, *spatial]
    full = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(spatial, kernel, st, dl)]
    y = np.zeros((N, G * Og, *(f + max(0, -c[1]) for f, c in zip(full, crops))), np.float32)
    for offsets in itertools.product(*(range(k) for k in kernel)):
        into = tuple(slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in zip(offsets, dl, st, spatial))
        y[(slice(None), slice(None)) + into] += z[(slice(None), slice(None)) + offsets]
    y = y[(slice(None), slice(None)) + tuple(slice(c[0], y.shape[2 + i] - max(0, c[1])) for i, c in enumerate(crops))]
    return y if bias is None else y + bias.reshape((-1,) + (1,) * nd)


@njit(parallel=True, cache=True, error_model="numpy")
def _pool(planes, kh, kw, sh, sw, Wq, average, y):
    """Max or mean (padding counted, as the atoms' zero-padded windows) over kh x kw windows, each tap a flat
    run of a stride phase plane (planes [N * C, phases, rows * Wq], as _direct's), y [N * C, OH, OW]."""
    T, OH, OW = y.shape
    span = OH * Wq
    for t in prange(T):
        wide = np.empty(span, np.float32)
        wide[:] = np.float32(0) if average else np.float32(-np.inf)
        for i in range(kh):
            for j in range(kw):
                first = (i // sh) * Wq + j // sw
                run = planes[t, (i % sh) * sw + j % sw, first:first + span]
                if average:
                    for k in range(span):
                        wide[k] += run[k]
                else:
                    for k in range(span):
                        wide[k] = max(wide[k], run[k])
        scale = np.float32(1 / (kh * kw)) if average else np.float32(1)
        for oh in range(OH):
            for k in range(OW):
                y[t, oh, k] = wide[oh * Wq + k] * scale if average else wide[oh * Wq + k]


def pool(x, kernel, stride, padding, average, out):
    nd = len(kernel)
    st, pd = as_tuple(stride or kernel, nd), as_tuple(padding, nd)
    if nd == 3 or not all_f32(x):
        return _pool_numpy(x, kernel=kernel, stride=st, padding=pd, average=average, out=out)
    planar = (lambda a, unit: (unit,) + tuple(a)) if nd == 1 else (lambda a, unit: tuple(a))
    (kh, kw), (sh, sw), (ph, pw) = planar(kernel, 1), planar(st, 1), planar(pd, 0)
    x4 = dense(x).reshape(x.shape[:2] + (1,) * (2 - nd) + x.shape[2:])
    OH, OW = ((n + 2 * p - k) // s + 1 for n, k, s, p in zip(x4.shape[2:], (kh, kw), (sh, sw), (ph, pw)))
    y = out_f32(out, x.shape[:2] + ((OW,) if nd == 1 else (OH, OW)))
    planes = phases(x4, (sh, sw), (ph, pw), 0 if average else -np.inf)
    N, C = x4.shape[:2]
    _pool(planes.reshape(N * C, planes.shape[2], -1), kh, kw, sh, sw, planes.shape[4], average, y.reshape(N * C, OH, OW))
    return y


@float_kernel
def _pool_numpy(x, kernel, stride, padding, average):
    w = windows(padded(x, [(p, p) for p in padding], 0.0 if average else -np.inf), kernel, stride, (1,) * len(kernel))
    return (np.mean if average else np.max)(w, axis=tuple(range(-len(kernel), 0)))


@jet("max_pool", CPU, [(F,)])
def max_pool(x, out=None, **attrs): return pool(x, average=False, out=out, **attrs)


@jet("avg_pool", CPU, [(F,)])
def avg_pool(x, out=None, **attrs): return pool(x, average=True, out=out, **attrs)


def resample(x, axis, n_out, mode, align_corners):
    n_in = x.shape[axis]
    dst = np.arange(n_out, dtype=np.float32)
    scale = np.float32(source_scale(n_in, n_out, align_corners))
    if mode == "nearest":
        return np.take(x, np.minimum(np.floor(dst * scale), n_in - 1).astype(np.int64), axis=axis)
    src = dst * scale if align_corners else np.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
    lower = np.floor(src)
    frac = (src - lower).reshape((n_out,) + (1,) * (-1 - axis))
    i0 = lower.astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return np.take(x, i0, axis=axis) * (1 - frac) + np.take(x, i1, axis=axis) * frac


@jet("interpolate", CPU, [(F,)])
@float_kernel
def interpolate(x, size, mode, align_corners):
    for i, n_out in enumerate(size):
        x = resample(x, i - len(size), n_out, mode, align_corners)
    return x
