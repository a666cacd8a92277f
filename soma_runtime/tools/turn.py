"""One assistant turn of a chat with tools and structured output: the prompt (the template shown the
tools, or told of them in the system message), the constraint on the reply (a forced call, a call
forced once it opens, a response format) starting after any reasoning, and the reply read back as
reasoning, content and tool calls. The library's chat and the server's chat route share it."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from soma_runtime.engine.grammar import Constraint, check_schema
from soma_runtime.errors import RequestError
from soma_runtime.text.chat import ChatTemplate, check_messages
from soma_runtime.tools.formats import TOOL_NAME, CallFormat, Generic, ToolCall, detect, function_of

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_TOOLS = 128                 # OpenAI's limit on one request's tools
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class Reply:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def check_tools(tools) -> list[dict]:
    """OpenAI `tools`: a list of at most MAX_TOOLS {type: function, function: {name, description?, parameters?}},
    names unique, each one's parameters a schema within the constraint limits."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {type: function, function: {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"a request may give at most {MAX_TOOLS} tools, got {len(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        f = function_of(tool) if isinstance(tool, dict) else None
        if not isinstance(f, dict) or tool.get("type", "function") != "function" or not isinstance(f.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(f"tools[{i}]: a function's name must be 1-64 letters, digits, '_' or '-', got {shown(name)}")
        if name in names:
            raise RequestError(f"tools[{i}]: two tools are named {name!r}")
        if not isinstance(f.get("description") or "", str):
            raise RequestError(f"tools[{i}]: a function's description must be text")
        names.add(name)
        check_schema(f.get("parameters", {}), f"/tools/{i}/function/parameters")
    return tools


def choose_tools(tools: list[dict], choice) -> tuple[list[dict], str]:
    """The tools a reply may call and how: 'none', 'auto' or 'required' (a named function: that one, required)."""
    if choice is None or isinstance(choice, str) and choice in TOOL_CHOICES:
        return tools, choice or "auto"
    name = named_function(choice)
    named = [t for t in tools if function_of(t)["name"] == name]
    if not named:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
    return named, "required"


def named_function(choice) -> str:
    """The function OpenAI's {type: function, function: {name}} names (RequestError for any other shape)."""
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function" or not isinstance(function.get("name"), str):
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {{type: function, function: {{name}}}}, "
                           f"got {shown(choice)}")
    return function["name"]


def shown(value) -> str:
    """A client's value in an error message: text cut short, anything else by its type."""
    return repr(value[:64]) if isinstance(value, str) else type(value).__name__


class Turn:
    """The prompt and constraint for the model's next reply, and how to read the reply."""

    def __init__(self, template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None, tool_choice=None,
                 parallel_tool_calls: bool = True, constraint: Constraint | None = None):
        check_messages(messages)
        tools = check_tools(tools) if tools is not None else []
        chosen, mode = choose_tools(tools, tool_choice)
        if not tools and mode == "required":
            raise RequestError("tool_choice 'required' needs tools to choose from")
        mode = mode if tools else "none"
        self.format: CallFormat | None = detect(template.source) if tools else None
        if tools and constraint is not None and mode != "none":
            raise RequestError("give tools or a response format, not both (unless tool_choice is 'none')")
        self.calls = self.format if mode != "none" else None         # the format replies are parsed in
        self.text = template.render(self.shown(messages, tools), tools=tools if self.native else None)
        if mode == "required":
            constraint = self.format.forced(chosen, parallel_tool_calls)
        elif mode == "auto":
            constraint = self.format.started(chosen, parallel_tool_calls)
        self.thinks = THINK_CLOSE in template.source and not self.text.rstrip().endswith(THINK_CLOSE)
        if constraint is not None and constraint.after is None and self.thinks:
            constraint = Constraint(constraint.kind, constraint.text, THINK_CLOSE)
        self.constraint = constraint

    @property
    def native(self) -> bool:
        """Whether the template itself shows tools and calls (else the generic format's system prompt does)."""
        return self.format is not None and not isinstance(self.format, Generic)

    def shown(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The messages as the template takes them: calls' arguments as objects (OpenAI sends JSON text);
        for the generic format, the tools described in the system message and calls written as it writes them."""
        messages = copy.deepcopy(messages)
        for i, m in enumerate(messages):
            calls = m.get("tool_calls") or []
            for call in calls if isinstance(calls, list) else [None]:
                f = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise RequestError(f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}")
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        raise RequestError(f"tool call {f.get('name')!r}: its arguments are not JSON") from None
        if self.format is None or self.native:
            return messages
        for m in messages:
            if m.get("tool_calls"):
                calls = [{"name": c.get("function", c)["name"], "arguments": c.get("function", c)["arguments"]}
                         for c in m.pop("tool_calls")]
                m["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        prompt = self.format.system_prompt(tools)
        if messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()
            return messages
        return [{"role": "system", "content": prompt}, *messages]

    def read(self, text: str) -> Reply:
        """A finished reply: its reasoning (a think block), content and tool calls."""
        reasoning = None
        if self.thinks and THINK_CLOSE in text:
            reasoning, _, text = text.partition(THINK_CLOSE)
            reasoning, text = reasoning.replace(THINK_OPEN, "", 1).strip(), text.lstrip()
        if self.calls is None:
            return Reply(text, reasoning)
        content, calls = self.calls.parse(text)
        return Reply(content, reasoning, calls)


class ReplyStream:
    """A reply read as it streams: reasoning and content pieces as soon as they are surely neither part of
    a marker nor of a tool call; calls (parsed whole) at the end. Pieces are (kind, text|ToolCall), kind
    one of 'reasoning', 'content', 'call'."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.reasoning = turn.thinks
        self.opening = turn.calls.opening if turn.calls is not None else None
        self.holds_all = turn.calls is not None and self.opening is None       # a call is the whole reply
        self.pending, self.text, self.calling = "", "", False

    def feed(self, piece: str) -> list[tuple[str, object]]:
        self.text += piece
        self.pending += piece
        out = []
        if self.reasoning:
            done, self.pending = split_at(self.pending, THINK_CLOSE)
            if self.pending.startswith(THINK_CLOSE):
                self.reasoning, self.pending = False, self.pending[len(THINK_CLOSE):].lstrip()
            out += [("reasoning", done.replace(THINK_OPEN, ""))] if done.replace(THINK_OPEN, "") else []
            if self.reasoning:
                return out
        if self.holds_all or self.calling:
            return out
        if self.opening is not None:
            done, self.pending = split_at(self.pending, self.opening)
            self.calling = self.pending.startswith(self.opening)
            return out + ([("content", done)] if done else [])
        done, self.pending = self.pending, ""
        return out + ([("content", done)] if done else [])

    def finish(self) -> list[tuple[str, object]]:
        """The rest: held-back text, and the calls once the whole reply is known."""
        reply = self.turn.read(self.text)
        if reply.tool_calls:
            return [("call", call) for call in reply.tool_calls]
        rest = reply.content if self.holds_all else self.pending
        kind = "reasoning" if self.reasoning else "content"
        return [(kind, rest)] if rest else []


def split_at(text: str, marker: str) -> tuple[str, str]:
    """(what surely precedes `marker`, the rest): the rest starts at the marker, or at a tail of `text`
    that could still grow into it."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], text[at:]
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return text[:-keep], text[-keep:]
    return text, ""
