"""The `generate` task's routes: `/v1/chat/completions` and `/v1/completions`, OpenAI's wire format,
streamed as server-sent events or answered whole. Requests go to the model's scheduling loop; tokens
come back from its thread into this event loop. A client that leaves, streaming or not, cancels its
jobs, whose KV pages are freed at the next step. A chat request naming a `session` adds its messages to
that conversation's context, generates from the context's prompt, and adds the reply once it is whole."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from soma_runtime.server import openai
from soma_runtime.server.http import Overloaded, ServerState, disconnected, parse
from soma_runtime.server.metrics import ServerMetrics
from soma_runtime.server.registry import Served

log = logging.getLogger("soma_runtime.server")
GONE = object()             # queued when a non-streaming request's client disconnects


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class Generation:
    """A request's jobs on one model's scheduler, with their tokens as an async stream of (choice, Token)."""

    def __init__(self, served: Served, reqs, metrics: ServerMetrics, max_queue: int):
        scheduler = served.scheduler
        if scheduler.queue_depth + len(reqs) > max_queue:
            raise Overloaded(f"{scheduler.queue_depth} requests are queued for {served.id}; try again shortly")
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.served, self.metrics, self.jobs = served, metrics, []
        try:
            for i, req in enumerate(reqs):
                receive = lambda item, i=i: loop.call_soon_threadsafe(self.queue.put_nowait, (i, item))
                self.jobs.append(scheduler.submit(req, receive))
        except BaseException:
            self.cancel()
            raise
        self.prompt_tokens = len(reqs[0].prompt_ids)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    @property
    def cached_tokens(self) -> int:
        stream = self.jobs[0].stream
        return stream.metrics.cached_tokens if stream is not None else 0

    async def tokens(self, request: Request | None = None) -> AsyncIterator:
        """(choice index, Token) until every job ends; with `request`, until its client leaves too."""
        watch = asyncio.ensure_future(self.watch(request)) if request else None
        open_jobs, first = len(self.jobs), True
        try:
            while open_jobs:
                i, item = await self.queue.get()
                if item is GONE:
                    return
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    open_jobs -= 1
                    continue
                if first:
                    self.metrics.first_token(self.served.id, self.jobs[i].first_token_s or 0.0)
                    first = False
                yield i, item
        finally:
            if watch is not None:
                watch.cancel()
            self.cancel()                     # no-op for finished jobs; frees the pages of the rest

    async def watch(self, request: Request) -> None:
        await disconnected(request)
        self.queue.put_nowait((None, GONE))


async def complete(state: ServerState, request: Request, schema, chat: bool):
    body = await parse(request, schema)
    served = state.model(body.adapter_in_name(state.registry.models), "generate",
                         "use /v1/embeddings, /v1/classifications or /v1/run")
    session = None
    if chat and body.session is not None:         # off the event loop: it may wait for the session's lock
        session = await run_in_threadpool(state.sessions.open, body.session, served.id, served.model)
    if session is None:
        reqs = await run_in_threadpool(body.engine_requests, served.model)
    else:
        reqs = await run_in_threadpool(session.change, body.session_requests, served.model, session.context)
    gen = Generation(served, reqs, state.metrics, state.max_queue)
    rid = openai.new_id("chatcmpl" if chat else "cmpl")
    choices = [openai.Choice(i, served.model, chat, body.turn) for i in range(len(reqs))]
    head = openai.envelope("chat" if chat else "text", body.stream, rid, served.id)
    echo = getattr(body, "echo", False) and served.model.detokenize(reqs[0].prompt_ids)
    if echo:
        for c in choices:
            c.text = echo
    if not body.stream:
        async for i, token in gen.tokens(request):
            choices[i].add(token)
        if any(c.finish_reason is None for c in choices):      # the client left
            return PlainTextResponse("", status_code=499)
        if session is not None:
            await run_in_threadpool(session.change, session.context.add_message, "assistant", choices[0].text)
        return {**head, "choices": [c.final() for c in choices],
                "usage": openai.usage(gen.prompt_tokens, sum(c.tokens for c in choices), gen.cached_tokens)}

    async def events():
        if chat:
            for c in choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        elif echo:
            for c in choices:
                yield sse({**head, "choices": [{"index": c.index, "text": echo, "logprobs": None, "finish_reason": None}]})
        try:
            async for i, token in gen.tokens():
                choices[i].add(token)
                for delta in choices[i].deltas(token):
                    yield sse({**head, "choices": [delta]})
            if session is not None:
                await run_in_threadpool(session.change, session.context.add_message, "assistant", choices[0].text)
        except Exception as exc:              # headers are gone: the error travels as the last event
            log.exception("generation failed mid-stream")
            yield sse(openai.error_body(state.scrub(str(exc)), "server_error"))
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": openai.usage(gen.prompt_tokens, sum(c.tokens for c in choices),
                                                                    gen.cached_tokens)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(state, request, openai.ChatRequest, chat=True)

    @routes.post("/v1/completions")
    async def completions(request: Request):
        return await complete(state, request, openai.CompletionRequest, chat=False)

    return routes
