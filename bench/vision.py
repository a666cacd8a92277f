"""Detection speed on CPU, same machine, same run: YOLO11n and YOLOv8n (ultralytics' exports that `make setup`'s
exporters make, random weights) at 640x640 on scikit-image's astronaut photo, ours end to end (decode the PNG,
letterbox, the model, box decoding and NMS: `model.detect(path)`) against onnxruntime running the model alone
on an already letterboxed input (what the issue's target compares with: ours whole <= its model only).

Each engine runs in its own process with --threads threads; the figure is the best of 5 timed calls after two
warm-ups; the engines alternate over --rounds rounds, in reverse order every other round, and each reports its
median. Run: python bench/vision.py [--threads 2] [--rounds 3]; JSON goes to bench/out/vision.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from workers import median_of, run_worker

OUT = Path(__file__).parent / "out"
MODELS = ("yolo11n.onnx", "yolov8n.onnx")
ENGINES = ("ours end to end", "onnxruntime model only")


def exports() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.vision_exports import vision_exports
    return vision_exports()


def best_of(call, passes: int = 5) -> float:
    call(), call()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def worker(engine: str, threads: int) -> dict:
    made = exports()
    photo = made["predictions"]["paths"][0]
    result = {}
    for name in MODELS:
        path = made["models"][name]["path"]
        if engine == "onnxruntime model only":
            import onnxruntime as ort

            from soma_runtime.image.io import load_image
            from soma_runtime.image.preprocess import letterbox
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            boxed = letterbox(load_image(photo).pixels, (640, 640)).pixels
            feed = {session.get_inputs()[0].name: (boxed.transpose(2, 0, 1)[None] / np.float32(255)).astype(np.float32)}
            result[f"{name}_ms"] = best_of(lambda s=session, f=feed: s.run(None, f)) * 1e3
        else:
            from soma_runtime.tasks import Runtime
            model = Runtime("cpu", threads=threads).load(path, progress=False)
            result[f"{name}_ms"] = best_of(lambda m=model: m.detect(photo)) * 1e3
            result[f"{name}_detections"] = float(len(model.detect(photo)))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", choices=ENGINES)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    exports()                                             # made once, before any timing
    rounds = {engine: [] for engine in ENGINES}
    for r in range(args.rounds):
        for engine in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
            rounds[engine].append(run_worker(__file__, engine, threads=args.threads, timeout=1800))
    results = {engine: median_of(r) for engine, r in rounds.items()}
    print(f"astronaut photo at 640x640, threads={args.threads}, median of {args.rounds} alternating rounds")
    ours, theirs = results["ours end to end"], results["onnxruntime model only"]
    for name in MODELS:
        if "error" in ours or "error" in theirs:
            print("error:", (ours.get("error") or theirs.get("error")).strip().splitlines()[-1])
            break
        print(f"{name:14s} ours end to end {ours[f'{name}_ms']:8.1f} ms ({ours[f'{name}_detections']:.0f} boxes)   "
              f"onnxruntime model only {theirs[f'{name}_ms']:8.1f} ms   {theirs[f'{name}_ms'] / ours[f'{name}_ms']:.2f}x")
    OUT.mkdir(exist_ok=True)
    path = OUT / "vision.json"
    path.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
