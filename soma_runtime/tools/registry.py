"""Tools a model may call: each a name, a description, a JSON schema for its arguments and a handler.
A call's arguments are checked against the schema before the handler runs; a bad call or a failing
handler becomes an error result for the model to read, never an exception out of the loop."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

from soma_runtime.engine.grammar import check_schema
from soma_runtime.errors import RequestError
from soma_runtime.tools.formats import TOOL_NAME, ToolCall

log = logging.getLogger("soma_runtime.tools")


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
    handler: Callable[..., object] | None = None      # called with the arguments as keywords

    def __post_init__(self):
        if not isinstance(self.name, str) or not TOOL_NAME.fullmatch(self.name):
            raise RequestError(f"a tool's name must be 1-64 letters, digits, '_' or '-', got {self.name!r:.80}")
        check_schema(self.parameters, f"/tools/{self.name}/parameters")
        try:
            jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            raise RequestError(f"tool {self.name}: its parameters are not a valid JSON schema ({e.message})") from None

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


class ToolRegistry:
    def __init__(self, tools: list[Tool] = ()):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> Tool:
        if tool.name in self.tools:
            raise RequestError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool
        return tool

    def tool(self, description: str, parameters: dict) -> Callable:
        """Decorator: register a function as a tool under its own name."""
        def register(handler):
            self.add(Tool(handler.__name__, description, parameters, handler))
            return handler
        return register

    def as_openai(self) -> list[dict]:
        return [t.as_openai() for t in self.tools.values()]

    def check(self, call: ToolCall) -> dict:
        """The call's arguments, checked: RequestError naming what is wrong with them."""
        tool = self.tools.get(call.name)
        if tool is None:
            raise RequestError(f"no tool named {call.name!r}; tools: {', '.join(self.tools)}")
        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as e:
            raise RequestError(f"the arguments of {call.name} are not JSON: {e}") from None
        try:
            errors = sorted(jsonschema.Draft202012Validator(tool.parameters).iter_errors(args), key=lambda e: list(e.path))
        except RecursionError:              # the validator recurses along a schema's chains of $refs
            raise RequestError(f"the arguments of {call.name} cannot be checked: its schema's $refs chain too deep") from None
        if errors:
            where = "/" + "/".join(map(str, errors[0].absolute_path))
            raise RequestError(f"the arguments of {call.name} do not match its schema at '{where}': {errors[0].message}")
        return args

    def run(self, call: ToolCall) -> str:
        """The call's result as text for the model: the handler's return value (JSON unless text), or an
        error it can read and correct."""
        try:
            args = self.check(call)
            handler = self.tools[call.name].handler
            if handler is None:
                raise RequestError(f"tool {call.name} has no handler")
            result = handler(**args)
        except Exception as e:                  # the model reads the failure and may try again
            log.info("tool call %s failed", call.name, exc_info=True)
            return json.dumps({"error": f"{type(e).__name__}: {e}"})
        return result if isinstance(result, str) else self.dumps(result)

    @staticmethod
    def dumps(result) -> str:
        return json.dumps(result, ensure_ascii=False, default=str)
