"""Runtime: loads a model (a path, a bundled name, or a Graph built in code) and runs it by its task's Model
class (TASKS), at the precision its format and checkpoint dtype call for; checks the load options."""
from __future__ import annotations

import itertools
import os
import reprlib

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from soma_runtime import loaders, schedule
from soma_runtime.dtypes import FLOATS, dtype_of
from soma_runtime.engine.generate import Drafter
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Precision
from soma_runtime.ir.graph import Graph
from soma_runtime.memory import peak_rss_mb
from soma_runtime.quant import kv
from soma_runtime.tasks.base import Model, check_count, check_flag
from soma_runtime.tasks.detect import DetectModel
from soma_runtime.tasks.encode import EncoderModel
from soma_runtime.tasks.graph import GraphModel
from soma_runtime.tasks.pipeline import Pipeline
from soma_runtime.tasks.speech import SpeechModel
from soma_runtime.tasks.text import OVERFLOWS, TextModel
from soma_runtime.tasks.vision import ImageEncoderModel
from soma_runtime.tasks.voice import VoiceModel


def checkpoint_dtype(weights) -> str:
    """The float dtype a checkpoint is stored in (its embedding table's), as transformers' dtype="auto"
    reads it; f32 for anything else."""
    stored = dtype_of(weights["token_embd.weight"])
    return stored if stored in FLOATS else "f32"


TASKS = {"generate": TextModel, "encode": EncoderModel, "graph": GraphModel, "transcribe": SpeechModel, "speak": VoiceModel,
         "detect": DetectModel, "encode_image": ImageEncoderModel}


ACTIVATIONS = ("f32", "bf16", "q8")


def check_load_options(source, n_ctx, kv_dtype, activations, kv_tokens, progress, autotune, model_id, draft, gpu_layers,
                       tensor_parallel) -> None:
    if not (source is None or isinstance(source, (str, os.PathLike, Graph))):
        raise RequestError(f"a model's source is a path, a model name or a Graph, got {type(source).__name__}")
    for name, value in (("n_ctx", n_ctx), ("kv_tokens", kv_tokens)):
        check_count(name, value, optional=True)
    check_count("gpu_layers", gpu_layers, least=0, optional=True)
    check_count("tensor_parallel", tensor_parallel)
    check_flag("progress", progress, optional=True)
    check_flag("autotune", autotune, optional=True)
    if not (model_id is None or (isinstance(model_id, str) and model_id)):
        raise RequestError(f"model_id must be a non-empty string, got {reprlib.repr(model_id)}")
    check_draft(draft)
    if activations is not None and activations not in ACTIVATIONS:
        raise RequestError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if kv_dtype is not None:
        try:
            kv.layout(kv_dtype, 1)
        except ValueError as e:
            raise RequestError(str(e)) from None


def check_draft(draft) -> None:
    """A draft for speculative decoding: None, a TextModel or Drafter, or a name or path (not an empty one)."""
    if draft is None or isinstance(draft, (TextModel, Drafter, os.PathLike)):
        return
    if not isinstance(draft, str) or not draft.strip():
        raise RequestError(f'draft must be "prompt-lookup", "layers:N", a text model or the path of one, '
                           f'got {reprlib.repr(draft)}')


