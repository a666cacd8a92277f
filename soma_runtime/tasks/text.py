"""The generate task: TextModel, a text generator (decoder LLM) with generate, chat and logits."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from soma_runtime import loaders, parallel, schedule
from soma_runtime.architectures.shard import check_split
from soma_runtime.context import Context
from soma_runtime.engine.generate import (
    Drafter,
    DraftModel,
    Engine,
    GenerationRequest,
    PromptLookup,
    SamplingParams,
    Scheduler,
    Token,
    check_stops,
    sampling_preset,
)
from soma_runtime.engine.grammar import Constraint, constraint_of
from soma_runtime.errors import ModelLoadError, PromptTooLong, RequestError
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.loaders.lora import adapter_name, read_lora
from soma_runtime.quant import kv
from soma_runtime.tasks.base import Model, check_count, check_flag
from soma_runtime.text.chat import ChatTemplate, characters, check_messages
from soma_runtime.text.tokenizer import check_ids
from soma_runtime.tools.loop import ToolLoop
from soma_runtime.tools.registry import ToolRegistry
from soma_runtime.tools.turn import Turn

SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}
ALIASES = {"repetition_penalty": "repeat_penalty"}
LIBRARY_BATCH = 16          # streams the library's loop runs together (generators consumed side by side)
OVERFLOWS = ("error", "truncate", "slide")   # what a text model does with a prompt beyond its context
MAX_LORAS = 8               # adapters a model holds at once unless load_lora says
SUMMARY_PROMPT = ("Summarize the conversation below in a few sentences for the assistant to carry on from it. "
                  "Keep names, numbers, facts, decisions and open questions.")
PROMPT_SHARE = 0.75         # a truncated prompt takes at most this share of the context; the rest is the reply's
log = logging.getLogger("soma_runtime")


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
        return DraftModel(self.engine.first_layers(int(layers)), adapters=True)

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

    def load_lora(self, path: str, alpha: float = 1.0, name: str | None = None, max_loras: int = MAX_LORAS) -> dict:
        """Load a LoRA adapter, a PEFT directory (adapter_config.json + adapter_model.safetensors) or a
        llama.cpp GGUF LoRA file, for this model's requests to run under by its `name` (default: the
        directory's or file's name), its update scaled by `alpha` (1: as trained). The first one rebuilds
        the model's graphs with an adapter op beside each linear layer, for up to `max_loras` adapters at
        once (4 times as many held in memory, put in a slot when a request runs under one); requests already
        running go on. ModelLoadError for an adapter that does not fit the base (naming the module),
        RequestError where the name is taken or the model holds all it may."""
        if self.engine.lora is not None:          # refused before its files are read
            self.engine.lora.check_room(adapter_name(path, name))
        adapter = read_lora(path, self.engine.cfg, self.engine.weights, name, alpha)
        self.engine.enable_lora(max_loras).add(adapter)
        return next(entry for entry in self.list_loras() if entry["name"] == adapter.name)

    def unload_lora(self, name: str) -> None:
        """Requests can no longer pick the adapter; those running under it finish under it."""
        self.engine.adapters(name).remove(name)

    def list_loras(self) -> list[dict]:
        """The loaded adapters: name, alpha, rank, params, source, modules."""
        return [] if self.engine.lora is None else self.engine.lora.listing()

    def request(self, prompt_ids: list[int], max_tokens: int | None = None, stop=None, logprobs: int | None = None,
                ignore_eos: bool = False, constraint: Constraint | None = None, lora: str | None = None,
                lora_scale: float = 1.0, **params) -> GenerationRequest:
        """A checked GenerationRequest: every argument of the wrong type or out of range is a RequestError
        naming it; `max_tokens` is cut to what the context leaves after the prompt. `ignore_eos` runs to
        `max_tokens` past end-of-sequence tokens (benchmarks); `constraint`, what the text must match;
        `lora`, the loaded adapter it runs under, at `lora_scale`."""
        max_tokens = max_tokens if max_tokens is not None else self.loaded.sampling.get("max_tokens", 256)
        prompt_ids = self.truncated(prompt_ids) if self.overflow == "truncate" else prompt_ids
        check_flag("ignore_eos", ignore_eos)
        if constraint is not None and not isinstance(constraint, Constraint):
            raise RequestError(f"constraint must be a Constraint (or give json_schema, regex or grammar), "
                               f"got {type(constraint).__name__}")
        req = GenerationRequest(self.prompt_ids(prompt_ids), max_tokens, self.stops(stop), self.sampling(**params), logprobs,
                                ignore_eos, constraint, lora, lora_scale)
        self.engine.check(req)
        req.max_tokens = min(req.max_tokens, self.engine.max_length - len(req.prompt_ids))
        return req

    def sampling(self, preset: str | None = None, **params) -> SamplingParams:
        """The model's sampling defaults overridden by a `preset`'s (router, code, reasoning, creative), then
        by `params` (OpenAI or llama.cpp names; one parameter under both names is an error)."""
        given = {k: v for k, v in params.items() if v is not None}
        unknown = set(given) - SAMPLING_FIELDS - set(ALIASES)
        if unknown:
            raise RequestError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        both = [f"{alias} and {name}" for alias, name in ALIASES.items() if alias in given and name in given]
        if both:
            raise RequestError(f"give one of {both[0]}: they are the same parameter")
        given = {ALIASES.get(k, k): v for k, v in given.items()}
        defaults = {k: v for k, v in self.loaded.sampling.items() if k in SAMPLING_FIELDS}
        chosen = sampling_preset(preset) if preset is not None else {}
        return SamplingParams(**{**defaults, **chosen, **given}).validate()

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

    def context(self, reply_tokens: int | None = None, summarizer: TextModel | None = None) -> Context:
        """A conversation's context for this model (one per conversation): blocks with budgets in its tokens,
        rendered through its chat template; `reply_tokens` of the context are kept for the reply. `chat(context)`
        generates from it and appends the reply. With a `summarizer` (this model, or a smaller one), old
        history is compressed into a summary (`compress()`, and on its own past half the window)."""
        if summarizer is not None and not isinstance(summarizer, TextModel):
            raise RequestError(f"summarizer must be a text model, got {type(summarizer).__name__}")
        return Context(self.template(), self.tokenizer, self.context_length, reply_tokens, self.id,
                       summarizer.summarize if summarizer is not None else None)

    def summarize(self, transcript: str, max_tokens: int) -> str:
        """A summary of a conversation's transcript, greedy, in at most `max_tokens`."""
        messages = [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": transcript}]
        return self.chat(messages, stream=False, temperature=0, max_tokens=max_tokens)

    def chat(self, messages: list[dict] | Context, stream: bool = True, tools: ToolRegistry | list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True, max_tool_steps: int = 8, json_schema=None,
             regex: str | None = None, grammar: str | None = None, **params):
        """Apply the model's chat template and generate the assistant's reply (held to a JSON schema, a regex
        or a grammar if given; a thinking model's reasoning stays free). With a ToolRegistry, run the tool
        loop: calls are checked, run, and their results fed back until a reply calls none. Streams Tokens;
        `stream=False` gives the final reply's content (with a list of tools, the Reply: content, reasoning,
        tool_calls). Given a Context (`model.context()`), the prompt is its `ids()` and the reply, once
        whole, is added to it."""
        check_flag("stream", stream)
        constraint = constraint_of(json_schema, regex, grammar)
        if isinstance(messages, Context):
            if tools is not None:
                raise RequestError("a Context takes tool results through inject_tool_result; give tools with messages")
            replying = self.replying(messages, self.generate(messages.ids(), constraint=constraint, **params))
            return replying if stream else "".join(t.text for t in replying)
        if isinstance(tools, ToolRegistry):
            loop = ToolLoop(self, messages, tools, tool_choice, parallel_tool_calls, max_tool_steps, constraint, params)
            return loop if stream else loop.final()
        turn = self.turn(messages, tools, tool_choice, parallel_tool_calls, constraint)
        tokens = self.generate(self.turn_ids(turn), constraint=turn.constraint, **params)
        if stream:
            return tokens
        reply = turn.read("".join(t.text for t in tokens))
        return reply if tools else reply.content

    @staticmethod
    def replying(context: Context, tokens: Iterator[Token]) -> Iterator[Token]:
        """The reply's tokens; once they end, the reply is the context's newest assistant message."""
        text = ""
        for token in tokens:
            text += token.text
            yield token
        context.add_message("assistant", text)

    def logits(self, prompt: str | list[int], lora: str | None = None, lora_scale: float = 1.0) -> np.ndarray:
        """Next-token logits at every position of the prompt: [tokens, vocab] f32 (under an adapter, where named)."""
        return self.engine.logits(self.prompt_ids(prompt), lora, lora_scale)

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
                "chat_template": self.chat_template is not None, "fusions": dict(self.engine.fusions),
                "loras": [entry["name"] for entry in self.list_loras()]}
