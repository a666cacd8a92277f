"""On-device token choice, the `sample` op: each part of a row's vocabulary gives its `width` largest
logits, groups of parts merge theirs in rounds until few are left, one program per row takes the
last, and temperature, top-k, top-p, min-p and the draw with the row's uniform run over those
candidates alone. One id per row crosses to the host, never the logits. The `topk` op's rows are
reduced to their k largest the same way."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from soma_runtime.backends.cuda.chain import after_prior, chained
from soma_runtime.backends.cuda.device import INTERPRET, device_jet
from soma_runtime.ir.jets import jet

# (vocabulary columns a part, its warps; parts a merge takes, its warps; candidates the last program
# takes, its warps). A sort is a chain of dependent steps: many one-warp parts merged in rounds beat a
# few wide ones (bench/results/design-notes.md). The interpreter sorts slowly.
TILES = {"one row": (256, 1, 16, 4, 512, 4), "rows": (2048, 2, 16, 4, 4096, 8), "interpreted": (256, 4, 2, 4, 128, 4)}


@triton.jit
def _keys(x, cols, n):
    """(value, column) as int64 keys that sort by value, then by the lower column: the float's order
    in the high word, the column's complement in the low. Columns past n hold -inf."""
    bits = tl.where(cols < n, x, -float("inf")).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _unkey(keys):
    ordered = (keys >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - (keys & 0xFFFFFFFF).to(tl.int32)


@chained
@triton.jit
def _candidates_kernel(x_ptr, params_ptr, keys_ptr, n, PART: tl.constexpr, W: tl.constexpr):
    """Part p of row r: its W best logits as keys (`_best`)."""
    after_prior()
    r, p, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    cols = p * PART + tl.arange(0, PART)
    x = tl.load(x_ptr + r.to(tl.int64) * n + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
    tl.store(keys_ptr + (r * parts + p) * W + tl.arange(0, W), _best(_keys(x, cols, n), params_ptr, r, W))


@chained
@triton.jit
def _merge_kernel(keys_ptr, params_ptr, out_ptr, G: tl.constexpr, W: tl.constexpr):
    """Group g of row r's candidates: G parts' W keys each -> their W largest."""
    after_prior()
    r, g, groups = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    keys = tl.load(keys_ptr + (r * groups + g) * G * W + tl.arange(0, G * W))
    tl.store(out_ptr + (r * groups + g) * W + tl.arange(0, W), _best(keys, params_ptr, r, W))


@triton.jit
def _best(keys, params_ptr, r, W: tl.constexpr):
    """The W largest keys, or W copies of the largest for a greedy row (it needs only that)."""
    if tl.load(params_ptr + r * 5) == 0:
        return tl.zeros([W], tl.int64) + tl.max(keys, 0)
    return tl.topk(keys, W)


@chained
@triton.jit
def _choose_kernel(keys_ptr, params_ptr, out_ptr, n, width, CANDIDATES: tl.constexpr, W: tl.constexpr):
    """Row r's token from its parts' candidates, as the op's atoms define it (see ops.sample)."""
    after_prior()
    r = tl.program_id(0)
    keys = tl.load(keys_ptr + r * CANDIDATES + tl.arange(0, CANDIDATES))
    t = tl.load(params_ptr + r * 5)
    if t == 0:
        choice = _unkey(tl.max(keys, 0))[1]
    else:
        v, ids = _unkey(tl.topk(keys, W))
        k, top_p = tl.load(params_ptr + r * 5 + 1), tl.load(params_ptr + r * 5 + 2)
        min_p, u = tl.load(params_ptr + r * 5 + 3), tl.load(params_ptr + r * 5 + 4)
        k = tl.where((k >= 1) & (k <= width), k, width).to(tl.int32)
        kth = tl.max(tl.where(tl.arange(0, W) == k - 1, v, -float("inf")), 0)
        live = (v >= kth) & (ids < n)
        x = v / t
        e = tl.where(live, tl.exp(x - tl.max(x, 0)), 0.0)
        prob = e / tl.sum(e, 0)
        before = tl.cumsum(prob, 0) - prob
        keep = live & (before < tl.where(top_p >= 1.0, float("inf"), top_p)) & (e >= min_p)
        w = tl.where(keep, e, 0.0)
        cdf = tl.sum(tl.where(ids[:, None] <= ids[None, :], w[:, None], 0.0), 0)      # cdf[j]: weight of ids <= ids[j]
        choice = tl.min(tl.where(keep & (cdf / tl.sum(w, 0) > u), ids, n), 0)
    tl.store(out_ptr + r, choice.to(tl.int64))


@jet("sample", "cuda", [(("f32", "f16", "bf16"), "f32")])
@device_jet
def sample(logits, params, width=64):
    rows, n = logits.shape
    out, params = torch.empty(rows, dtype=torch.int64, device=logits.device), params.contiguous()
    if rows:
        W = triton.next_power_of_2(width)
        tiles = TILES["interpreted" if INTERPRET else "one row" if rows == 1 else "rows"]
        part, part_warps, group, merge_warps, last, last_warps = tiles
        part = max(W, min(part, triton.next_power_of_2(n)))
        parts = triton.next_power_of_2(triton.cdiv(n, part))        # powers of two: merges and the last program sort them all
        keys = torch.empty((rows, parts * W), dtype=torch.int64, device=logits.device)
        _candidates_kernel[(rows, parts)](logits.contiguous(), params, keys, n, PART=part, W=W, num_warps=part_warps)
        while parts * W > max(last, W):
            G = min(group, parts)
            parts //= G
            merged = torch.empty((rows, parts * W), dtype=torch.int64, device=logits.device)
            _merge_kernel[(rows, parts)](keys, params, merged, G=G, W=W, num_warps=merge_warps)
            keys = merged
        _choose_kernel[(rows,)](keys, params, out, n, width, CANDIDATES=parts * W, W=W, num_warps=last_warps)
    return out


TOPK_PART, TOPK_GROUP = 1024, 16            # columns a first-round program takes; parts a merge takes


@triton.jit
def _topk_keys(x, cols, n):
    """`_keys` in the CPU jet's order: -0.0 ties with 0.0, NaN below -inf, columns past n below all."""
    x = tl.where(x == 0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(x != x, -2147483648, bits ^ ((bits >> 31) & 0x7FFFFFFF))     # noqa: PLR0124  (NaN)
    keys = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    return tl.where(cols < n, keys, -9223372036854775807 - 1)


@triton.jit
def _topk_store(keys, keys_ptr, x_ptr, values_ptr, index_ptr, r, n, at, k, FINAL: tl.constexpr, W: tl.constexpr):
    """A part's W best keys at `at`; once FINAL, row r's k best values (read back from x, as they are) and
    columns."""
    slot = tl.arange(0, W)
    if FINAL:
        column = (0x7FFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int64)
        value = tl.load(x_ptr + r * n + column, mask=slot < k)
        tl.store(values_ptr + r * k + slot, value, mask=slot < k)
        tl.store(index_ptr + r * k + slot, column, mask=slot < k)
    else:
        tl.store(keys_ptr + at + slot, keys)


@chained
@triton.jit
def _topk_parts_kernel(x_ptr, keys_ptr, values_ptr, index_ptr, n, k, FINAL: tl.constexpr, PART: tl.constexpr,
                       W: tl.constexpr):
    """Part p of row r of x [rows, n]: its W largest values as keys (the lower column first among equals)."""
    after_prior()
    r, p, parts = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
    cols = p * PART + tl.arange(0, PART)
    x = tl.load(x_ptr + r * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    _topk_store(tl.topk(_topk_keys(x, cols, n), W), keys_ptr, x_ptr, values_ptr, index_ptr, r, n, (r * parts + p) * W,
                k, FINAL, W)


@chained
@triton.jit
def _topk_merge_kernel(keys_ptr, out_ptr, x_ptr, values_ptr, index_ptr, n, k, FINAL: tl.constexpr, G: tl.constexpr,
                       W: tl.constexpr):
    """Group g of row r's parts: G parts' W keys each -> their W largest."""
    after_prior()
    r, g, groups = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
    keys = tl.load(keys_ptr + (r * groups + g) * G * W + tl.arange(0, G * W))
    _topk_store(tl.topk(keys, W), out_ptr, x_ptr, values_ptr, index_ptr, r, n, (r * groups + g) * W, k, FINAL, W)


@jet("topk", "cuda", [(("f32", "f16", "bf16"),)])
@device_jet
def topk(x, k=1, axis=-1):
    """The k largest along `axis`, largest first, the lower index first among equals (as the CPU jet)."""
    rows_view = x.movedim(axis, -1)
    n = rows_view.shape[-1]
    rows = rows_view.contiguous().reshape(-1, n)
    values = torch.empty((rows.shape[0], k), dtype=x.dtype, device=x.device)
    index = torch.empty((rows.shape[0], k), dtype=torch.int64, device=x.device)
    if values.numel():
        W = triton.next_power_of_2(k)
        part = max(W, min(TOPK_PART, triton.next_power_of_2(n)))
        parts = triton.next_power_of_2(triton.cdiv(n, part))
        keys = torch.empty((rows.shape[0], parts * W), dtype=torch.int64, device=x.device)
        _topk_parts_kernel[(rows.shape[0], parts)](rows, keys, values, index, n, k, FINAL=parts == 1, PART=part, W=W)
        while parts > 1:
            G = min(TOPK_GROUP, parts)
            parts //= G
            merged = torch.empty((rows.shape[0], parts * W), dtype=torch.int64, device=x.device)
            _topk_merge_kernel[(rows.shape[0], parts)](keys, merged, rows, values, index, n, k, FINAL=parts == 1, G=G, W=W)
            keys = merged
    shape = rows_view.shape[:-1] + (k,)
    return values.reshape(shape).movedim(-1, axis), index.reshape(shape).movedim(-1, axis)
