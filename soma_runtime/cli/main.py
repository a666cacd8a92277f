"""`soma-runtime` entry point: one subcommand per job, logs to stderr, results to stdout."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys

import numpy as np

from soma_runtime import __version__
from soma_runtime.cli import context, detect, retrieval, speech, vision
from soma_runtime.errors import RequestError, SomaError


def cmd_backends(args) -> int:
    from soma_runtime.backends import detect_all
    report = detect_all()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, info in report.items():
        state = "available" if info.get("available") else "unavailable"
        details = ", ".join(f"{k}={' '.join(v) if isinstance(v, list) else v}" for k, v in info.items() if k != "available")
        print(f"{name:10s} {state:12s} {details}")
    return 0


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (a timeout of -1 s or a budget of NaN GiB is an error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def add_budget_args(parser) -> None:
    """What one graph run may compute (ir.plan.RunBudget); past it, a clear error before anything is allocated."""
    parser.add_argument("--max-tensor-bytes", type=positive_int, default=None,
                        help="most bytes of any one tensor a graph run computes (default: 1 GiB)")
    parser.add_argument("--max-output-bytes", type=positive_int, default=None,
                        help="most bytes of a graph run's outputs together (default: 1 GiB)")


def run_budget(args):
    """The RunBudget the --max-*-bytes flags give (the default where none is)."""
    from soma_runtime.engine.graph import DEFAULT_BUDGET
    given = {"tensor_bytes": args.max_tensor_bytes, "output_bytes": args.max_output_bytes}
    return dataclasses.replace(DEFAULT_BUDGET, **{name: value for name, value in given.items() if value is not None})


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a context of 0 or -5 tokens is an error, not a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def sha256_arg(text: str) -> str:
    from soma_runtime.loaders.integrity import HEX_DIGEST
    if not HEX_DIGEST.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a sha256 is 64 hexadecimal digits, got {text!r}")
    return text.lower()


def add_model_args(p, default_model=True):
    p.add_argument("--model", "-m", default=None if default_model else argparse.SUPPRESS,
                   help="a .gguf file, a HF or soma model directory, or a name (default: the bundled SmolLM2)")
    p.add_argument("--ctx", type=positive_int, default=None, help="context length in tokens (default: min(4096, the model's))")
    add_sha256_arg(p)
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: the physical cores)")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "reference"),
                   help="where to compute (default: cuda when a GPU is present, else cpu)")
    p.add_argument("--activations", default=None, choices=("f32", "bf16", "q8"),
                   help="precision of matmul inputs (default: q8 for GGUF as llama.cpp, f32 for HF decoders, "
                        "bf16 for encoders on CPUs with AMX)")


def add_generation_args(p) -> None:
    p.add_argument("--kv-cache", default=None, metavar="K[/V][,edges=N]",
                   help="the KV cache's type: f32, f16, bf16, or compressed: q8_0, q4_0 (llama.cpp's blocks), tq4, tq3, "
                        "tq2 (rotated Lloyd-Max codes; tq3j/tq2j with QJL); keys and values apart as K/V (tq4/tq2), "
                        "edges=N keeps the first and last N layers f16 (default: f16 for GGUF, the checkpoint's dtype else)")
    p.add_argument("--overflow", default=None, choices=("error", "truncate", "slide"),
                   help="a prompt beyond the context: an error (default); its oldest tokens (a chat's oldest messages "
                        "after the system prompt) dropped until it takes three quarters of the context; or, for a model "
                        "trained with a sliding window on every layer, run on within the window (slide)")
    p.add_argument("--gpu-layers", type=int, default=None, metavar="N",
                   help="on a GPU, run only the model's first N layers there and the rest on the host (llama.cpp's "
                        "--n-gpu-layers; default: all on the GPU)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model's attention heads and MLP over N processes: N GPUs (NCCL) on cuda, N host "
                        "processes (gloo) on cpu; the runtime starts, supervises and stops them (default: 1, none)")
    p.add_argument("--draft", default=None, metavar="prompt-lookup|layers:N|MODEL",
                   help="speculative decoding: drafts from n-grams of the text so far, from the model's first N layers, "
                        "or from a smaller model of the same vocabulary")
    p.add_argument("--lora", action="append", type=lora_arg, default=None, metavar="PATH[:SCALE]",
                   help="a LoRA adapter (a PEFT directory or a llama.cpp GGUF LoRA file), its update times SCALE (default "
                        "1): run generates under it; serve loads each on its text models, for requests that name it "
                        "(model `base:adapter`, or `lora`)")
    p.add_argument("--max-loras", type=int, default=8, metavar="N",
                   help="adapters a model holds at once (default: 8)")


def lora_arg(text: str) -> tuple[str, float]:
    """PATH[:SCALE]: an adapter directory and the strength it is loaded at."""
    path, _, scale = text.rpartition(":")
    try:
        return (path, float(scale)) if path else (text, 1.0)
    except ValueError:
        return text, 1.0


def add_sha256_arg(p) -> None:
    p.add_argument("--sha256", type=sha256_arg, default=None,
                   help="refuse to load unless the model has this sha256 (a directory's: `soma-runtime models hash DIR`)")


def load_model(args):
    from soma_runtime.tasks import Runtime
    options = {name: getattr(args, name, None) for name in ("activations", "draft", "overflow", "gpu_layers")}
    return Runtime(getattr(args, "backend", "auto"), threads=args.threads).load(
        args.model, n_ctx=args.ctx, sha256=args.sha256, kv_dtype=getattr(args, "kv_cache", None),
        tensor_parallel=getattr(args, "tensor_parallel", 1), **options)


def read_prompt(text: str) -> str:
    return sys.stdin.read() if text == "-" else text


def cmd_run(args) -> int:
    model = load_model(args)
    if model.task == "graph" or (model.task in ("speak", "detect") and args.prompt is None):   # runs as the graph it is
        return run_graph(model, args)
    if model.task != "generate":
        raise RequestError(f"{args.model} runs the {model.task} task: `run` generates text or runs a graph; "
                           f"use `soma-runtime {OTHER_COMMANDS[model.task]}`")
    if args.prompt is None:
        raise RequestError(f"{args.model or 'the default model'} generates text: give it a --prompt")
    params = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                                            "seed", "preset")}
    if args.lora:
        if len(args.lora) > 1:
            raise RequestError("run generates under one --lora at a time")
        params["lora"] = model.load_lora(*args.lora[0], max_loras=args.max_loras)["name"]
    params.update(json_schema=read_text(args.json_schema, "--json-schema"), regex=args.regex,
                  grammar=read_text(args.grammar, "--grammar"))
    prompt = read_prompt(args.prompt)
    if args.chat or args.system:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        stream = model.chat(messages, max_tokens=args.max_tokens, stop=args.stop, **params)
    else:
        stream = model.generate(prompt, max_tokens=args.max_tokens, stop=args.stop, **params)
    for token in stream:
        sys.stdout.write(token.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    m = model.metrics()
    logging.getLogger("soma_runtime").info("prefill %.1f tok/s, decode %.1f tok/s, %d tokens, finish=%s",
                                           m["prefill_tok_s"], m["decode_tok_s"], m["generated_tokens"], m["finish_reason"])
    if m["drafted_tokens"]:
        logging.getLogger("soma_runtime").info("speculative: %.0f%% of %d draft tokens accepted, %.2f tokens a step",
                                               100 * m["acceptance_rate"], m["drafted_tokens"], m["tokens_per_step"])
    return 0


# what other tasks run by
OTHER_COMMANDS = {"encode": "embed` or `classify", "transcribe": "transcribe", "speak": "speak", "detect": "detect",
                  "encode_image": "classify --image"}


def read_text(path: str | None, flag: str) -> str | None:
    """A constraint file's text (a JSON schema, a Lark or GBNF grammar), read no further than one character
    past the longest constraint (the rest would be refused unread)."""
    from soma_runtime.engine.grammar import MAX_TEXT
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(MAX_TEXT + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"{flag} {path}: cannot read it ({e})") from None


def read_inputs(specs: list[str]) -> dict:
    """--input NAME=file.npy (one input) or --input file.npz (its arrays, by name)."""
    inputs = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        try:
            if not name:
                with np.load(path, allow_pickle=False) as archive:
                    inputs.update({key: archive[key] for key in archive.files})
            else:
                inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise RequestError(f"--input {spec}: cannot read {path!r} as .npy/.npz ({e})") from None
    return inputs


def run_graph(model, args) -> int:
    """A graph model run on --input arrays; each output written to --output-dir as NAME.npy."""
    if args.prompt is not None or not args.output_dir:
        raise RequestError(f"{args.model} is a graph with inputs {', '.join(model.inputs)}: give them with "
                           "--input NAME=file.npy (or a .npz) and an --output-dir, not a prompt")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise RequestError(f"--output-dir {args.output_dir}: not a directory")
    try:                                            # before the run: a directory that cannot be made fails at once
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        raise RequestError(f"--output-dir {args.output_dir}: cannot make the directory ({e.strerror or e})") from None
    outputs = model.run(read_inputs(args.input or []), run_budget(args))
    for name, value in outputs.items():
        path = os.path.join(args.output_dir, re.sub(r"[^\w.-]", "_", name) + ".npy")
        try:
            np.save(path, value)
        except OSError as e:
            raise RequestError(f"--output-dir {args.output_dir}: cannot write {os.path.basename(path)} "
                               f"({e.strerror or e})") from None
        print(f"{name}\t{value.dtype}{list(value.shape)}\t{path}")
    return 0


def cmd_models_info(args) -> int:
    info = load_model(args).info()
    if args.fusions:
        for rule, count in sorted(info["fusions"].items(), key=lambda item: (-item[1], item[0])):
            print(f"{rule:28s} {count}")
        return 0
    print(json.dumps(info, indent=2))
    return 0


def cmd_models_hash(args) -> int:
    from soma_runtime.loaders import model_digest, resolve
    print(model_digest(resolve(args.path)))
    return 0


def cmd_bench(args) -> int:
    from soma_runtime.cli.bench import bench_model
    result = bench_model(load_model(args), prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, runs=args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:18s} {v:.2f}" if isinstance(v, float) else f"{k:18s} {v}")
    return 0


def read_texts(args) -> list[str]:
    """--text values, else one text per line of stdin."""
    return args.text if args.text else [line.rstrip("\n") for line in sys.stdin if line.strip()]


def load_encoder(args):
    model = load_model(args)
    if model.task != "encode":
        raise RequestError(f"{args.model or 'the default model'} is not an encoder (it runs the {model.task} task); "
                           "give an encoder with --model (e.g. a sentence-transformers directory)")
    return model


def cmd_embed(args) -> int:
    model = load_encoder(args)
    vectors = model.embed(read_texts(args), batch_size=args.batch_size, truncate=not args.no_truncate)
    for v in vectors:
        print(json.dumps([round(float(x), 7) for x in v]))
    return 0


def cmd_classify(args) -> int:
    if args.image:
        return vision.cmd_classify_images(args, load_model(args))
    model = load_encoder(args)
    for text in read_texts(args):
        print(json.dumps([{"label": label, "score": round(score, 6)} for label, score in model.classify(text, args.label)]))
    return 0


def cmd_autotune(args) -> int:
    """Time the kernel variants for the model's weight shapes on this machine and cache the choices."""
    from soma_runtime.backends import get
    from soma_runtime.tasks import Runtime
    model = Runtime(threads=args.threads).load(args.model, n_ctx=args.ctx, sha256=args.sha256, autotune=False)
    measured = model.autotune()
    for key, result in measured.items():
        times = "  ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in result["seconds"].items())
        print(f"{key:44s} -> {result['choice']:5s} ({times})")
    cpu = get("cpu").detect()
    print(f"{len(measured)} shapes tuned for {cpu['autotune_key']}; table: {cpu['autotune_table']}")
    return 0


