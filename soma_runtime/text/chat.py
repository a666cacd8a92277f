"""Chat templates: the model's own Jinja2 template, rendered the way transformers renders it.

Sizes are bounded before anything large is built: a template's source is at most MAX_TEMPLATE_CHARS
(several times any real one; compiling that many characters of tags takes seconds) or it is refused
uncompiled; a rendering stops with PromptTooLong once it passes the characters its model's context could
ever hold (`max_chars`); and `characters` counts a conversation's text so a model can refuse it before
rendering it.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from soma_runtime.errors import ModelLoadError, PromptTooLong, RequestError

ROLES = ("system", "user", "assistant", "tool")
MAX_TEMPLATE_CHARS = 1 << 18


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 max_chars: int | None = None):
        """`max_chars`: the longest rendering wanted (None: any); a longer one stops as it passes it."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        if not isinstance(source, str):
            raise ModelLoadError(f"the chat template is a {type(source).__name__}, not text")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(f"the chat template is {len(source)} characters long; at most {MAX_TEMPLATE_CHARS} are taken")
        self.max_chars = max_chars
        try:
            self.template = env.from_string(source)
        except (jinja2.exceptions.TemplateError, RecursionError, ValueError) as e:
            raise ModelLoadError(f"the chat template does not compile ({type(e).__name__}: {e})") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        check_messages(messages)
        pieces, length = [], 0
        try:
            for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                length += len(piece)
                if self.max_chars is not None and length > self.max_chars:
                    raise PromptTooLong(f"the chat template's rendering passed {self.max_chars} characters, "
                                        "more than the model's context can hold")
                pieces.append(piece)
            return "".join(pieces)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as e:   # the template's own fault
            raise RequestError(f"chat template failed on the messages ({type(e).__name__}: {e})") from None


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        content_ok = isinstance(m, dict) and (isinstance(m.get("content", ""), (str, list)) or
                                              (m.get("content") is None and bool(m.get("tool_calls"))))
        if not content_ok or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must have a role in {ROLES} and text content, got {m!r}")


def characters(*values) -> int:
    """The characters of every string (keys included) in JSON-like values, such as messages and tools: a
    template shows what it is given, so it renders about this many at least. Walked without recursion,
    each container once (a list holding itself is counted once)."""
    total, seen, stack = 0, set(), list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend([*value.keys(), *value.values()] if isinstance(value, dict) else value)
    return total
