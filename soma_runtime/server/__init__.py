"""The OpenAI-compatible server: `soma-runtime serve` runs `serve`, which holds a ModelRegistry
(registry.py) behind a FastAPI app (app.py) speaking OpenAI's wire format (openai.py)."""
from __future__ import annotations

import logging
import signal

log = logging.getLogger("soma_runtime.server")


def parse_model_arg(arg: str) -> tuple[str | None, str]:
    """`[ID=]PATH|NAME` -> (id or None, source)."""
    model_id, sep, source = arg.partition("=")
    return (model_id, source) if sep and model_id and "/" not in model_id else (None, arg)


def serve(models: list[str], host: str = "127.0.0.1", port: int = 8000, uds: str | None = None,
          memory_budget: int | None = None, max_batch: int = 16, step_tokens: int = 256, n_ctx: int | None = None,
          threads: int | None = None, max_queue: int = 256, backend: str = "auto") -> None:
    """Load the models, then serve in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    from soma_runtime.api import Runtime
    from soma_runtime.server.app import create_app
    from soma_runtime.server.registry import ModelRegistry

    registry = ModelRegistry(Runtime(backend, threads=threads), memory_budget, max_batch, step_tokens, n_ctx)
    for arg in models or ["default"]:
        model_id, source = parse_model_arg(arg)
        registry.load(None if source == "default" else source, model_id)
    config = uvicorn.Config(create_app(registry, max_queue), host=host, port=port, uds=uds, log_level="info",
                            timeout_graceful_shutdown=30, access_log=False)
    where = f"unix:{uds}" if uds else f"http://{host}:{port}"
    log.info("serving %s on %s (OpenAI API under /v1)", ", ".join(registry.models), where)
    # uvicorn handles SIGINT/SIGTERM (drain, then shut down) and re-raises the signal afterwards;
    # answered by a no-op here, a clean stop exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")
