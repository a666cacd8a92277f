"""The OpenAI-compatible server: `soma-runtime serve` runs `serve`, which holds a ModelRegistry
(registry.py) behind a FastAPI app (app.py) speaking OpenAI's wire format (openai.py)."""
from __future__ import annotations

import itertools
import logging
import os
import signal
import stat

from soma_runtime.errors import RequestError

log = logging.getLogger("soma_runtime.server")
MAX_UDS_PATH = 107          # bytes of a unix socket's path (sun_path holds 108, with its NUL)


def parse_model_arg(arg: str) -> tuple[str | None, str]:
    """`[ID=]PATH|NAME` -> (id or None, source)."""
    model_id, sep, source = arg.partition("=")
    return (model_id, source) if sep and model_id and "/" not in model_id else (None, arg)


def check_listen(port: int, uds: str | None, max_connections: int) -> None:
    """RequestError, before any model loads, for a place the server cannot listen on."""
    if uds is None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise RequestError(f"the port must be 0 to 65535, got {port!r}")
    else:
        directory = os.path.dirname(os.path.abspath(uds))
        if len(os.fsencode(uds)) > MAX_UDS_PATH:
            raise RequestError(f"--uds {uds}: a unix socket's path is at most {MAX_UDS_PATH} bytes")
        if not os.path.isdir(directory):
            raise RequestError(f"--uds {uds}: the directory {directory} does not exist")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise RequestError(f"--uds {uds}: cannot create a socket in {directory} (permission denied)")
        if os.path.lexists(uds) and not stat.S_ISSOCK(os.lstat(uds).st_mode):
            raise RequestError(f"--uds {uds}: exists and is not a socket")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise RequestError(f"max_connections must be at least 1, got {max_connections!r}")


def serve(models: list[str], host: str = "127.0.0.1", port: int = 8000, uds: str | None = None,
          memory_budget: int | None = None, max_batch: int = 16, step_tokens: int = 256, n_ctx: int | None = None,
          threads: int | None = None, max_queue: int = 256, backend: str = "auto", sha256: list[str] = (),
          policy=None, allowed_origins: tuple[str, ...] = (), models_dir: str | None = None,
          max_connections: int = 1024, draft: str | None = None, overflow: str | None = None,
          kv_dtype: str | None = None, gpu_layers: int | None = None, tensor_parallel: int = 1,
          run_budget=None, loras: list[tuple[str, float]] = (), max_loras: int = 8, retrieval_dirs: list[str] = ()) -> None:
    """Load the models (the n-th checked against the n-th `sha256`), then serve in the foreground until
    SIGINT/SIGTERM. Model management is on only with a `models_dir` to load from. `draft`: speculative
    decoding for the text models (Runtime.speculate); `overflow`: what they do with prompts beyond their
    context (TextModel); `kv_dtype`: their KV cache's type, `gpu_layers`: how many of their layers run on the
    device, `tensor_parallel`: over how many processes (GPUs) each is split (Runtime.load); `run_budget`: what
    one /v1/run may compute (ir.plan.RunBudget; engine.graph.DEFAULT_BUDGET if None); `loras`: (path, alpha) of
    LoRA adapters every text model loads at start (TextModel.load_lora, up to `max_loras` each); `retrieval_dirs`:
    `[NAME=]DIR` folders whose page indexes /v1/retrieve answers from (routes/retrieve.py)."""
    import functools

    import uvicorn

    from soma_runtime.memory import map_large_blocks
    from soma_runtime.server.app import create_app
    from soma_runtime.server.registry import ModelRegistry
    from soma_runtime.server.routes.retrieve import open_indexes
    from soma_runtime.server.security import GuardedH11, Policy
    from soma_runtime.tasks import Runtime

    policy = policy or Policy()
    check_listen(port, uds, max_connections)
    map_large_blocks()                      # what a request held goes back to the OS when it ends
    registry = ModelRegistry(Runtime(backend, threads=threads), memory_budget, max_batch, step_tokens, n_ctx, draft,
                            overflow, kv_dtype, gpu_layers, tensor_parallel)
    indexes = open_indexes(list(retrieval_dirs), registry.runtime) if retrieval_dirs else {}     # before any model loads
    sources = models or ["default"]
    if len(sha256) > len(sources):
        raise RequestError(f"{len(sha256)} --sha256 values for {len(sources)} models")
    for arg, digest in itertools.zip_longest(sources, sha256):
        model_id, source = parse_model_arg(arg)
        registry.load(None if source == "default" else source, model_id, sha256=digest)
    text = [served for served in registry.models.values() if served.model.task == "generate"]
    for path, alpha in loras:
        for served in text:
            served.model.load_lora(path, alpha, max_loras=max_loras)
            registry.remeasure(served.id)
    app = create_app(registry, max_queue, policy, allowed_origins, models_dir, hosts=policy.hosts(host, uds),
                     run_budget=run_budget, indexes=indexes)
    config = uvicorn.Config(app, host=host, port=port, uds=uds, log_level="info", timeout_graceful_shutdown=30,
                            access_log=False, http=functools.partial(GuardedH11, head_seconds=policy.head_seconds),
                            limit_concurrency=max_connections)
    where = f"unix:{uds}" if uds else f"http://{host}:{port}"
    log.info("serving %s on %s (OpenAI API under /v1%s)", ", ".join(registry.models), where,
             "" if policy.api_key else "; no API key: anyone who can reach it may use it")
    # uvicorn handles SIGINT/SIGTERM (drain, then shut down) and re-raises the signal afterwards;
    # answered by a no-op here, a clean stop exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")
