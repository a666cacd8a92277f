"""The library surface (SPEC "library API"): Runtime loads models; a model is run by its task.

    rt = Runtime()
    model = rt.load("model.gguf")              # or a HF/soma directory, or "default"  -> TextModel
    for token in model.generate("Once upon", max_tokens=32, temperature=0):
        print(token.text, end="")
    print(model.chat([{"role": "user", "content": "Hi"}], stream=False))
    model.metrics()                            # prefill/decode ms and tok/s, peak memory
    rt.load("minilm").embed(["a text"])        # an encoder directory -> EncoderModel
    rt.load(graph).run({"x": array})           # a Graph built in code -> GraphModel
    rt.load("whisper-tiny.en").transcribe("talk.wav").text   # a whisper directory -> SpeechModel
    samples, rate = rt.load("voice.onnx").speak("Hello.")   # a piper voice -> VoiceModel
    rt.pipeline("whisper-tiny.en", "default", "voice.onnx")("question.wav").samples   # speech in, speech out

One Model class per task (`generate`, `encode`, `graph`, `transcribe`, `speak`) over a shared base; each holds its task's
runner (engine/), built on the Backend the scheduling policy (schedule.py) gives it.
"""
from __future__ import annotations

import itertools
import logging
import os
import reprlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from soma_runtime import loaders, parallel, schedule
from soma_runtime.architectures.shard import check_split
from soma_runtime.audio.features import SAMPLE_RATE
from soma_runtime.audio.io import load_audio
from soma_runtime.backends.base import Backend, Precision
from soma_runtime.dtypes import FLOATS, dtype_of
from soma_runtime.engine.batching import Scheduler
from soma_runtime.engine.encode import Encoder
from soma_runtime.engine.generate import Engine, GenerationRequest, Token, peak_rss_mb
from soma_runtime.engine.grammar import Constraint, constraint_of
from soma_runtime.engine.graph import FamilyRunner, GraphRunner, graph_runner
from soma_runtime.engine.sampling import SamplingParams
from soma_runtime.engine.speak import Voice, VoiceConfig
from soma_runtime.engine.speculate import Drafter, DraftModel, PromptLookup
from soma_runtime.engine.stops import check_stops
from soma_runtime.engine.transcribe.runner import MAX_BATCH, WhisperRunner
from soma_runtime.engine.transcribe.segments import Options as TranscribeOptions
from soma_runtime.engine.transcribe.segments import Transcriber, Transcript, features_of
from soma_runtime.engine.transcribe.speech_map import VAD_BEYOND_SECONDS, VAD_OPTIONS, SpeechMap, restore, speech_only
from soma_runtime.engine.transcribe.tokens import WhisperTokens
from soma_runtime.engine.transcribe.words import Aligner
from soma_runtime.engine.vad import VoiceActivity
from soma_runtime.errors import ModelLoadError, PromptTooLong, RequestError
from soma_runtime.ir.graph import Graph
from soma_runtime.ir.plan import RunBudget
from soma_runtime.loaders import package_file
from soma_runtime.quant import kv
from soma_runtime.text.chat import ChatTemplate, characters, check_messages
from soma_runtime.text.tokenizer import check_ids, check_text
from soma_runtime.tools.loop import ToolLoop
from soma_runtime.tools.registry import ToolRegistry
from soma_runtime.tools.turn import Turn

SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}
ALIASES = {"repetition_penalty": "repeat_penalty"}
LIBRARY_BATCH = 16          # streams the library's loop runs together (generators consumed side by side)
OVERFLOWS = ("error", "truncate", "slide")   # what a text model does with a prompt beyond its context
PROMPT_SHARE = 0.75         # a truncated prompt takes at most this share of the context; the rest is the reply's
log = logging.getLogger("soma_runtime")


def checkpoint_dtype(weights) -> str:
    """The float dtype a checkpoint is stored in (its embedding table's), as transformers' dtype="auto"
    reads it; f32 for anything else."""
    stored = dtype_of(weights["token_embd.weight"])
    return stored if stored in FLOATS else "f32"


# The task-specific methods of the Model classes, and the tasks whose models have each; called on a model of
# another task, one is a RequestError naming both tasks (Model's stand-ins below), never an AttributeError.
METHOD_TASKS = {"generate": ("generate",), "complete": ("generate",), "chat": ("generate",), "logits": ("generate",),
                "detokenize": ("generate",), "tokenize": ("generate", "encode"), "embed": ("encode",),
                "classify": ("encode",), "classify_tokens": ("encode",), "run": ("graph", "speak"),
                "transcribe": ("transcribe",), "speak": ("speak",)}


