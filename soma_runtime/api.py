"""The library surface (SPEC "library API"): Runtime loads models, Model generates and chats.

    rt = Runtime()
    model = rt.load("model.gguf")              # or a HF/soma directory, or "default"
    for token in model.generate("Once upon", max_tokens=32, temperature=0):
        print(token.text, end="")
    print(model.chat([{"role": "user", "content": "Hi"}], stream=False))
    model.metrics()                            # prefill/decode ms and tok/s, peak memory
"""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from soma_runtime import loaders, schedule
from soma_runtime.backends import BACKENDS, detect_all, gpu_available
from soma_runtime.backends.cpu import amx, physical_cores
from soma_runtime.dtypes import FLOATS, dtype_of
from soma_runtime.engine.encode import Encoder
from soma_runtime.engine.generate import Engine, GenerationRequest, Token, peak_rss_mb
from soma_runtime.engine.sampling import SamplingParams
from soma_runtime.engine.stops import check_stops
from soma_runtime.errors import ModelLoadError, PromptTooLong, RequestError
from soma_runtime.text.chat import ChatTemplate

SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}
ALIASES = {"repetition_penalty": "repeat_penalty"}
log = logging.getLogger("soma_runtime")


def checkpoint_dtype(weights) -> str:
    """The float dtype a checkpoint is stored in (its embedding table's), as transformers' dtype="auto"
    reads it; f32 for anything else."""
    stored = dtype_of(weights["token_embd.weight"])
    return stored if stored in FLOATS else "f32"


