"""The server's conversations (SPEC "daemon API", /v1/context/*): a Context per session id, started by the
first chat request that names the id (or by loading a saved one), for the model it started on (a model
hot-swapped under that id takes the session on if it tokenizes and templates the same; else the session
is refused).

Owns the ids, the model each is for, and a lock per session that makes each change to its context whole
(two requests on one session at once interleave their turns, each turn whole). Knows Context and the
text model a session renders for; nothing of routes or the wire format.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from soma_runtime.context import Context, identity
from soma_runtime.errors import RequestError, SomaError
from soma_runtime.tasks import TextModel

SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_SESSIONS = 1024


class SessionNotFound(SomaError):
    pass


class TooManySessions(SomaError):
    pass


@dataclass
class Session:
    id: str
    model_id: str
    model: TextModel
    context: Context
    lock: threading.Lock = field(default_factory=threading.Lock)

    def change(self, method, *args, **kwargs):
        """`method` (of its context, or one that takes it) run whole, no other change to the session meanwhile."""
        with self.lock:
            return method(*args, **kwargs)


class Sessions:
    def __init__(self, limit: int = MAX_SESSIONS):
        self.limit = limit
        self.by_id: dict[str, Session] = {}
        self.lock = threading.Lock()

    def get(self, session_id: str) -> Session:
        """The session `session_id`; SessionNotFound if none has that id."""
        check_id(session_id)
        session = self.by_id.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} does not exist; a chat request with \"session\": "
                                  f"{session_id!r} starts it, /v1/context/load restores a saved one")
        return session

    def open(self, session_id: str, model_id: str, model: TextModel) -> Session:
        """The session `session_id`, started for `model` if new; one started for another model is a RequestError."""
        check_id(session_id)
        with self.lock:
            session = self.by_id.get(session_id)
            if session is None:
                session = self.start(session_id, model_id, model)
        if session.model_id != model_id:
            raise RequestError(f"session {session_id!r} is a conversation with model {session.model_id!r}, not {model_id!r}")
        with session.lock:
            self.follow(session, model)
        return session

    def follow(self, session: Session, model: TextModel) -> None:
        """Move the session to `model`, the one now served under its model's id (a hot-swap), if it renders
        the context the same; else a RequestError."""
        if session.model is model:
            return
        if identity(model.template(), model.tokenizer) != session.context.identity():
            raise RequestError(f"session {session.id!r}: model {session.model_id!r} was replaced by one with another "
                               "tokenizer or chat template; its context cannot be rendered for it (start a new session)")
        session.model, session.context.summarize = model, model.summarize

    def replace(self, session_id: str, model_id: str, model: TextModel, state: dict) -> Session:
        """A session of `model` restored from a saved state, in place of any of that id (kept if it fails)."""
        check_id(session_id)
        session = Session(session_id, model_id, model, model.context(summarizer=model))
        session.context.restore(state, f"the state for session {session_id!r}")
        with self.lock:
            if session_id not in self.by_id:
                self.check_room()
            self.by_id[session_id] = session
        return session

    def drop(self, session_id: str) -> None:
        with self.lock:
            self.by_id.pop(self.get(session_id).id)

    def start(self, session_id: str, model_id: str, model: TextModel) -> Session:
        self.check_room()
        session = self.by_id[session_id] = Session(session_id, model_id, model, model.context(summarizer=model))
        return session

    def check_room(self) -> None:
        if len(self.by_id) >= self.limit:
            raise TooManySessions(f"the server holds {self.limit} sessions, its most; clear one "
                                  "(/v1/context/clear with \"what\": \"session\") first")


def check_id(session_id) -> None:
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise RequestError("a session id must be 1-128 letters, digits or '_.:-'")
