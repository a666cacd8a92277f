"""OpenAI's wire format: request bodies validated into engine requests, responses and stream chunks.

Structured output (`response_format`; llama.cpp's `grammar` and `json_schema` on completions) and tools
(`tools`, `tool_choice`, `parallel_tool_calls`; replies with `tool_calls`, streamed as deltas) are acted
on, and so are llama.cpp's sampling extensions (top_k, min_p, repeat_penalty, repeat_last_n),
transformers' `repetition_penalty` and SPEC's `preset`. A field that would change the tokens and is not
acted on is refused with a 400 naming it, never ignored; only OpenAI's bookkeeping fields (IGNORED: who
asked, what to store) are accepted and left unused, so existing clients work unchanged.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from soma_runtime.context import Context
from soma_runtime.engine.generate import MAX_TOP_K, PRESETS, SEED_LIMIT, GenerationRequest, Token
from soma_runtime.engine.grammar import Constraint, constraint_of
from soma_runtime.errors import RequestError
from soma_runtime.tasks import TextModel
from soma_runtime.tools.turn import ReplyStream, Turn

ARGUMENT_FRAGMENT = 32        # characters of a streamed call's arguments per chunk
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repetition_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty", "preset")


class Sampling(BaseModel):
    """The sampling fields both completion routes take. Strict: `true` or `2.5` is no token count; a field
    it does not know is refused (parse() names it). `lora` (an extension, as llama.cpp's server has one): the
    adapter to run under, by name or {name, scale}."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, le=1e6)
    repetition_penalty: float | None = Field(None, gt=0, le=1e6)
    repeat_last_n: int | None = Field(None, ge=-1, lt=MAX_TOP_K)
    preset: Literal[tuple(PRESETS)] | None = None
    logit_bias: dict | None = None       # OpenAI's; only an empty one is taken (no bias is applied)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-1, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    response_format: dict | None = None
    ignore_eos: bool = False             # llama.cpp's: run to max_tokens past end-of-sequence tokens
    lora: str | dict | None = None
    _turn: Turn | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def drop_ignored(cls, body):
        """OpenAI's bookkeeping fields go before validation; any other unknown field is then refused."""
        return {k: v for k, v in body.items() if k not in IGNORED} if isinstance(body, dict) else body

    @property
    def turn(self) -> Turn | None:
        """The chat turn the request became (its reply is read through it), once engine_requests ran."""
        return self._turn

    def format_constraint(self) -> Constraint | None:
        """`response_format`: text, json_object (llama.cpp: with an optional `schema`), or json_schema."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return Constraint.json_schema(fmt["schema"]) if fmt.get("schema") is not None else constraint_of(json_object=True)
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or spec.get("schema") is None:
                raise RequestError("response_format json_schema needs {json_schema: {name, schema}}")
            return Constraint.json_schema(spec["schema"])
        raise RequestError(f"response_format type must be text, json_object or json_schema, got {fmt.get('type')!r}")

    def requests(self, model: TextModel, prompt_ids: list[int], logprobs: int | None,
                 default_max: int | None, constraint: Constraint | None = None) -> list[GenerationRequest]:
        """One engine request per choice; with a seed, choice i draws from seed + i (-1: unseeded, as llama.cpp)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logit_bias:
            raise RequestError("logit_bias: not supported by this server (only an empty one is accepted)")
        params = {k: getattr(self, k) for k in SAMPLING}
        max_tokens = self.max_tokens or default_max or model.context_length       # cut to what the context leaves
        seeded = self.seed is not None and self.seed != -1
        adapter = self.adapter()
        return [model.request(prompt_ids, max_tokens, self.stop, logprobs=logprobs, constraint=constraint,
                              ignore_eos=self.ignore_eos, seed=(self.seed + i) % SEED_LIMIT if seeded else None,
                              **adapter, **params)
                for i in range(self.n)]

    def adapter(self) -> dict:
        """The engine request's adapter fields from `lora`: an adapter's name, or {name, scale}."""
        if self.lora is None or isinstance(self.lora, str):
            return {} if self.lora is None else {"lora": self.lora}
        if set(self.lora) - {"name", "scale"} or not isinstance(self.lora.get("name"), str):
            raise RequestError(f"lora must be an adapter's name or {{name, scale}}, got the fields {sorted(self.lora)}")
        return {"lora": self.lora["name"], "lora_scale": self.lora.get("scale", 1.0)}

    def adapter_in_name(self, models) -> str:
        """The served model's id: a `base:adapter` name (of no model of that id) is the model `base` running
        under the adapter, as vLLM's and llama.cpp's servers take it."""
        base, _, adapter = self.model.rpartition(":")
        if self.model in models or not base or base not in models:
            return self.model
        if self.lora is not None:
            raise RequestError(f"model {self.model!r} names an adapter and so does `lora`: give one")
        self.lora = adapter
        return base

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict] | None = None

    def as_dict(self) -> dict:
        """Content parts ([{type: text, text}]) joined into the plain text chat templates expect."""
        content = self.content
        if isinstance(content, list):
            texts = [part.get("text") for part in content if part.get("type") == "text"]
            if not all(isinstance(text, str) for text in texts):
                raise RequestError("a message's text content part must be {type: text, text: <string>}")
            content = "".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    session: str | None = None            # a conversation the server keeps: its context renders the prompt
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def engine_requests(self, model: TextModel) -> list[GenerationRequest]:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        self._turn = model.turn([m.as_dict() for m in self.messages], self.tools, self.tool_choice, self.parallel_tool_calls,
                               self.format_constraint())
        return self.requests(model, model.turn_ids(self._turn), (self.top_logprobs or 0) if self.logprobs else None, None,
                             self._turn.constraint)

    def session_requests(self, model: TextModel, context: Context) -> list[GenerationRequest]:
        """The request's messages added to a session's context (a system message replaces its system prompt;
        all or none of them), and the engine request of the reply to it."""
        if self.tools is not None or self.n != 1:
            raise RequestError("a request on a session takes no tools and one choice (n = 1)")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        saved = context.state()
        try:
            for m in self.messages:
                message = m.as_dict()
                role, content = message.pop("role"), message.pop("content")
                if role == "system":
                    context.set_system(content)
                elif role == "tool":
                    context.inject_tool_result(message.get("name") or "tool", content)
                else:
                    context.add_message(role, content, **message)
        except BaseException:
            context.restore(saved)
            raise
        return self.requests(model, context.ids(), (self.top_logprobs or 0) if self.logprobs else None, None,
                             self.format_constraint())


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = 16          # OpenAI's default for completions
    grammar: str | None = None           # llama.cpp's: GBNF (or Lark)
    json_schema: dict | None = None      # llama.cpp's
    regex: str | None = None

    def prompt_ids(self, model: TextModel) -> list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError("one prompt per request (send a batch as separate requests; they run batched)")
            prompt = prompt[0]
        return model.prompt_ids(prompt)

    def engine_requests(self, model: TextModel) -> list[GenerationRequest]:
        given = constraint_of(self.json_schema, self.regex, self.grammar)
        formatted = self.format_constraint()
        if given is not None and formatted is not None:
            raise RequestError("give response_format or grammar/json_schema/regex, not both")
        return self.requests(model, self.prompt_ids(model), self.logprobs, 16, given or formatted)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Choice:
    """One choice being generated: its text, logprobs and finish, in chat or completion shape."""

    def __init__(self, index: int, model: TextModel, chat: bool, turn: Turn | None = None):
        self.index, self.model, self.chat, self.turn = index, model, chat, turn
        self.text, self.tokens, self.finish_reason = "", 0, None
        self.logprobs: list[tuple[Token, str]] = []
        self.reader = ReplyStream(turn) if turn is not None and (turn.calls is not None or turn.thinks) else None
        self.calls = 0

    def piece(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])

    def add(self, token: Token) -> None:
        self.text += token.text
        self.tokens += 1
        self.finish_reason = token.finish_reason or self.finish_reason
        if token.logprob is not None:
            self.logprobs.append((token, self.piece(token.id)))

    def logprobs_json(self, entries: list[tuple[Token, str]]) -> dict | None:
        if not entries:
            return None
        if self.chat:
            def entry(token_id, piece, logprob):
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
            return {"content": [{**entry(t.id, piece, t.logprob),
                                 "top_logprobs": [entry(i, self.piece(i), lp) for i, lp in t.top_logprobs]}
                                for t, piece in entries]}
        return {"tokens": [piece for _, piece in entries], "token_logprobs": [t.logprob for t, _ in entries],
                "top_logprobs": [{self.piece(i): lp for i, lp in t.top_logprobs} for t, _ in entries]}

    def final(self) -> dict:
        if not self.chat:
            body, finish = {"text": self.text}, self.finish_reason
        else:
            body, finish = self.message()
        return {"index": self.index, **body, "logprobs": self.logprobs_json(self.logprobs), "finish_reason": finish}

    def message(self) -> tuple[dict, str | None]:
        """The chat reply, read as reasoning, content and tool calls; its finish reason."""
        if self.turn is None:
            return {"message": {"role": "assistant", "content": self.text}}, self.finish_reason
        reply = self.turn.read(self.text)
        message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [c.as_openai() for c in reply.tool_calls]
        finish = "tool_calls" if reply.tool_calls and self.finish_reason == "stop" else self.finish_reason
        return {"message": message}, finish

    def deltas(self, token: Token) -> list[dict]:
        """The stream chunks' choices for one token: its text, or (reading reasoning and tool calls) the
        pieces it completes; calls come whole at the end, id and name first, then the arguments in fragments."""
        entries = [(token, self.piece(token.id))] if token.logprob is not None else []
        logprobs = self.logprobs_json(entries)
        if self.reader is None:
            body = {"delta": {"content": token.text}} if self.chat else {"text": token.text}
            return [{"index": self.index, **body, "logprobs": logprobs, "finish_reason": token.finish_reason}]
        pieces = self.reader.feed(token.text) + (self.reader.finish() if token.finish_reason else [])
        deltas = []
        for kind, value in pieces:
            if kind == "call":
                deltas += self.call_deltas(value)
            else:
                deltas.append({"reasoning_content" if kind == "reasoning" else "content": value})
        if token.finish_reason:
            finish = "tool_calls" if self.calls and token.finish_reason == "stop" else token.finish_reason
            deltas.append({"finish": finish})
        return [{"index": self.index, "delta": {} if "finish" in d else d, "logprobs": logprobs if i == 0 else None,
                 "finish_reason": d.get("finish")} for i, d in enumerate(deltas)]

    def call_deltas(self, call) -> list[dict]:
        index, self.calls = self.calls, self.calls + 1
        head = {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
        args = call.arguments
        return [head] + [{"tool_calls": [{"index": index, "function": {"arguments": args[i:i + ARGUMENT_FRAGMENT]}}]}
                         for i in range(0, len(args), ARGUMENT_FRAGMENT)]


def envelope(kind: Literal["chat", "text"], stream: bool, request_id: str, model_id: str, created: int | None = None) -> dict:
    obj = {"chat": "chat.completion", "text": "text_completion"}[kind] + (".chunk" if stream and kind == "chat" else "")
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model_id}