class Runtime:
    def __init__(self, backend: str = "auto", threads: int | None = None):
        """`backend`: auto (cuda where a GPU is present, else cpu), cpu, cuda or reference; `threads`: the
        CPU's (default: its physical cores)."""
        check_count("threads", threads, optional=True)
        self.backend = schedule.check_backend(backend)
        schedule.use_threads(threads)
        self.models: dict[str, Model] = {}
        self._ids = itertools.count()

    def backends(self) -> dict:
        return schedule.detect()

    def load(self, source: str | Graph | None = None, n_ctx: int | None = None, sha256: str | None = None,
             kv_dtype: str | None = None, activations: str | None = None, progress: bool | None = None,
             autotune: bool | None = None, model_id: str | None = None, draft=None, overflow: str | None = None,
             gpu_layers: int | None = None, tensor_parallel: int = 1, kv_tokens: int | None = None) -> Model:
        """Load a model (a path, a bundled name, or a Graph built in code); it is run by its task's Model
        class. Precision follows each format's reference engine unless set (Backend.defaults): GGUF models
        run like llama.cpp (f16 KV cache, q8 activations into quantized matmuls), HF/soma directories like
        transformers (the KV cache in the checkpoint's dtype: f32, or a 16-bit model's own; f32
        activations). `kv_dtype="f32", activations="f32"` is exact f32 arithmetic.
        `activations="bf16"` rounds matmul inputs to bf16 (an encoder also stores its projections in
        bf16), which runs bf16 weights on the CPU's matrix units (AMX) where it has them; encoders
        default to it on such CPUs (embeddings within 1e-4 cosine of f32), to f32 elsewhere.
        With `autotune` (default: unless SOMA_AUTOTUNE=0), kernel variants for weight shapes this
        machine has not seen are timed once and the choice cached on disk (schedule.py). `draft` turns on
        speculative decoding for a text model (see `speculate`); `overflow`, what it does with a prompt beyond
        its context (TextModel: "error", "truncate" or "slide"). `gpu_layers` splits a decoder on a device as
        llama.cpp's --n-gpu-layers does: its first layers run there, the rest on the host (other models
        run whole). `tensor_parallel=N` splits a decoder's heads and MLP over N processes (parallel.py): N
        GPUs on cuda, N host processes of this runtime's threads each on cpu; `unload` stops them.
        `kv_tokens`: the tokens a text model's KV pool holds for all its sequences together, at least one
        sequence's (default: room for many, at least 32768)."""
        check_load_options(source, n_ctx, kv_dtype, activations, kv_tokens, progress, autotune, model_id, draft, gpu_layers,
                           tensor_parallel)
        if overflow is not None and overflow not in OVERFLOWS:
            raise RequestError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
        if autotune is None:
            autotune = os.environ.get("SOMA_AUTOTUNE", "1") != "0"
        bar = tqdm(total=4, desc="loading", unit="step", disable=None if progress is None else not progress, delay=0.5,
                   leave=False)
        with bar, logging_redirect_tqdm():             # log lines print above the bar, never on it
            bar.set_postfix_str("weights")
            loaded = loaders.LoadedModel.of_graph(source) if isinstance(source, Graph) else loaders.load(source, sha256)
            bar.update()
            backend = schedule.backend_named(self.backend)
            stored = checkpoint_dtype(loaded.weights) if loaded.task == "generate" else "f32"
            defaults = backend.defaults(loaded.task, loaded.format, stored)
            precision = Precision(kv_dtype or defaults.kv_dtype, activations or defaults.activations)
            model_id = model_id or f"{os.path.basename(os.path.normpath(loaded.path))}-{next(self._ids)}"
            split = {"gpu_layers": gpu_layers} if gpu_layers is not None and loaded.task == "generate" else {}
            if kv_tokens is not None and loaded.task == "generate":
                split["kv_tokens"] = kv_tokens
            if tensor_parallel != 1:
                if loaded.task != "generate":
                    raise RequestError(f"tensor_parallel splits text generators; {loaded.path} is a {loaded.task} model")
                split["tensor_parallel"] = tensor_parallel
            model = TASKS[loaded.task].open(model_id, loaded, backend, precision, n_ctx, bar, autotune, **split)
        if overflow is not None and isinstance(model, TextModel):
            model.overflow = overflow
        self.models[model_id] = model
        if draft is not None:
            self.speculate(model, draft)
        return model

    def speculate(self, model: Model, draft) -> None:
        """Speculative decoding for a text model: `draft` is "prompt-lookup", "layers:N", a loaded TextModel
        of the same vocabulary, or a source to load one from (TextModel.speculate)."""
        if not isinstance(model, TextModel):
            what = f"{model.id}, which runs the {model.task} task" if isinstance(model, Model) else type(model).__name__
            raise RequestError(f"only text models speculate; got {what}")
        check_draft(draft)
        own = isinstance(draft, str) and (draft == "prompt-lookup" or draft.startswith("layers:"))    # drafts of the model itself
        if isinstance(draft, (str, os.PathLike)) and not own:
            draft = self.load(draft, n_ctx=model.context_length, progress=False)
        model.speculate(draft)

    def pipeline(self, asr, llm, tts, system: str | None = None) -> Pipeline:
        """A speech-to-speech pipeline over three models (each a loaded Model, or a source to load)."""
        asr, llm, tts = (m if isinstance(m, Model) else self.load(m) for m in (asr, llm, tts))
        return Pipeline(asr, llm, tts, system)

    def unload(self, model_id: str) -> None:
        if not isinstance(model_id, str) or model_id not in self.models:
            raise RequestError(f"no loaded model {reprlib.repr(model_id)}; loaded: {', '.join(self.models) or 'none'}")
        self.models.pop(model_id).close()

    def list_models(self) -> list[dict]:
        return [m.info() for m in self.models.values()]

    def memory_stats(self) -> dict:
        return {"peak_rss_mb": peak_rss_mb(), "per_model_weight_bytes": {k: m.weight_bytes() for k, m in self.models.items()}}