class Model:
    def __init__(self, model_id: str, loaded: loaders.LoadedModel, engine: Engine):
        self.id, self.loaded, self.engine = model_id, loaded, engine
        self.tokenizer = loaded.tokenizer
        try:                                                # the model's own defaults must make a request
            self.sampling()
            check_stops(self.stops(None))
        except RequestError as e:
            raise ModelLoadError(f"{loaded.path}: its sampling defaults are invalid ({e})") from None
        self.chat_template, self.template_error = None, None
        template = loaded.tokenizer.chat_template
        try:
            if template is not None:
                self.chat_template = ChatTemplate(template, self.tokenizer.bos_token, self.tokenizer.eos_token)
        except ModelLoadError as e:     # a broken template fails chats, with its reason; raw prompts still run
            self.template_error = ModelLoadError(f"{loaded.path}: {e}")
            log.warning("%s", self.template_error)

    def request(self, prompt_ids: list[int], max_tokens: int | None = None, stop=None, logprobs: int | None = None,
                **params) -> GenerationRequest:
        """A checked GenerationRequest: every argument of the wrong type or out of range is a RequestError
        naming it; `max_tokens` is cut to what the context leaves after the prompt."""
        max_tokens = max_tokens if max_tokens is not None else self.loaded.sampling.get("max_tokens", 256)
        req = GenerationRequest(self.prompt_ids(prompt_ids), max_tokens, self.stops(stop), self.sampling(**params), logprobs)
        self.engine.check(req)
        req.max_tokens = min(req.max_tokens, self.engine.n_ctx - len(req.prompt_ids))
        return req

    def sampling(self, **params) -> SamplingParams:
        """The model's sampling defaults overridden by `params` (OpenAI or llama.cpp names)."""
        params = {ALIASES.get(k, k): v for k, v in params.items() if v is not None}
        unknown = set(params) - SAMPLING_FIELDS
        if unknown:
            raise RequestError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        defaults = {k: v for k, v in self.loaded.sampling.items() if k in SAMPLING_FIELDS}
        return SamplingParams(**{**defaults, **params}).validate()

    def stops(self, stop) -> list:
        """`stop` (or the model's default) as a list: one string, or several."""
        stop = stop if stop is not None else self.loaded.sampling.get("stop")
        return [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else stop or []

    def generate(self, prompt: str | list[int], max_tokens: int | None = None, stop=None, **params) -> Iterator[Token]:
        """Stream tokens for a raw prompt (text, or token ids); each has .id, .text, .finish_reason."""
        return self.engine.generate(self.request(self.prompt_ids(prompt), max_tokens, stop, **params))

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A raw prompt's token ids: text is tokenized (after a length check that needs no tokenizing),
        ids pass as they are (the request checks them)."""
        if isinstance(prompt, str):
            self.check_length(prompt)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            return prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            return [int(t) if isinstance(t, np.integer) else t for t in prompt]
        raise RequestError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")

    def check_length(self, text: str) -> None:
        """PromptTooLong, from the character count alone, for text too long for any tokenization to fit
        the context (every token covers at most the vocabulary's longest piece)."""
        if len(text) > self.engine.n_ctx * self.tokenizer.max_token_chars:
            raise PromptTooLong(f"a prompt of {len(text)} characters cannot fit the context of {self.engine.n_ctx} tokens")

    def complete(self, prompt: str | list[int], **params) -> str:
        return "".join(t.text for t in self.generate(prompt, **params))

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.template_error is not None:
            raise self.template_error
        if self.chat_template is None:
            raise RequestError(f"model {self.id} has no chat template; use generate() with a raw prompt")
        return self.chat_template.render(messages, add_generation_prompt)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt tokens of a conversation, through the model's chat template."""
        text = self.chat_prompt(messages)
        self.check_length(text)
        return self.tokenizer.encode(text, add_special=False)

    def chat(self, messages: list[dict], stream: bool = True, **params):
        """Apply the model's chat template and generate the assistant's reply."""
        tokens = self.generate(self.chat_ids(messages), **params)
        return tokens if stream else "".join(t.text for t in tokens)

    def logits(self, prompt: str | list[int]) -> np.ndarray:
        """Next-token logits at every position of the prompt: [tokens, vocab] f32."""
        return self.engine.logits(self.prompt_ids(prompt))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def metrics(self) -> dict:
        return self.engine.metrics.as_dict()

    def info(self) -> dict:
        cfg = self.loaded.config
        weights = self.loaded.weights.tensors.values()
        n_params = sum(int(np.prod(w.shape)) for w in weights)
        return {"id": self.id, "path": self.loaded.path, "format": self.loaded.format, "model_type": cfg.model_type,
                "parameters": n_params, "weight_bytes": sum(int(w.nbytes) for w in weights), "layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                "vocab_size": cfg.vocab_size, "context": self.engine.n_ctx, "max_position": cfg.max_position,
                "backend": self.engine.backend, "chat_template": self.chat_template is not None}


class EncoderModel:
    """An encoder (BERT family): embeddings, and classification with the model's own or given labels."""

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, encoder: Encoder):
        self.id, self.loaded, self.encoder = model_id, loaded, encoder
        self.tokenizer = loaded.tokenizer

    def embed(self, texts: str | list[str], batch_size: int = 32, truncate: bool = True) -> np.ndarray:
        """One vector per text ([D] for a single string, [N, D] for a list), pooled and normalized as
        the model's sentence-transformers config says. Over-long texts are cut with a warning, or
        rejected when `truncate=False`."""
        if isinstance(texts, str):
            return self.encoder.embed([texts], batch_size, truncate)[0]
        return self.encoder.embed(list(texts) if isinstance(texts, tuple) else texts, batch_size, truncate)

    def classify(self, text: str, labels: list[str] | None = None, template: str = "This example is {}.",
                 truncate: bool = True) -> list[tuple[str, float]]:
        """(label, probability) pairs, most likely first. Without `labels`: the model's own classes.
        With `labels`: zero-shot through an NLI model, each label's hypothesis scored by its
        entailment logit, softmax across labels (as transformers' zero-shot pipeline)."""
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}")
        own = self.loaded.config.labels
        if labels is None:
            logits = self.encoder.classify([text], truncate=truncate)[0]
            names = [own.get(i, f"LABEL_{i}") for i in range(len(logits))]
        else:
            if not labels or not all(isinstance(label, str) for label in labels):
                raise RequestError("labels must be a non-empty list of strings")
            entail = next((i for i, name in own.items() if name.lower().startswith("entail")), None)
            if entail is None:
                raise RequestError(f"model {self.id} is not an NLI model (no 'entailment' label); classify without labels")
            logits = self.encoder.classify([text] * len(labels), [template.format(x) for x in labels], truncate=truncate)[:, entail]
            names = list(labels)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        return sorted(zip(names, probs.tolist()), key=lambda pair: -pair[1])

    def classify_tokens(self, text: str) -> list[tuple[str, str]]:
        """(token, label) for every token, for token-classification models (NER)."""
        logits, encoding = self.encoder.token_logits(text)
        own = self.loaded.config.labels
        return [(tok, own.get(int(i), f"LABEL_{int(i)}")) for tok, i in zip(encoding.tokens, logits.argmax(-1))]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.hf.encode(text, add_special_tokens=True).ids

    def info(self) -> dict:
        cfg = self.loaded.config
        held = self.encoder.weights.tensors.values()          # as run: bf16 copies, stacked projections
        return {"id": self.id, "path": self.loaded.path, "format": self.loaded.format, "model_type": cfg.model_type,
                "task": "encode", "activations": self.encoder.precision,
                "parameters": sum(int(np.prod(w.shape)) for w in self.loaded.weights.tensors.values()),
                "weight_bytes": sum(int(w.nbytes) for w in held), "layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "max_tokens": self.encoder.max_tokens,
                "pooling": self.loaded.pooling.mode, "normalize": self.loaded.pooling.normalize,
                "labels": [cfg.labels[i] for i in sorted(cfg.labels)], "backend": self.encoder.backend}


