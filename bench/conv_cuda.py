"""Convolution kernels on an NVIDIA GPU, layer by layer: ours (backends/cuda/conv.py's implicit GEMM at each of
a few tile shapes, and at the shapes conv_tiles picks) against torch's conv2d (cuDNN; tf32 allowed, as torch's
default, and in full f32), on the convolutions of resnet18 and mobilenet_v2 at batch 1 and 32. Microseconds per
call (triton.testing.do_bench, median). The tile rule in conv_tiles is read off this table.
Run: python bench/conv_cuda.py; JSON goes to bench/out/conv-cuda.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from soma_runtime.backends.cuda import conv as cuda_conv

OUT = Path(__file__).parent / "out"
# (C, H, O, kernel, stride, padding, groups)
LAYERS = {
    "resnet18": [(3, 224, 64, 7, 2, 3, 1), (64, 56, 64, 3, 1, 1, 1), (64, 56, 128, 3, 2, 1, 1), (64, 56, 128, 1, 2, 0, 1),
                 (128, 28, 128, 3, 1, 1, 1), (128, 28, 256, 3, 2, 1, 1), (256, 14, 256, 3, 1, 1, 1),
                 (256, 14, 512, 3, 2, 1, 1), (512, 7, 512, 3, 1, 1, 1)],
    "mobilenet_v2": [(3, 224, 32, 3, 2, 1, 1), (32, 112, 16, 1, 1, 0, 1), (16, 112, 96, 1, 1, 0, 1),
                     (144, 56, 24, 1, 1, 0, 1), (192, 28, 64, 1, 1, 0, 1), (384, 14, 96, 1, 1, 0, 1),
                     (960, 7, 320, 1, 1, 0, 1), (320, 7, 1280, 1, 1, 0, 1), (144, 56, 144, 3, 1, 1, 144),
                     (960, 7, 960, 3, 1, 1, 960)],
}
TILES = [(64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 64, 4, 3), (32, 64, 32, 4, 3),
         (64, 32, 32, 4, 3), (32, 32, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 16, 4, 4), (16, 64, 32, 4, 3)]


def ours_at(x, w, stride, padding, tiles):
    """The implicit GEMM at the given (BM, BN, BK, warps, stages)."""
    N, C, H, W = x.shape
    O, _, KH, KW = w.shape
    OH, OW = (H + 2 * padding - KH) // stride + 1, (W + 2 * padding - KW) // stride + 1
    out = torch.empty((N, O, OH, OW), device=x.device)
    BM, BN, BK, warps, stages = tiles
    cols, ktot = N * OH * OW, C * KH * KW
    grid = (triton.cdiv(O, BM), triton.cdiv(cols, BN), 1)
    return lambda: cuda_conv._conv_kernel[grid](x, w, out, out, out, C, H, W, O, OH, OW, C, O, KH, KW, stride, stride,
                                                padding, padding, 1, 1, cols, ktot, HAS_BIAS=False, HAS_RES=False,
                                                EPILOGUE=0, F32=True, BM=BM, BN=BN, BK=BK, num_warps=warps,
                                                num_stages=stages)


def main():
    results = {}
    for model, layers in LAYERS.items():
        for batch in (1, 32):
            for C, H, O, k, s, p, g in layers:
                x = torch.randn(batch, C, H, H, device="cuda")
                w = torch.randn(O, C // g, k, k, device="cuda")
                torch_conv = lambda x=x, w=w, s=s, p=p, g=g: torch.nn.functional.conv2d(x, w, None, s, p, 1, g)
                rule = lambda x=x, w=w, s=s, p=p, g=g: cuda_conv.conv.__wrapped__(x, w, None, None, s, p, 1, g)
                row = {}
                for tf32 in (True, False):
                    torch.backends.cudnn.allow_tf32 = tf32
                    row["torch tf32" if tf32 else "torch f32"] = do_bench(torch_conv) * 1e3
                row["ours (rule)"] = do_bench(rule) * 1e3
                if g == 1:
                    for tiles in TILES:
                        row[str(tiles)] = do_bench(ours_at(x, w, s, p, tiles)) * 1e3
                key = f"{model} b{batch} C{C} H{H} O{O} k{k} s{s} g{g}"
                results[key] = row
                best = min((v, t) for t, v in row.items() if t.startswith("(")) if g == 1 else (None, None)
                print(f"{key:42s} torch tf32 {row['torch tf32']:8.1f}  f32 {row['torch f32']:8.1f}  ours rule "
                      f"{row['ours (rule)']:8.1f}  best {best[0] or 0:8.1f} {best[1]}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "conv-cuda.json").write_text(json.dumps({"card": torch.cuda.get_device_name(), "us": results}, indent=1))


if __name__ == "__main__":
    main()