def check_flag(name: str, value, optional: bool = False) -> None:
    """RequestError unless `value` is true or false (or None, where `optional`)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise RequestError(f"{name} must be true or false, got {reprlib.repr(value)}")


def check_count(name: str, value, least: int = 1, optional: bool = False) -> None:
    """RequestError unless `value` is an integer (not a bool) of at least `least` (or None, where `optional`)."""
    if not ((type(value) is int and value >= least) or (optional and value is None)):
        raise RequestError(f"{name} must be an integer >= {least}, got {reprlib.repr(value)}")


class Model:
    """What every loaded model has: an id, what it was loaded from, its task and its backend."""

    task = ""

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend):
        self.id, self.loaded, self.backend = model_id, loaded, backend

    @property
    def format(self) -> str:
        return self.loaded.format

    @property
    def path(self) -> str:
        """Where the model was loaded from (a bundled model's file, or "graph" for one built in code)."""
        return self.loaded.path

    @property
    def memory_bytes(self) -> int:
        """What the model may come to hold: its weights (and a generator's full context of KV cache)."""
        return self.weight_bytes()

    def close(self) -> None:
        """Let go of what outlives a reference to the model (processes); most models hold none."""

    def weight_bytes(self) -> int:
        return sum(int(w.nbytes) for w in self.loaded.weights.tensors.values()) if self.loaded.weights else 0

    def info(self) -> dict:
        return {"id": self.id, "task": self.task, "path": self.loaded.path, "format": self.loaded.format,
                "backend": self.backend.name, "weight_bytes": self.weight_bytes(), "memory_bytes": self.memory_bytes}

    def other_task(self, method: str) -> RequestError:
        """The error for `method` (one of METHOD_TASKS) called on this model, whose task does not have it."""
        tasks = METHOD_TASKS[method]
        return RequestError(f"{method}() is for {' or '.join(tasks)} models; model {self.id} runs the {self.task} task")


def stand_in(method: str):
    """Model's `method`, for the models of tasks without it: a RequestError naming both tasks."""
    def of_another_task(self, *args, **kwargs):
        raise self.other_task(method)
    of_another_task.__name__, of_another_task.__qualname__ = method, f"Model.{method}"
    return of_another_task


for _method in METHOD_TASKS:
    setattr(Model, _method, stand_in(_method))


class TextModel(Model):
    """A text generator (decoder LLM): generate, chat, logits. `overflow` says what becomes of a prompt
    beyond the context: "error" (PromptTooLong); "truncate": the oldest tokens of a raw prompt go (a
    leading BOS stays), the oldest messages of a conversation after its system messages, until the prompt
    takes at most PROMPT_SHARE of the context; or "slide", for a model whose every layer attends within a
    sliding window (as it was trained): the sequence runs on to the model's positions, each token seeing
    its window, the cache holding a window's worth."""

    task = "generate"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, engine: Engine):
        super().__init__(model_id, loaded, backend)
        self.engine, self.tokenizer = engine, loaded.tokenizer
        self._overflow = "error"
        try:                                                # the model's own defaults must make a request
            self.sampling()
            check_stops(self.stops(None))
        except RequestError as e:
            raise ModelLoadError(f"{loaded.path}: its sampling defaults are invalid ({e})") from None
        self.chat_template, self.template_error = None, None
        template = loaded.tokenizer.chat_template
        try:
            if template is not None:
                # the longest prompt any context of it may hold (n_ctx only shrinks; sliding runs to max_position)
                longest = max(engine.n_ctx, engine.cfg.max_position) * self.tokenizer.max_token_chars
                self.chat_template = ChatTemplate(template, self.tokenizer.bos_token, self.tokenizer.eos_token, longest)
        except ModelLoadError as e:     # a broken template fails chats, with its reason; raw prompts still run
            self.template_error = ModelLoadError(f"{loaded.path}: {e}")
            log.warning("%s", self.template_error)
        self.drafter: Drafter | None = None
        self.scheduler = Scheduler(engine, LIBRARY_BATCH, engine.n_ctx, thread=False)
        self.followers: parallel.Followers | None = None     # the other tensor-parallel ranks, where split

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the model is of no use after)."""
        if self.followers is not None:
            self.followers.stop()
            self.followers = None

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool, gpu_layers: int | None = None, tensor_parallel: int = 1,
             kv_tokens: int | None = None) -> TextModel:
        """`gpu_layers`: on a device backend, only the first this many layers run there, the rest on the host.
        `tensor_parallel`: split over this many processes (each a GPU of its own on cuda; parallel.py).
        `kv_tokens`: the tokens its KV pool holds for all sequences together (Engine.pool_tokens)."""
        bar.set_postfix_str("graph")
        followers = None
        if tensor_parallel != 1:
            if gpu_layers is not None:
                raise RequestError("gpu_layers and tensor_parallel do not go together: each rank runs its share whole")
            check_split(loaded.config, loaded.weights.source, tensor_parallel)
            followers = parallel.Followers(tensor_parallel, {"source": loaded.path, "backend": backend.name, "n_ctx": n_ctx,
                                                             "kv_dtype": precision.kv_dtype, "activations": precision.activations,
                                                             "kv_tokens": kv_tokens, "threads": schedule.threads()})
            try:
                engine = parallel.sharded_engine(loaded, backend, precision, n_ctx, kv_tokens)
            except BaseException:
                followers.abandon()
                raise
            followers.confirm()
            engine.leading = True
        else:
            engine = Engine(loaded.config, loaded.weights, loaded.tokenizer, backend, n_ctx,
                            precision.kv_dtype, precision.activations, kv_tokens, device_layers=gpu_layers)
        bar.update()
        bar.set_postfix_str("autotune")
        engine.prepare(precision, autotune)
        bar.update()
        bar.set_postfix_str("kernels")
        engine.warm()                         # compiled now (numba caches them on disk), not in the first reply
        bar.update()
        model = cls(model_id, loaded, backend, engine)
        model.followers = followers
        return model

    def serve(self, max_batch: int, step_tokens: int) -> Scheduler:
        """Run the model's scheduling loop on a thread of its own (a server's): requests from any thread
        join it; `generate` goes through it too."""
        check_count("max_batch", max_batch)
        check_count("step_tokens", step_tokens)
        self.scheduler = Scheduler(self.engine, max_batch, step_tokens, drafter=self.drafter)
        return self.scheduler

    def speculate(self, draft: str | TextModel | Drafter | None) -> None:
        """Speculative decoding for this model's requests from now on: `draft` is "prompt-lookup" (drafts
        from n-grams of the text so far), "layers:N" (the model's own first N layers), a smaller TextModel
        of the same vocabulary, or a Drafter of one's own; None turns it off. Greedy output is unchanged,
        sampled output keeps the model's distribution; metrics() reports the acceptance rate and tokens per
        step."""
        self.drafter = self.drafter_of(draft)
        self.scheduler.drafter = self.drafter

    def drafter_of(self, draft: str | TextModel | Drafter | None) -> Drafter | None:
        if draft is None or isinstance(draft, Drafter):
            return draft
        if isinstance(draft, TextModel):
            if draft.tokenizer.hf.get_vocab(with_added_tokens=True) != self.tokenizer.hf.get_vocab(with_added_tokens=True):
                raise RequestError(f"draft model {draft.id} has another vocabulary than {self.id}")
            return DraftModel(draft.engine)
        if draft == "prompt-lookup":
            return PromptLookup()
        layers = draft.removeprefix("layers:") if isinstance(draft, str) else ""
        if not layers.isdigit():
            raise RequestError(f'draft must be "prompt-lookup", "layers:N" or a text model, got {draft!r}')
        return DraftModel(self.engine.first_layers(int(layers)))

    @property
    def context_length(self) -> int:
        return self.engine.n_ctx

    @property
    def overflow(self) -> str:
        return self._overflow

    @overflow.setter
    def overflow(self, policy: str) -> None:
        if policy not in OVERFLOWS:
            raise RequestError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {policy!r}")
        if policy == "slide" and not self.engine.cache.horizon:
            raise RequestError(f'overflow "slide" needs a model whose every layer attends within a sliding window; '
                               f'{self.id} has layers that see the whole context')
        self._overflow, self.engine.sliding = policy, policy == "slide"

    @property
    def memory_bytes(self) -> int:
        """Its weights and KV cache for the context where it runs (a split model: on its device)."""
        return self.engine.memory_bytes()

    def offload(self, gpu_layers: int) -> None:
        """Run only the first `gpu_layers` layers on the device from now on, the rest on the host (before it
        serves: the memory ladder's third rung)."""
        check_count("gpu_layers", gpu_layers, least=0)
        self.engine.offload(gpu_layers)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.cache.token_bytes()

    def smaller_kv_kind(self) -> str | None:
        """The next KV kind of the memory ladder (f32/f16/bf16 -> tq4 -> tq3) this model's cache can take,
        or None: already at the last, another spec, or heads the codecs cannot hold."""
        current = self.engine.kv_dtype
        following = "tq4" if current in kv.FLOAT_KINDS else "tq3" if current == "tq4" else None
        if following is None or self.engine.cfg.head_dim % kv.BLOCK or self.engine.shard is not None:
            return None
        return following

    def recompress(self, kv_dtype: str) -> None:
        """Its KV cache in another kind, running requests' pages converted (Engine.recompress)."""
        self.engine.recompress(kv_dtype)

    def limit_context(self, n_ctx: int) -> None:
        """A shorter context for requests admitted from now on (the memory ladder's last rung)."""
        check_count("n_ctx", n_ctx)
        self.engine.limit_context(n_ctx)

    def request(self, prompt_ids: list[int], max_tokens: int | None = None, stop=None, logprobs: int | None = None,
                ignore_eos: bool = False, constraint: Constraint | None = None, **params) -> GenerationRequest:
        """A checked GenerationRequest: every argument of the wrong type or out of range is a RequestError
        naming it; `max_tokens` is cut to what the context leaves after the prompt. `ignore_eos` runs to
        `max_tokens` past end-of-sequence tokens (benchmarks); `constraint`, what the text must match."""
        max_tokens = max_tokens if max_tokens is not None else self.loaded.sampling.get("max_tokens", 256)
        prompt_ids = self.truncated(prompt_ids) if self.overflow == "truncate" else prompt_ids
        check_flag("ignore_eos", ignore_eos)
        if constraint is not None and not isinstance(constraint, Constraint):
            raise RequestError(f"constraint must be a Constraint (or give json_schema, regex or grammar), "
                               f"got {type(constraint).__name__}")
        req = GenerationRequest(self.prompt_ids(prompt_ids), max_tokens, self.stops(stop), self.sampling(**params), logprobs,
                                ignore_eos, constraint)
        self.engine.check(req)
        req.max_tokens = min(req.max_tokens, self.engine.max_length - len(req.prompt_ids))
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

    def generate(self, prompt: str | list[int], max_tokens: int | None = None, stop=None, json_schema=None,
                 regex: str | None = None, grammar: str | None = None, constraint: Constraint | None = None,
                 **params) -> Iterator[Token]:
        """Stream tokens for a raw prompt (text, or token ids); each has .id, .text, .finish_reason. The
        request runs through the model's scheduling loop (streams generated at once are batched). The text
        can be held to a JSON schema, a regex or a grammar (Lark, or GBNF)."""
        constraint = constraint or constraint_of(json_schema, regex, grammar)
        return self.scheduler.run(self.request(self.prompt_ids(prompt), max_tokens, stop, constraint=constraint, **params))

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A raw prompt's token ids: text is tokenized (after a length check that needs no tokenizing),
        ids pass as they are (the request checks them)."""
        if isinstance(prompt, str):
            if self.overflow == "truncate":
                return self.truncated(self.tokenizer.encode(prompt[-self.context_length * self.tokenizer.max_token_chars:]))
            self.check_length(prompt)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            return prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            return [int(t) if isinstance(t, np.integer) else t for t in prompt]
        raise RequestError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")

    def check_length(self, text: str) -> None:
        self.check_characters(len(text), "a prompt")

    def check_characters(self, count: int, what: str) -> None:
        """PromptTooLong, from a character count alone, for text too long for any tokenization to fit
        the context (every token covers at most the vocabulary's longest piece)."""
        if count > self.engine.max_length * self.tokenizer.max_token_chars:
            raise PromptTooLong(f"{what} of {count} characters cannot fit the context of {self.engine.max_length} tokens")

    def complete(self, prompt: str | list[int], **params) -> str:
        return "".join(t.text for t in self.generate(prompt, **params))

    def template(self) -> ChatTemplate:
        if self.template_error is not None:
            raise self.template_error
        if self.chat_template is None:
            raise RequestError(f"model {self.id} has no chat template; use generate() with a raw prompt")
        return self.chat_template

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        check_flag("add_generation_prompt", add_generation_prompt)
        self.check_characters(characters(messages), "a conversation")
        return self.template().render(messages, add_generation_prompt)

    def turn(self, messages: list[dict], tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool = True,
             constraint: Constraint | None = None) -> Turn:
        """The prompt and constraint of the assistant's next reply (tools shown to the model, a call or a
        response format enforced, reasoning left free), and how to read the reply. The conversation's
        characters are counted before it is rendered: one that cannot fit is never built as a prompt."""
        check_messages(messages)
        check_flag("parallel_tool_calls", parallel_tool_calls)
        kept = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        while self.overflow == "truncate" and len(messages) - kept > 1:
            turn = self.turn_within_budget(messages, tools, tool_choice, parallel_tool_calls, constraint)
            if turn is not None:
                return turn
            rest = messages[kept + 1:]
            while len(rest) > 1 and rest[0].get("role") == "tool":     # a call's results go with it
                rest = rest[1:]
            messages = messages[:kept] + rest
        self.check_characters(characters(messages, tools), "a conversation")
        turn = Turn(self.template(), messages, tools, tool_choice, parallel_tool_calls, constraint)
        self.check_length(turn.text)
        return turn

    def truncated(self, ids: list[int]) -> list[int]:
        """A raw prompt's newest tokens, within PROMPT_SHARE of the context (a leading BOS kept)."""
        budget = int(self.context_length * PROMPT_SHARE)
        if not isinstance(ids, list) or len(ids) <= budget:
            return ids
        head = ids[:1] if ids[0] == self.tokenizer.bos_id else []
        return head + ids[len(ids) - budget + len(head):]

    def turn_within_budget(self, messages: list[dict], tools, *options) -> Turn | None:
        """The turn of these messages if its prompt takes at most PROMPT_SHARE of the context, else None
        (told from their characters, where they are too many, before rendering)."""
        budget = int(self.context_length * PROMPT_SHARE)
        if characters(messages, tools) > budget * self.tokenizer.max_token_chars:
            return None
        turn = Turn(self.template(), messages, tools, *options)
        if len(turn.text) > budget * self.tokenizer.max_token_chars or len(self.turn_ids(turn)) > budget:
            return None
        return turn

    def turn_ids(self, turn: Turn) -> list[int]:
        return self.tokenizer.encode(turn.text, add_special=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt tokens of a conversation, through the model's chat template."""
        return self.turn_ids(self.turn(messages))

    def chat(self, messages: list[dict], stream: bool = True, tools: ToolRegistry | list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True, max_tool_steps: int = 8, json_schema=None,
             regex: str | None = None, grammar: str | None = None, **params):
        """Apply the model's chat template and generate the assistant's reply (held to a JSON schema, a regex
        or a grammar if given; a thinking model's reasoning stays free). With a ToolRegistry, run the tool
        loop: calls are checked, run, and their results fed back until a reply calls none. Streams Tokens;
        `stream=False` gives the final reply's content (with a list of tools, the Reply: content, reasoning,
        tool_calls)."""
        check_flag("stream", stream)
        constraint = constraint_of(json_schema, regex, grammar)
        if isinstance(tools, ToolRegistry):
            loop = ToolLoop(self, messages, tools, tool_choice, parallel_tool_calls, max_tool_steps, constraint, params)
            return loop if stream else loop.final()
        turn = self.turn(messages, tools, tool_choice, parallel_tool_calls, constraint)
        tokens = self.generate(self.turn_ids(turn), constraint=turn.constraint, **params)
        if stream:
            return tokens
        reply = turn.read("".join(t.text for t in tokens))
        return reply if tools else reply.content

    def logits(self, prompt: str | list[int]) -> np.ndarray:
        """Next-token logits at every position of the prompt: [tokens, vocab] f32."""
        return self.engine.logits(self.prompt_ids(prompt))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids (of the model's vocabulary: any other is a RequestError), special tokens left out."""
        return self.tokenizer.decode(check_ids(ids, self.engine.cfg.vocab_size))

    def metrics(self) -> dict:
        """The latest request's: prefill and decode time and rate, tokens, peak memory, and with speculative
        decoding the drafts' acceptance rate and tokens per target step."""
        return self.engine.metrics.as_dict()

    def autotune(self) -> dict:
        """Time every kernel variant for this model's weight shapes on its backend and cache the choices."""
        engine = self.engine
        precision = Precision(engine.kv_dtype, engine.activations)
        return engine.prepare(precision, tune=True, force=True)

    def info(self) -> dict:
        cfg = self.loaded.config
        n_params = sum(int(np.prod(w.shape)) for w in self.loaded.weights.tensors.values())
        return {**super().info(), "model_type": cfg.model_type, "parameters": n_params, "layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                "vocab_size": cfg.vocab_size, "context": self.engine.n_ctx, "max_position": cfg.max_position,
                "kv_dtype": self.engine.kv_dtype, "activations": self.engine.activations, "gpu_layers": self.engine.device_layers,
                "tensor_parallel": 1 if self.engine.shard is None else self.engine.shard.ranks,
                "chat_template": self.chat_template is not None, "fusions": dict(self.engine.fusions)}


class EncoderModel(Model):
    """An encoder (BERT family): embeddings, and classification with the model's own or given labels."""

    task = "encode"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, encoder: Encoder):
        super().__init__(model_id, loaded, backend)
        self.encoder, self.tokenizer = encoder, loaded.tokenizer

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> EncoderModel:
        return cls(model_id, loaded, backend, Encoder(loaded.config, loaded.weights, loaded.tokenizer, loaded.pooling,
                                                      loaded.max_tokens, backend, precision.activations))

    @property
    def normalizes(self) -> bool:
        """Whether the model's embeddings are L2-normalized (a cut to fewer dimensions is renormalized)."""
        return self.loaded.pooling.normalize

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
            if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(label, str) for label in labels):
                raise RequestError("labels must be a non-empty list of strings")
            hypotheses = hypotheses_of(template, labels)
            entail = next((i for i, name in own.items() if name.lower().startswith("entail")), None)
            if entail is None:
                raise RequestError(f"model {self.id} is not an NLI model (no 'entailment' label); classify without labels")
            logits = self.encoder.classify([text] * len(labels), hypotheses, truncate=truncate)[:, entail]
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
        return self.tokenizer.hf.encode(check_text(text), add_special_tokens=True).ids

    def weight_bytes(self) -> int:
        return sum(int(w.nbytes) for w in self.encoder.weights.tensors.values())     # as run: bf16 copies

    def info(self) -> dict:
        cfg = self.loaded.config
        return {**super().info(), "model_type": cfg.model_type, "activations": self.encoder.precision,
                "parameters": sum(int(np.prod(w.shape)) for w in self.loaded.weights.tensors.values()),
                "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
                "max_tokens": self.encoder.max_tokens, "pooling": self.loaded.pooling.mode, "normalize": self.normalizes,
                "labels": [cfg.labels[i] for i in sorted(cfg.labels)], "fusions": dict(self.encoder.fusions)}


def hypotheses_of(template: str, labels: list[str]) -> list[str]:
    """Zero-shot hypotheses: `template` with each label in its "{}", as transformers' pipeline checks it."""
    try:
        hypotheses = [template.format(label) for label in labels] if isinstance(template, str) else None
    except (IndexError, KeyError, ValueError):
        hypotheses = None
    if hypotheses is None or hypotheses[0] == template:
        raise RequestError(f'template must be text with a "{{}}" where the label goes, got {reprlib.repr(template)}')
    return hypotheses


class GraphModel(Model):
    """A bare graph: named inputs in, named outputs out."""

    task = "graph"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner | FamilyRunner):
        super().__init__(model_id, loaded, backend)
        self.runner = runner

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> GraphModel:
        return cls(model_id, loaded, backend, graph_runner(loaded.graph, backend))

    @property
    def inputs(self) -> dict:
        """Input name -> TensorMeta (shape, symbolic dims included, and dtype)."""
        return self.runner.inputs

    @property
    def outputs(self) -> dict:
        return self.runner.outputs

    def run(self, inputs: dict, budget: RunBudget | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs by name, for arrays given by input name; every size the graph computes held to
        `budget` (the runner's default: engine.graph.DEFAULT_BUDGET) before it is allocated."""
        return self.runner.run(inputs, budget)

    def weight_bytes(self) -> int:
        graph = self.graph
        return sum(int(v.nbytes) for v in graph.constants.values()) if graph else 0

    @property
    def graph(self) -> Graph | None:
        """The graph run (for a family: the member run last; None before its first run)."""
        if isinstance(self.runner, GraphRunner):
            return self.runner.graph
        return next(reversed(self.runner.members.values())).graph if self.runner.members else None

    def info(self) -> dict:
        meta = lambda m: {"shape": [str(d) for d in m.shape], "dtype": m.dtype}
        return {**super().info(), **self.loaded.metadata, "inputs": {n: meta(m) for n, m in self.inputs.items()},
                "outputs": {n: meta(m) for n, m in self.outputs.items()},
                "ops": dict(sorted(Counter(n.op for n in self.graph.nodes).items())) if self.graph else {},
                "fusions": dict(self.runner.fusions)}


@dataclass
class Heard:
    """A recording to transcribe: the samples decoded (its speech, when VAD cut it), and how to map back."""
    samples: np.ndarray
    duration: float
    speech_map: SpeechMap | None

    def features(self, n_mels: int) -> np.ndarray:
        return features_of(self.samples, n_mels)

    def transcript(self, segments: list, language: str, probability: float) -> Transcript:
        for s in segments if self.speech_map else ():
            restore(s, self.speech_map)
        return Transcript("".join(s.text for s in segments).strip(), segments, language, probability, self.duration)


class SpeechModel(Model):
    """A speech recognizer (whisper): transcribe audio to text with timestamped segments."""

    task = "transcribe"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: WhisperRunner):
        super().__init__(model_id, loaded, backend)
        self.runner, self.tokenizer = runner, loaded.tokenizer
        self.tokens = WhisperTokens(loaded.tokenizer, loaded.config.vocab_size)
        begin = loaded.metadata.get("suppress_ids_begin", loaded.metadata.get("begin_suppress_tokens", [220, self.tokens.eot]))
        heads = loaded.metadata.get("alignment_heads")
        aligner = Aligner(loaded.config, loaded.weights, backend, heads) if heads else None
        self.transcriber = Transcriber(runner, self.tokens, tuple(begin), loaded.config.max_target_positions, aligner)
        self.vad: VoiceActivity | None = None

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> SpeechModel:
        return cls(model_id, loaded, backend, WhisperRunner(loaded.config, loaded.weights, backend, precision.activations))

    def transcribe(self, audio, language: str | None = None, beam_size: int = 5, word_timestamps: bool = False,
                   vad: bool | None = None, progress: bool | None = None, batch_size: int = 4,
                   **options) -> Transcript | list[Transcript]:
        """Text and timestamped segments of `audio` (a file path, its bytes, or 16 kHz mono samples), decoded
        as faster-whisper does (its options by name: temperature, best_of, patience, length_penalty,
        condition_on_previous_text, initial_prompt, no_speech_threshold, ...). `language`: the spoken
        language's code; detected from the first 30 s when a multilingual model is not told. `vad`: only the
        speech Silero VAD finds is transcribed (faster-whisper's VAD filter), by default beyond 30 s.
        A list of recordings gives a list of transcripts, `batch_size` of them decoding at once (each
        one's current window a part of every decoder step)."""
        opts = transcribe_options(beam_size=beam_size, word_timestamps=word_timestamps, **options)
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            raise RequestError(f"batch_size must be an integer in [1, {MAX_BATCH}], got {batch_size!r}")
        many = isinstance(audio, (list, tuple))
        if many and not audio:
            raise RequestError("transcribe a recording, or a list of one or more")
        heard = [self.heard(a, vad) for a in (audio if many else [audio])]
        found = [[] for _ in heard]
        with tqdm(total=round(sum(len(h.samples) for h in heard) / SAMPLE_RATE, 2), unit="s", desc="transcribing",
                  delay=1.0, leave=False, disable=None if progress is None else not progress) as bar:
            done = [0.0] * len(heard)

            def advancer(i: int):
                def advance(seconds: float) -> None:
                    done[i] = seconds
                    bar.update(round(sum(done), 2) - bar.n)
                return advance
            jobs = [(i, h.features(self.loaded.config.num_mel_bins)) for i, h in enumerate(heard) if len(h.samples)]
            spoken = [(i, *self.language(f, language)) for i, f in jobs]
            decoded = self.transcriber.many([(f, opts, lang, advancer(i)) for (i, f), (_, lang, _) in zip(jobs, spoken)],
                                            batch_size)
            for j, segment in decoded:
                found[jobs[j][0]].append(segment)
        languages = {i: (lang, p) for i, lang, p in spoken}
        transcripts = [h.transcript(segments, *languages.get(i, (language or "en", 0.0)))
                       for i, (h, segments) in enumerate(zip(heard, found))]
        return transcripts if many else transcripts[0]

    def heard(self, audio, vad: bool | None) -> Heard:
        """A recording's samples, cut to its speech where `vad` says (by default beyond 30 s)."""
        samples = load_audio(audio)
        duration = len(samples) / SAMPLE_RATE
        if vad or (vad is None and duration > VAD_BEYOND_SECONDS):
            chunks = self.voice_activity().segments(samples, **VAD_OPTIONS)
            return Heard(speech_only(samples, chunks), duration, SpeechMap(chunks, SAMPLE_RATE))
        return Heard(samples, duration, None)

    def voice_activity(self) -> VoiceActivity:
        """Silero VAD (the silero-vad package's ONNX graph), run through the runtime; loaded once."""
        if self.vad is None:
            loaded = loaders.load(package_file("silero_vad", os.path.join("data", "silero_vad.onnx")))
            self.vad = VoiceActivity(GraphModel.open("silero-vad", loaded, self.backend, None, None, None, False))
        return self.vad

    def language(self, features: np.ndarray, language: str | None) -> tuple[str, float]:
        if not self.tokens.multilingual:
            if language not in (None, "en"):
                raise RequestError(f"this model is English-only; language {language!r} is not available")
            return "en", 1.0
        if language is None:
            language, probs = self.transcriber.detect_language(features)
            return language, probs[language]
        if language not in self.tokens.languages:
            raise RequestError(f"unknown language {language!r}; one of {', '.join(self.tokens.languages)}")
        return language, 1.0


def transcribe_options(**options) -> TranscribeOptions:
    """faster-whisper's options by name, checked (a temperature may be one value or a fallback list)."""
    unknown = set(options) - set(TranscribeOptions.__dataclass_fields__) - {"temperature"}
    if unknown:
        raise RequestError(f"unknown transcription options: {', '.join(sorted(unknown))}")
    if "temperature" in options:
        t = options.pop("temperature")
        options["temperatures"] = tuple(t) if isinstance(t, (list, tuple)) else (t,)
    return TranscribeOptions(**options)


class VoiceModel(GraphModel):
    """A voice (piper): text to speech. Its graph stays runnable as a graph's (`run`)."""

    task = "speak"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner | FamilyRunner):
        super().__init__(model_id, loaded, backend, runner)
        self.voice = Voice(runner, VoiceConfig.from_piper(loaded.metadata["voice"], loaded.path + ".json"))

    @property
    def sample_rate(self) -> int:
        return self.voice.config.sample_rate

    def speak(self, text: str, speaker=None, speed: float = 1.0, stream: bool = False, **scales):
        """int16 samples of `text` said by the voice, and its rate; with `stream`, an iterator of each
        sentence's samples as it is made. `speaker`: a name or id (multi-speaker voices); `speed` scales the
        voice's pace; `noise_scale`, `noise_w` override the voice's own."""
        check_flag("stream", stream)
        unknown = set(scales) - {"noise_scale", "noise_w"}
        if unknown:
            raise RequestError(f"unknown speech options: {', '.join(sorted(unknown))}")
        sentences = self.voice.speak(text, speaker, speed, **scales)
        if stream:
            return sentences
        return np.concatenate([np.zeros(0, np.int16), *sentences]), self.sample_rate


TASKS = {"generate": TextModel, "encode": EncoderModel, "graph": GraphModel, "transcribe": SpeechModel, "speak": VoiceModel}


@dataclass
class Reply:
    """What a speech pipeline heard, what it answered, and the answer spoken."""
    heard: Transcript
    text: str
    samples: np.ndarray
    rate: int


PIPELINE_SETS = {"transcribe": ("audio",), "chat": ("messages", "stream", "max_tokens"), "speak": ("text",)}


class Pipeline:
    """Speech in, speech out: the recognizer's transcript is the user's turn for the chat model, whose reply
    the voice says. Each stage's output is the next one's input; the stages keep their own options."""

    def __init__(self, asr: SpeechModel, llm: TextModel, tts: VoiceModel, system: str | None = None):
        for model, task in ((asr, "transcribe"), (llm, "generate"), (tts, "speak")):
            if not isinstance(model, Model) or model.task != task:
                got = f"{model.id} runs the {model.task} task" if isinstance(model, Model) else f"got a {type(model).__name__}"
                raise RequestError(f"{got}; this stage needs a {task} model")
        if not (system is None or isinstance(system, str)):
            raise RequestError(f"system must be text, got {type(system).__name__}")
        self.asr, self.llm, self.tts, self.system = asr, llm, tts, system

    def __call__(self, audio, max_tokens: int = 256, transcribe: dict | None = None, chat: dict | None = None,
                 speak: dict | None = None) -> Reply:
        """`transcribe`, `chat` and `speak`: each stage's own options, by name (but those the pipeline sets)."""
        for name, options in (("transcribe", transcribe), ("chat", chat), ("speak", speak)):
            if options is None:
                continue
            if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
                raise RequestError(f"{name} options must be a dict of its arguments by name, got {reprlib.repr(options)}")
            if set(options) & set(PIPELINE_SETS[name]):
                raise RequestError(f"{name} options cannot set {', '.join(PIPELINE_SETS[name])}: the pipeline does")
        heard = self.asr.transcribe(audio, **(transcribe or {}))
        if not heard.text:
            raise RequestError("no speech was heard in the audio")
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": heard.text}]
        text = self.llm.chat(messages, stream=False, max_tokens=max_tokens, **(chat or {})).strip()
        samples, rate = self.tts.speak(text or "...", **(speak or {}))
        return Reply(heard, text, samples, rate)
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