KV_DTYPES, ACTIVATIONS = ("f32", "f16", "bf16"), ("f32", "bf16", "q8")


def check_load_options(n_ctx, kv_dtype, activations) -> None:
    if n_ctx is not None and (type(n_ctx) is not int or n_ctx < 1):
        raise RequestError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    for name, value, allowed in (("kv_dtype", kv_dtype, KV_DTYPES), ("activations", activations, ACTIVATIONS)):
        if value is not None and value not in allowed:
            raise RequestError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


class Runtime:
    def __init__(self, backend: str = "auto", threads: int | None = None):
        import numba
        threads = threads or physical_cores()          # SMT siblings share the core's SIMD units
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        if backend == "auto":
            backend = "cuda" if gpu_available() else "cpu"
        elif backend not in BACKENDS:
            raise RequestError(f"unknown backend {backend!r}; known: auto, {', '.join(BACKENDS)}")
        elif backend == "cuda" and not (cuda := detect_all()["cuda"]).get("available"):
            raise RequestError(f"the cuda backend is not available here: {cuda.get('error')}")
        self.backend = backend
        self.models: dict[str, Model] = {}
        self._ids = itertools.count()

    def backends(self) -> dict:
        return detect_all()

    def load(self, path_or_name: str | None = None, n_ctx: int | None = None, sha256: str | None = None,
             kv_dtype: str | None = None, activations: str | None = None, progress: bool | None = None,
             autotune: bool | None = None, model_id: str | None = None) -> Model | EncoderModel:
        """Load a model. Precision follows each format's reference engine unless set: GGUF models run
        like llama.cpp (f16 KV cache, q8 activations into quantized matmuls), HF/soma directories like
        transformers (the KV cache in the checkpoint's dtype: f32, or a 16-bit model's own; f32
        activations). `kv_dtype="f32", activations="f32"` is exact f32 arithmetic.
        `activations="bf16"` rounds matmul inputs to bf16 (an encoder also stores its projections in
        bf16), which runs bf16 weights on the CPU's matrix units (AMX) where it has them; encoders
        default to it on such CPUs (embeddings within 1e-4 cosine of f32), to f32 elsewhere.
        With `autotune` (default: unless SOMA_AUTOTUNE=0), kernel variants for weight shapes this
        machine has not seen are timed once and the choice cached on disk (schedule.py)."""
        check_load_options(n_ctx, kv_dtype, activations)
        bar = tqdm(total=4, desc="loading", unit="step", disable=None if progress is None else not progress, delay=0.5, leave=False)
        with bar, logging_redirect_tqdm():             # log lines print above the bar, never on it
            bar.set_postfix_str("weights")
            loaded = loaders.load(path_or_name, sha256)
            bar.update()
            if loaded.is_encoder:
                # encoders run on the CPU backend for now (their sdpa has no CUDA jet yet)
                return self._add(EncoderModel, loaded, Encoder(loaded.config, loaded.weights, loaded.tokenizer,
                                                               loaded.pooling, loaded.max_tokens, "cpu",
                                                               activations or ("bf16" if amx.available() else "f32")),
                                 model_id)
            bar.set_postfix_str("graph")
            gguf = loaded.format == "gguf"
            engine = Engine(loaded.config, loaded.weights, loaded.tokenizer, self.backend, n_ctx,
                            kv_dtype or ("f16" if gguf else checkpoint_dtype(loaded.weights)), activations or ("q8" if gguf else "f32"))
            bar.update()
            bar.set_postfix_str("kernels")
            engine.plan(1)                        # compile the decode plan (numba caches on disk)
            bar.update()
            bar.set_postfix_str("autotune")
            if autotune is None:
                autotune = os.environ.get("SOMA_AUTOTUNE", "1") != "0"
            if autotune and engine.activations == "q8" and self.backend == "cpu":
                schedule.tune(engine.layer_weights())
            bar.update()
        return self._add(Model, loaded, engine, model_id)

    def _add(self, kind, loaded, engine, model_id=None):
        model_id = model_id or f"{os.path.basename(os.path.normpath(loaded.path))}-{next(self._ids)}"
        self.models[model_id] = kind(model_id, loaded, engine)
        return self.models[model_id]

    def unload(self, model_id: str) -> None:
        if model_id not in self.models:
            raise RequestError(f"no loaded model {model_id!r}; loaded: {', '.join(self.models) or 'none'}")
        del self.models[model_id]

    def list_models(self) -> list[dict]:
        return [m.info() for m in self.models.values()]

    def memory_stats(self) -> dict:
        return {"peak_rss_mb": peak_rss_mb(), "per_model_weight_bytes": {k: m.info()["weight_bytes"] for k, m in self.models.items()}}