def cmd_serve(args) -> int:
    import os

    from soma_runtime.server import serve
    from soma_runtime.server.security import Policy
    if args.allow_model_management != bool(args.models_dir):
        raise RequestError("--allow-model-management and --models-dir DIR go together: loads come only from that directory")
    if args.models_dir and not os.path.isdir(args.models_dir):
        raise RequestError(f"--models-dir {args.models_dir}: not a directory")
    budget = int(args.memory_budget * 2**30) if args.memory_budget else None
    limits = {"max_body_bytes": args.max_body_bytes, "head_seconds": args.header_timeout, "body_seconds": args.body_timeout}
    hosts = tuple(h.strip() for h in ",".join(args.allowed_hosts or []).split(",") if h.strip())
    policy = Policy(api_key=args.api_key or os.environ.get("SOMA_API_KEY") or None, allowed_hosts=hosts,
                    **{name: value for name, value in limits.items() if value is not None})
    origins = tuple(o.strip() for o in ",".join(args.allowed_origins or []).split(",") if o.strip())
    serve(args.model or [], args.host, args.port, args.uds, budget, args.max_batch, args.step_tokens, args.ctx, args.threads,
          args.max_queue, args.backend, args.sha256 or [], policy, origins, args.models_dir, args.max_connections, args.draft,
          args.overflow, kv_dtype=args.kv_cache, gpu_layers=args.gpu_layers, tensor_parallel=args.tensor_parallel,
          run_budget=run_budget(args), loras=args.lora or [], max_loras=args.max_loras,
          retrieval_dirs=args.retrieval_dir or [])
    return 0


