"""Op benchmark: cpu jets vs reference atoms vs PyTorch (same run), on the shapes of a 1B model.

Prints one table (ms per call, ratios, and for matmuls the weight-read GB/s against this machine's
measured matrix-vector read bandwidth) and writes bench/out/ops.json.
Run: python bench/ops.py [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def timed(fn, min_time=0.3, max_reps=200) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth_gbs(torch) -> float:
    """Matrix-vector read bandwidth with torch's f32 GEMV over 256 MiB: the decode-time limit."""
    w = torch.randn(8192, 8192)
    x = torch.randn(8192)
    return w.numel() * 4 / timed(lambda: torch.mv(w, x), min_time=1.0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="fewer formats, for a smoke run")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))

    import torch
    import torch.nn.functional as F

    from soma_runtime.backends import run_op
    from soma_runtime.dtypes import QUANTIZED, QTensor, dtype
    from soma_runtime.quant import dequantize, quantize
    from soma_runtime.quant.encode import ENCODERS
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bw = bandwidth_gbs(torch)
    hidden, ffn = 2048, 8192
    rows = []

    def bench(name, ours, peer, atoms=None, weight_bytes=None):
        t_ours, t_peer = timed(ours), timed(peer)
        t_atoms = timed(atoms, min_time=0.1, max_reps=3) if atoms else None
        row = {"op": name, "cpu_ms": t_ours * 1e3, "torch_ms": t_peer * 1e3,
               "atoms_ms": None if t_atoms is None else t_atoms * 1e3, "cpu_vs_torch": t_peer / t_ours}
        if weight_bytes:
            row["weight_GBps"] = weight_bytes / t_ours / 1e9
            row["of_bandwidth"] = row["weight_GBps"] / bw
        rows.append(row)
        atoms_txt = f"{row['atoms_ms']:10.2f}" if t_atoms else f"{'—':>10s}"
        gbs = f"{row['weight_GBps']:6.1f} GB/s ({row['of_bandwidth']:4.0%})" if weight_bytes else ""
        print(f"{name:34s} {row['cpu_ms']:9.3f} {row['torch_ms']:9.3f} {atoms_txt} {row['cpu_vs_torch']:7.2f}x  {gbs}",
              flush=True)

    print(f"threads={args.threads}  measured matrix-vector read bandwidth: {bw:.1f} GB/s")
    print(f"{'op':34s} {'cpu ms':>9s} {'torch ms':>9s} {'atoms ms':>10s} {'torch/cpu':>8s}  weight read")
    x1 = rng.standard_normal((1, hidden)).astype(np.float32)
    x128 = rng.standard_normal((128, hidden)).astype(np.float32)
    w = (rng.standard_normal((ffn, hidden)) * 0.02).astype(np.float32)
    tw, tx1, tx128 = torch.from_numpy(w), torch.from_numpy(x1), torch.from_numpy(x128)
    small_w = w[:hidden]
    bench(f"matmul f32 gemv 1x{hidden}x{ffn}", lambda: run_op("matmul", x1, w, transpose_b=True),
          lambda: F.linear(tx1, tw), lambda: run_op("matmul", x1, small_w, transpose_b=True, backend="reference"), w.nbytes)
    bench(f"matmul f32 gemm 128x{hidden}x{ffn}", lambda: run_op("matmul", x128, w, transpose_b=True), lambda: F.linear(tx128, tw))
    formats = ("q8_0", "q4_0") if args.quick else QUANTIZED + ("f16", "bf16")
    for name in formats:
        d = dtype(name)
        if d.quantized:
            # formats we only decode get random packed blocks: speed does not depend on the values
            wq = quantize(w, name) if name in ENCODERS else QTensor(
                rng.integers(0, 256, size=ffn * d.row_bytes(hidden), dtype=np.uint8), name, (ffn, hidden))
            nbytes = wq.nbytes
        else:
            wq = w.astype(d.numpy)
            nbytes = wq.nbytes
        # the peer does the same product at f32 on the already-decoded weight
        tdeq = torch.from_numpy(dequantize(wq) if d.quantized else wq.astype(np.float32))
        bench(f"matmul {name} gemv 1x{hidden}x{ffn}", lambda wq=wq: run_op("matmul", x1, wq, transpose_b=True),
              lambda t=tdeq: F.linear(tx1, t), weight_bytes=nbytes)
        bench(f"matmul {name} gemm 128x{hidden}x{ffn}", lambda wq=wq: run_op("matmul", x128, wq, transpose_b=True),
              lambda t=tdeq: F.linear(tx128, t))
    xn = rng.standard_normal((128, hidden)).astype(np.float32)
    g = rng.standard_normal(hidden).astype(np.float32)
    txn, tg = torch.from_numpy(xn), torch.from_numpy(g)
    bench(f"rmsnorm 128x{hidden}", lambda: run_op("rmsnorm", xn, g), lambda: F.rms_norm(txn, (hidden,), tg, 1e-6),
          lambda: run_op("rmsnorm", xn, g, backend="reference"))
    scores = rng.standard_normal((32, 128, 128)).astype(np.float32)
    ts = torch.from_numpy(scores)
    bench("softmax causal 32x128x128", lambda: run_op("softmax", scores, causal=True),
          lambda: torch.softmax(ts + torch.full((128, 128), float("-inf")).triu(1), -1),
          lambda: run_op("softmax", scores, causal=True, backend="reference"))
    q = rng.standard_normal((1, 32, 128, 64)).astype(np.float32)
    kv = rng.standard_normal((1, 8, 128, 64)).astype(np.float32)
    tq, tkv = torch.from_numpy(q), torch.from_numpy(kv)
    bench("sdpa prefill 32q/8kv heads x128", lambda: run_op("sdpa", q, kv, kv, causal=True),
          lambda: F.scaled_dot_product_attention(tq, tkv, tkv, is_causal=True, enable_gqa=True),
          lambda: run_op("sdpa", q, kv, kv, causal=True, backend="reference"))
    qd = q[:, :, -1:]
    kv_long = rng.standard_normal((1, 8, 1024, 64)).astype(np.float32)
    tqd, tkl = torch.from_numpy(qd), torch.from_numpy(kv_long)
    bench("sdpa decode 1 token vs 1024", lambda: run_op("sdpa", qd, kv_long, kv_long, causal=True),
          lambda: F.scaled_dot_product_attention(tqd, tkl, tkl, enable_gqa=True))

    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ops.json").write_text(json.dumps({"threads": args.threads, "bandwidth_GBps": bw, "rows": rows}, indent=2))
    print(f"wrote {out / 'ops.json'}")


if __name__ == "__main__":
    main()
