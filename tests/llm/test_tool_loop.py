"""The library's tool loop on the bundled SmolLM2 (its template knows no tools: the generic format): calls
detected mid-stream, arguments checked against their schema, handlers run (a failing one reported to the
model), results injected, the prompt prefix cached from step to step; the registry's own checks."""
from __future__ import annotations

import json

import pytest

from soma_runtime.errors import RequestError
from soma_runtime.tools.formats import ToolCall
from soma_runtime.tools.registry import Tool, ToolRegistry

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}


def registry(calls: list) -> ToolRegistry:
    tools = ToolRegistry()

    @tools.tool("The current weather in a city", CITY)
    def weather(city):
        calls.append(("weather", city))
        return {"city": city, "celsius": 18}

    @tools.tool("The population of a city", CITY)
    def population(city):
        calls.append(("population", city))
        raise LookupError(f"no census for {city}")

    return tools


def test_the_loop_runs_calls_and_feeds_results_back(smol):
    ran = []
    question = [{"role": "system", "content": "You help with facts about cities. " * 10},
                {"role": "user", "content": "What is the weather in Paris and how many people live there?"}]
    loop = smol.chat(question, tools=registry(ran), tool_choice="required", parallel_tool_calls=False, max_tool_steps=3,
                     temperature=0, max_tokens=60)
    seen = [token.tool_call for token in loop if token.is_tool_call()]
    assert seen and 1 <= loop.steps <= 3
    assert [(c.name, json.loads(c.arguments)["city"]) for c in seen] == ran
    results = [m for m in loop.messages if m["role"] == "tool"]
    assert len(results) == len(seen)
    for message, (name, city) in zip(results, ran):
        expected = {"city": city, "celsius": 18} if name == "weather" else {"error": f"LookupError: no census for {city}"}
        assert json.loads(message["content"]) == expected
    if loop.steps > 1:
        assert loop.cached_tokens > 0             # each step's prompt starts with the one before
    assert loop.reply is not None


def test_a_caller_may_answer_a_call_itself(smol):
    loop = smol.chat([{"role": "user", "content": "Weather in Rome?"}], tools=registry([]), tool_choice="required",
                     parallel_tool_calls=False, max_tool_steps=2, temperature=0, max_tokens=60)
    for token in loop:
        if token.is_tool_call():
            loop.inject_tool_result({"sunny": True})
    assert json.loads(next(m for m in loop.messages if m["role"] == "tool")["content"]) == {"sunny": True}
    with pytest.raises(RequestError, match="no tool call is waiting"):
        loop.inject_tool_result("late")


@pytest.mark.parametrize("call, message", [
    (ToolCall("weather", '{"town": "Oslo"}'), "do not match its schema at '/'"),
    (ToolCall("weather", '{"city": 7}'), "at '/city'"),
    (ToolCall("weather", "{city"), "not JSON"),
    (ToolCall("teleport", "{}"), "no tool named 'teleport'"),
    (ToolCall("population", '{"city": "Oslo"}'), "LookupError: no census for Oslo"),
])
def test_bad_calls_become_error_results(call, message):
    result = json.loads(registry([]).run(call))
    assert message in result["error"]


def test_tools_are_checked_when_registered():
    with pytest.raises(RequestError, match="unsupported JSON schema keyword 'not'"):
        Tool("a", "", {"type": "object", "not": {}})
    with pytest.raises(RequestError, match="not a valid JSON schema"):
        Tool("a", "", {"type": "objekt"})
    with pytest.raises(RequestError, match="registered twice"):
        ToolRegistry([Tool("a", "", {}), Tool("a", "", {})])