def cmd_memory(args) -> int:
    """A running server's memory: its budget, each model's share (KV cache kind, context) and the ladder's rungs taken."""
    import json
    import os
    import urllib.request
    request = urllib.request.Request(args.url.rstrip("/") + "/v1/memory")
    key = args.api_key or os.environ.get("SOMA_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            memory = json.load(response)
    except OSError as e:
        raise RequestError(f"no server answers at {args.url}: {e}") from None
    if args.json:
        print(json.dumps(memory, indent=2))
        return 0
    print(f"budget {memory['budget_bytes'] / 2**20:,.0f} MiB, models {memory['used_bytes'] / 2**20:,.0f} MiB")
    for m in memory["models"]:
        cache = (f"  kv {m['kv_cache']} ({m['kv_bytes_per_token']} B/token), context {m['context']}, "
                 f"{m['gpu_layers']} layers on the device" if "kv_cache" in m else "")
        print(f"  {m['id']:24s} {m['bytes'] / 2**20:9,.0f} MiB  priority {m['priority']}{cache}")
    taken = ", ".join(f"{step} x{n}" for step, n in memory["degradations"].items()) or "none"
    print(f"degradations: {taken}")
    return 0


def cmd_import(args) -> int:
    from soma_runtime.loaders import verify_sha256
    from soma_runtime.loaders.soma import import_hf_dir
    if args.sha256:
        verify_sha256(args.src, args.sha256)
    print(import_hf_dir(args.src, args.dst))
    return 0


def cmd_convert(args) -> int:
    from soma_runtime.convert import convert_hf_to_gguf
    print(convert_hf_to_gguf(args.src, args.out, args.type, args.merge_lora or []))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soma-runtime", description="Load any model format and run inference on any hardware.")
    p.add_argument("--version", action="version", version=f"soma-runtime {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backends", help="list the backends found on this machine and what each detected")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.set_defaults(run=cmd_backends)

    r = sub.add_parser("run", help="generate text from a prompt, streaming it to stdout; or run a graph (.onnx) on arrays")
    add_model_args(r)
    r.add_argument("--prompt", "-p", default=None, help="the prompt text, or - to read it from stdin")
    r.add_argument("--input", "-i", action="append", default=None, metavar="NAME=FILE.npy|FILE.npz",
                   help="a graph model's input (repeatable)")
    r.add_argument("--output-dir", default=None, help="where a graph model's outputs are written, one NAME.npy each")
    add_budget_args(r)
    add_generation_args(r)
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--system", default=None, help="a system message (implies --chat)")
    r.add_argument("--max-tokens", "-n", type=positive_int, default=256)
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--top-k", type=int, default=None)
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--min-p", type=float, default=None)
    r.add_argument("--repeat-penalty", "--repetition-penalty", type=float, default=None,
                   help="seen tokens' logits divided by it where positive, multiplied where not (llama.cpp's)")
    r.add_argument("--repeat-last-n", type=int, default=None,
                   help="the tokens the repeat penalty looks at: the last N of prompt and reply (default 64; 0: none, "
                        "-1: all)")
    r.add_argument("--preset", default=None, metavar="router|code|reasoning|creative",
                   help="one of SPEC's sampling presets; the sampling options given here override its values")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    held = r.add_mutually_exclusive_group()
    held.add_argument("--json-schema", default=None, metavar="FILE", help="the reply must validate against this JSON schema")
    held.add_argument("--regex", default=None, metavar="RE", help="the reply must match this regular expression")
    held.add_argument("--grammar", default=None, metavar="FILE", help="the reply must parse by this Lark (or GBNF) grammar")
    r.set_defaults(run=cmd_run)

    models = sub.add_parser("models", help="inspect models").add_subparsers(dest="models_command", required=True)
    info = models.add_parser("info", help="architecture, size, context and backend of a model")
    info.add_argument("path", nargs="?", default=None, help="model path or name (default: the bundled SmolLM2)")
    add_sha256_arg(info)
    info.add_argument("--fusions", action="store_true", help="print what the fuse pass did to the model's graph: rule, count")
    info.set_defaults(run=lambda a: cmd_models_info(argparse.Namespace(model=a.path, ctx=None, sha256=a.sha256, threads=None,
                                                                       fusions=a.fusions)))
    digest = models.add_parser("hash",
                               help="print the sha256 that --sha256 checks: a file's, or a directory's over its weight files")
    digest.add_argument("path", help="model path or name")
    digest.set_defaults(run=cmd_models_hash)

    bench = sub.add_parser("bench", help="prefill and decode speed of a model")
    add_model_args(bench)
    bench.add_argument("--prompt-tokens", type=positive_int, default=128)
    bench.add_argument("--new-tokens", type=positive_int, default=128)
    bench.add_argument("--runs", type=positive_int, default=3)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(run=cmd_bench)

    emb = sub.add_parser("embed", help="print one JSON vector per text (encoder models)")
    add_model_args(emb)
    emb.add_argument("--text", "-t", action="append", default=None, help="a text (repeatable; default: one per stdin line)")
    emb.add_argument("--batch-size", type=positive_int, default=32)
    emb.add_argument("--no-truncate", action="store_true", help="reject texts over the model's length instead of cutting")
    emb.set_defaults(run=cmd_embed)

    cls = sub.add_parser("classify", help="print each text's labels with probabilities, as JSON (encoder models), or "
                         "each image's with --image (ViT, DeiT)")
    add_model_args(cls)
    cls.add_argument("--text", "-t", action="append", default=None, help="a text (repeatable; default: one per stdin line)")
    cls.add_argument("--label", "-l", action="append", default=None,
                     help="a candidate label for zero-shot classification with an NLI model (repeatable)")
    vision.add_arguments(cls)
    cls.set_defaults(run=cmd_classify)

    tune = sub.add_parser("autotune", help="time kernel variants for a model's shapes on this machine; cache the choices")
    add_model_args(tune)
    tune.set_defaults(run=cmd_autotune)

    srv = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API, with continuous batching")
    srv.add_argument("--model", "-m", action="append", default=None, metavar="[ID=]PATH|NAME",
                     help="a model to load (repeatable; default: the bundled SmolLM2, as id 'default')")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--uds", default=None, help="listen on this unix socket instead of TCP")
    srv.add_argument("--ctx", type=positive_int, default=None, help="context length per sequence")
    srv.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: the physical cores)")
    srv.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"), help="where to compute (default: auto)")
    add_generation_args(srv)
    srv.add_argument("--max-batch", type=positive_int, default=16, help="most sequences decoded together per model")
    srv.add_argument("--step-tokens", type=positive_int, default=256, help="most rows (decode + prompt chunks) per batched step")
    srv.add_argument("--max-queue", type=positive_int, default=256, help="queued requests per model before answering 503")
    srv.add_argument("--memory-budget", type=positive_float, default=None,
                     help="GiB the loaded models may take (default: 80%% of RAM)")
    srv.add_argument("--sha256", action="append", type=sha256_arg, default=None,
                     help="the sha256 of a --model (repeatable: the n-th checks the n-th --model)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /v1/health (default: $SOMA_API_KEY)")
    srv.add_argument("--allow-model-management", action="store_true",
                     help="allow POST /v1/models/load and DELETE /v1/models/{id} (needs --models-dir)")
    srv.add_argument("--models-dir", default=None, help="the only directory POST /v1/models/load loads from")
    srv.add_argument("--retrieval-dir", action="append", default=None, metavar="[NAME=]DIR",
                     help="a folder of pages POST /v1/retrieve may rank (repeatable; its index built beforehand by "
                          "`soma-runtime index DIR`); no other folder is served")
    srv.add_argument("--allowed-hosts", action="append", default=None, metavar="HOST[,HOST]",
                     help="Host names answered besides localhost, 127.0.0.1 and [::1] ('*': any); a loopback bind answers "
                          "only those (DNS rebinding), other binds and --uds any name unless this is given")
    add_budget_args(srv)
    srv.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN]",
                     help="browser origins CORS lets call the API (default: none)")
    srv.add_argument("--max-body-bytes", type=positive_int, default=None,
                     help="largest request body accepted (default: 4 MiB; larger ones get 413)")
    srv.add_argument("--header-timeout", type=positive_float, default=None,
                     help="seconds a request's line and headers may take to arrive (default: 10)")
    srv.add_argument("--body-timeout", type=positive_float, default=None,
                     help="seconds a request's body may take to arrive (default: 30)")
    srv.add_argument("--max-connections", type=positive_int, default=1024,
                     help="open connections served at once before answering 503")
    srv.set_defaults(run=cmd_serve)

    mem = sub.add_parser("memory", help="a running server's memory budget, models, KV caches and degradations")
    mem.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    mem.add_argument("--api-key", default=None, help="its API key (default: $SOMA_API_KEY)")
    mem.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    mem.set_defaults(run=cmd_memory)
    imp = sub.add_parser("import", help="write a soma model directory (config.toml, chat.toml, ...) for a HF directory")
    imp.add_argument("src", help="Hugging Face model directory")
    imp.add_argument("dst", help="output directory")
    add_sha256_arg(imp)
    imp.set_defaults(run=cmd_import)

    conv = sub.add_parser("convert", help="write a GGUF file for a HF model directory")
    conv.add_argument("src", help="Hugging Face model directory")
    conv.add_argument("out", help="output .gguf path")
    conv.add_argument("--type", default="f16", choices=("f32", "f16", "q8_0", "q4_0", "q4_1"))
    conv.add_argument("--merge-lora", action="append", type=lora_arg, default=None, metavar="PATH[:SCALE]",
                      help="fold a PEFT LoRA directory into the weights, its update times SCALE (repeatable)")
    conv.set_defaults(run=cmd_convert)
    speech.add_parsers(sub, sha256_arg)
    detect.add_parser(sub, sha256_arg)
    context.add_parser(sub)
    retrieval.add_parsers(sub, positive_int)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except SomaError as e:
        print(f"soma-runtime: error: {e}", file=sys.stderr)
        return 1
    except (RecursionError, MemoryError) as e:       # an input too deep or too large for this machine: no bug to trace
        what = "the request needs more memory than there is" if isinstance(e, MemoryError) else "the input is nested too deeply"
        print(f"soma-runtime: error: {what} ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                           # the reader went away (`| head`): stop quietly, as coreutils do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
