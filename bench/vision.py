"""Vision speed on CPU, same machine, same run.

detect: YOLO11n and YOLOv8n (ultralytics' exports that `make setup`'s exporters make, random weights) at 640x640 on
scikit-image's astronaut photo, ours end to end (decode the PNG, letterbox, the model, box decoding and NMS:
`model.detect(path)`) against onnxruntime running the model alone on an already letterboxed input (what the issue's
target compares with: ours whole <= its model only).
vit: ViT-B/16 image embedding at 224x224 (transformers' ViTModel config, random weights, saved once under
bench/out/vit-b16), batches of 1 and 8 of the astronaut photo, end to end both: ours `model.embed_image(pixels)`
against transformers' ViTImageProcessorPil + ViTModel's last_hidden_state[:, 0] under torch.no_grad.

Each engine runs in its own process with --threads threads; the figure is the best of 5 timed calls after two
warm-ups; the engines alternate over --rounds rounds, in reverse order every other round, and each reports its
median. Run: python bench/vision.py [--threads 2] [--rounds 3] [--parts detect,vit]; JSON goes to
bench/out/vision.json.
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
VIT_ENGINES = ("ours vit", "transformers vit")
VIT_DIR = OUT / "vit-b16"
VIT_BATCHES = (1, 8)


def vit_b16() -> Path:
    """ViT-B/16 (transformers' ViTConfig defaults) with random weights and its processor, saved once."""
    if not (VIT_DIR / "preprocessor_config.json").exists():
        import torch
        import transformers
        torch.manual_seed(0)
        transformers.ViTModel(transformers.ViTConfig(), add_pooling_layer=False).eval().save_pretrained(VIT_DIR)
        transformers.ViTImageProcessorPil().save_pretrained(VIT_DIR)
    return VIT_DIR


def vit_worker(engine: str, threads: int) -> dict:
    import skimage.data
    photo = skimage.data.astronaut()
    result = {}
    if engine == "transformers vit":
        import torch
        import transformers
        torch.set_num_threads(threads)
        processor = transformers.ViTImageProcessorPil.from_pretrained(VIT_DIR)
        model = transformers.ViTModel.from_pretrained(VIT_DIR, add_pooling_layer=False).eval()

        def embed(images):
            with torch.no_grad():
                inputs = processor(images=images, return_tensors="pt")["pixel_values"]
                return model(pixel_values=inputs).last_hidden_state[:, 0].numpy()
    else:
        from soma_runtime.tasks import Runtime
        embed = Runtime("cpu", threads=threads).load(str(VIT_DIR), progress=False, activations="f32").embed_image
    for batch in VIT_BATCHES:
        result[f"vit_b{batch}_ms"] = best_of(lambda b=batch: embed([photo] * b)) * 1e3
    return result


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
    if engine in VIT_ENGINES:
        return vit_worker(engine, threads)
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
    ap.add_argument("--parts", default="detect,vit", help="comma-separated: detect, vit")
    ap.add_argument("--worker", choices=ENGINES + VIT_ENGINES)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    parts = set(args.parts.split(","))
    engines = (ENGINES if "detect" in parts else ()) + (VIT_ENGINES if "vit" in parts else ())
    if "detect" in parts:
        exports()                                         # made once, before any timing
    if "vit" in parts:
        vit_b16()
    rounds = {engine: [] for engine in engines}
    for r in range(args.rounds):
        for engine in (engines if r % 2 == 0 else engines[::-1]):
            rounds[engine].append(run_worker(__file__, engine, threads=args.threads, timeout=1800))
    results = {engine: median_of(r) for engine, r in rounds.items()}
    print(f"astronaut photo, threads={args.threads}, median of {args.rounds} alternating rounds")
    if "detect" in parts:
        report(results, ENGINES, [(f"{name}_ms", name, f"{name}_detections") for name in MODELS], "at 640x640")
    if "vit" in parts:
        report(results, VIT_ENGINES, [(f"vit_b{b}_ms", f"ViT-B/16 b{b}", None) for b in VIT_BATCHES], "embed_image")
    OUT.mkdir(exist_ok=True)
    path = OUT / "vision.json"
    path.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {path}")


def report(results: dict, engines: tuple[str, str], rows: list, what: str) -> None:
    """A line per row: ours, theirs (ms) and theirs / ours."""
    ours, theirs = (results[e] for e in engines)
    if "error" in ours or "error" in theirs:
        print("error:", (ours.get("error") or theirs.get("error")).strip().splitlines()[-1])
        return
    for key, name, count in rows:
        extra = f" ({ours[count]:.0f} boxes)" if count else ""
        print(f"{name:16s} {what}  {engines[0]} {ours[key]:8.1f} ms{extra}   {engines[1]} {theirs[key]:8.1f} ms   "
              f"{theirs[key] / ours[key]:.2f}x")


if __name__ == "__main__":
    main()
