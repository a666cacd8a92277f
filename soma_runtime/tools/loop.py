"""The tool loop (SPEC "tool use"): generate → detect a call → check its arguments → run it → inject the
result → continue, until a reply calls no tool or the step limit is reached. Each step's prompt starts
with the previous one, so the prefix cache keeps its KV pages (the model's metrics count them as cached).

Iterating yields every reply's tokens, then one token per call the reply made (`is_tool_call()`); a
caller may answer that call with `inject_tool_result` before iterating on, else the registry runs it."""
from __future__ import annotations

from collections.abc import Iterator

from soma_runtime.engine.generate import Token
from soma_runtime.errors import RequestError
from soma_runtime.tools.formats import ToolCall
from soma_runtime.tools.registry import ToolRegistry
from soma_runtime.tools.turn import Reply


class ToolLoop:
    def __init__(self, model, messages: list[dict], registry: ToolRegistry, tool_choice, parallel_tool_calls: bool,
                 max_steps: int, constraint, params: dict):
        if type(max_steps) is not int or max_steps < 1:
            raise RequestError(f"max_tool_steps must be an integer >= 1, got {max_steps!r}")
        self.model, self.registry, self.params = model, registry, params
        self.messages = list(messages)
        self.tool_choice, self.parallel, self.constraint = tool_choice, parallel_tool_calls, constraint
        self.max_steps = max_steps
        self.reply: Reply | None = None
        self.steps = 0
        self.cached_tokens = 0                 # prompt tokens whose KV the prefix cache gave, over all steps
        self._call: ToolCall | None = None
        self._injected: str | None = None
        model.turn(self.messages, registry.as_openai(), tool_choice, parallel_tool_calls, constraint)    # fails now, not mid-loop

    def inject_tool_result(self, result) -> None:
        """Answer the call just yielded with `result` (text, or anything JSON can write) instead of its handler."""
        if self._call is None:
            raise RequestError("no tool call is waiting for a result")
        self._injected = result if isinstance(result, str) else self.registry.dumps(result)

    def __iter__(self) -> Iterator[Token]:
        for step in range(1, self.max_steps + 1):
            self.steps = step
            choice = self.tool_choice if self.steps == 1 else "auto"       # a forced call is forced once
            turn = self.model.turn(self.messages, self.registry.as_openai(), choice, self.parallel, self.constraint)
            text = ""
            for token in self.model.generate(self.model.turn_ids(turn), constraint=turn.constraint, **self.params):
                text += token.text
                yield token
            self.cached_tokens += self.model.metrics()["cached_tokens"]
            self.reply = turn.read(text)
            calls = self.reply.tool_calls
            self.messages.append({"role": "assistant", "content": self.reply.content,
                                  **({"tool_calls": [c.as_openai() for c in calls]} if calls else {})})
            if not calls:
                return
            for call in calls:
                self._call, self._injected = call, None
                yield Token(-1, "", tool_call=call)
                result = self._injected if self._injected is not None else self.registry.run(call)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
            self._call = None

    def final(self) -> str:
        """Run the loop to its end; the last reply's content."""
        for _ in self:
            pass
        return self.reply.content if self.reply is not None else ""
