"""ONNX models on an NVIDIA GPU: ours (the exported file, loaded and run on cuda) vs torch eager running the
source model on the same GPU, same process, same inputs.

Models (random weights; speed does not depend on them): torchvision's resnet18 and mobilenet_v2 at 224x224,
and a BERT shaped as all-MiniLM-L6-v2 (transformers, eager attention, as exported for ONNX) at 128 tokens, each
at batch 1 and 32. Each is exported here with torch.onnx.export (TorchScript exporter, dynamic axes) under
bench/out/cuda, then checked: ours against onnxruntime (CPU) on the same file and input, and against torch (the
largest difference over the output's largest value is printed). Timed
as a user calls each: numpy in, numpy out (the copies to and from the GPU included for both); each figure is
the best of --passes passes after a warm-up, the engines alternating over --rounds rounds (median reported).
torch runs as a user gets it by default: f32, cuDNN's convolutions allowed tf32, matmuls in full f32, BERT
through scaled_dot_product_attention; ours computes f32 products as tf32x3 (f32 accuracy).
Needs torch with CUDA, torchvision, transformers and onnxruntime. Run: python bench/onnx_cuda.py [--rounds 3];
JSON goes to bench/out/onnx-cuda.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "out"
BATCHES = (1, 32)
TOKENS = 128


def vision(name: str):
    import torch
    import torchvision
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None).eval()


def minilm():
    import torch
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512)
    torch.manual_seed(0)
    bert = BertModel._from_config(config, attn_implementation="eager", add_pooling_layer=False).eval()   # as exported

    class Hidden(torch.nn.Module):                  # the hidden states, as sentence-transformers reads them
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state
    return Hidden()


MODELS = {"resnet18": (lambda: vision("resnet18"), "image"), "mobilenet_v2": (lambda: vision("mobilenet_v2"), "image"),
          "minilm": (minilm, "text")}


def inputs_of(kind: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    if kind == "image":
        return {"x": rng.standard_normal((batch, 3, 224, 224), np.float32)}
    mask = np.ones((batch, TOKENS), np.int64)
    mask[batch // 2:, TOKENS * 3 // 4:] = 0             # half the rows padded, as a batch of sentences is
    return {"input_ids": rng.integers(1000, 30000, (batch, TOKENS)), "attention_mask": mask,
            "token_type_ids": np.zeros((batch, TOKENS), np.int64)}


def export(name: str, module, kind: str) -> Path:
    import torch
    path = OUT / "cuda" / f"{name}.onnx"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    example = inputs_of(kind, 2)
    names = list(example)
    axes = {k: {0: "batch"} for k in names + ["out"]}
    if kind == "text":
        axes = {k: {0: "batch", 1: "sequence"} for k in names + ["out"]}
    torch.onnx.export(module, tuple(torch.from_numpy(v) for v in example.values()), str(path), input_names=names,
                      output_names=["out"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return path


def engines(name: str) -> tuple[dict, object, str]:
    """(engine name -> run(feed) -> numpy output, onnxruntime's run of the file, kind)."""
    import onnxruntime as ort
    import torch

    from soma_runtime.backends import get
    from soma_runtime.engine.graph import graph_runner
    from soma_runtime.loaders.onnx import load_onnx
    build, kind = MODELS[name]
    path = export(name, build(), kind)
    module = build().cuda()                   # a fresh one: tracing for the export leaves transformers' models altered
    runner = graph_runner(load_onnx(str(path)).graph, get("cuda"))

    def torch_run(feed):
        with torch.inference_mode():
            return module(*(torch.from_numpy(v).cuda() for v in feed.values())).float().cpu().numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return {"ours": lambda feed: runner.run(feed)["out"], "torch eager": torch_run}, \
        (lambda feed: session.run(None, feed)[0]), kind


def best_of(run, feed, passes: int) -> float:
    run(feed)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        run(feed)
        best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    import torch
    card = torch.cuda.get_device_name()
    results = {}
    for name in args.models.split(","):
        runs, onnxruntime, kind = engines(name)
        for batch in BATCHES:
            feed = inputs_of(kind, batch)
            ours, theirs, reference = runs["ours"](feed), runs["torch eager"](feed), onnxruntime(feed)
            error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            error_ort = float(np.abs(ours - reference).max() / np.abs(reference).max())
            times = {engine: [] for engine in runs}
            for r in range(args.rounds):
                for engine in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                    times[engine].append(best_of(runs[engine], feed, args.passes) * 1e3)
            ms = {engine: float(np.median(t)) for engine, t in times.items()}
            results[f"{name}_batch_{batch}"] = {"ms": ms, "rounds_ms": times, "error_vs_torch": error,
                                                "error_vs_onnxruntime": error_ort,
                                                "ours_vs_torch": ms["torch eager"] / ms["ours"]}
            print(f"{name:14s} batch {batch:3d}: ours {ms['ours']:8.3f} ms, torch eager {ms['torch eager']:8.3f} ms, "
                  f"{ms['torch eager'] / ms['ours']:.2f}x (error vs onnxruntime {error_ort:.1e}, vs torch {error:.1e})",
                  flush=True)
    OUT.mkdir(exist_ok=True)
    path = OUT / "onnx-cuda.json"
    path.write_text(json.dumps({"card": card, "rounds": args.rounds, "passes": args.passes, "tokens": TOKENS,
                                "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
