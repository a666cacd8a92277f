"""The context routes (SPEC "daemon API"): `/v1/context/{show,tokens,blocks,budget,clear,compress,save,load}`,
each a POST naming a `session` (one a chat request started, or `load` restores). An unknown session is a
404; a saved session travels in the bodies (save answers it, load takes it), never as a file on the server."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from soma_runtime.context import BUDGETED
from soma_runtime.server.http import ServerState, parse
from soma_runtime.server.sessions import Session


class SessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    session: str


class BudgetBody(SessionBody):
    block: Literal[BUDGETED]
    tokens: int | None


class ClearBody(SessionBody):
    what: Literal["history", "all", "session"] = "history"


class LoadBody(SessionBody):
    model: str
    state: dict


def blocks(session: Session) -> dict:
    return {"session": session.id, "model": session.model_id, **session.context.report()}


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()
    sessions = state.sessions

    async def session_of(request: Request, schema=SessionBody) -> tuple[Session, BaseModel]:
        body = await parse(request, schema)
        return sessions.get(body.session), body

    @routes.post("/v1/context/show")
    async def show(request: Request):
        session, _ = await session_of(request)
        text = await run_in_threadpool(session.change, session.context.show)
        return {"session": session.id, "model": session.model_id, "text": text, "tokens": session.context.tokens()}

    @routes.post("/v1/context/tokens")
    async def tokens(request: Request):
        session, _ = await session_of(request)
        count = await run_in_threadpool(session.change, session.context.tokens)
        return {"session": session.id, "tokens": count, "limit": session.context.limit, "window": session.context.window}

    @routes.post("/v1/context/blocks")
    async def list_blocks(request: Request):
        session, _ = await session_of(request)
        return await run_in_threadpool(session.change, blocks, session)

    @routes.post("/v1/context/budget")
    async def budget(request: Request):
        session, body = await session_of(request, BudgetBody)
        await run_in_threadpool(session.change, session.context.set_budget, body.block, body.tokens)
        return await run_in_threadpool(session.change, blocks, session)

    @routes.post("/v1/context/clear")
    async def clear(request: Request):
        session, body = await session_of(request, ClearBody)
        if body.what == "session":
            sessions.drop(session.id)
            return {"session": session.id, "deleted": True}
        await run_in_threadpool(session.change, session.context.clear_history if body.what == "history" else
                                session.context.reset)
        return await run_in_threadpool(session.change, blocks, session)

    @routes.post("/v1/context/compress")
    async def compress(request: Request):
        session, _ = await session_of(request)
        served = state.model(session.model_id, "generate", "its session's model is not a text model")   # still served
        await run_in_threadpool(sessions.open, session.id, served.id, served.model)    # summarizing with the model served now
        await run_in_threadpool(session.change, session.context.compress)
        return await run_in_threadpool(session.change, blocks, session)

    @routes.post("/v1/context/save")
    async def save(request: Request):
        session, _ = await session_of(request)
        return await run_in_threadpool(session.change, session.context.state)

    @routes.post("/v1/context/load")
    async def load(request: Request):
        body = await parse(request, LoadBody)
        served = state.model(body.model, "generate", "a session is a conversation with a text model")
        session = await run_in_threadpool(sessions.replace, body.session, served.id, served.model, body.state)
        return await run_in_threadpool(session.change, blocks, session)

    return routes
