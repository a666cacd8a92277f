"""Structured output and tools with the official `openai` client against `soma-runtime serve` and the
bundled SmolLM2: 20 schemas, each reply parsing and validating (jsonschema), streamed and not, greedy and
sampled, one at a time and 16 at once; regex completions; forced tool calls; a tool loop driven by the
client over three steps, its prompt prefix cached; bad schemas and grammars answered with 400s."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

S = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS = [
    obj(tier=INT, slot=INT),
    obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(city=S, country={"enum": ["France", "Spain", "Italy"]}),
    obj(answer={"type": "boolean"}),
    obj(colors={"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}),
    obj(person=obj(first=S, last=S)),
    obj(point=obj(x=INT, y=INT), label=S),
    obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
    obj(date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}),
    obj(value={"anyOf": [INT, {"type": "boolean"}]}),
    {"$defs": {"item": obj(id=INT, tag=S)}, **obj(items={"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2})},
    obj(status={"const": "ok"}, count=INT),
    obj(scores={"type": "array", "items": INT, "minItems": 2, "maxItems": 4}),
    obj(title=S, tags={"type": "array", "items": S, "maxItems": 2}),
    {"enum": ["yes", "no", "maybe"]},
    {"type": "array", "items": obj(k=S), "minItems": 1, "maxItems": 2},
    obj(kind={"oneOf": [{"const": "a"}, {"const": "b"}]}, n=INT),
    obj(matrix={"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}),
    obj(email={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}),
    {"$defs": {"node": obj(name=S)}, **obj(root={"$ref": "#/$defs/node"}, leaf={"$ref": "#/$defs/node"})},
]
WEATHER = obj(city=S)
CLOCK = obj(zone={"type": "integer", "minimum": -12, "maximum": 14})
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "Current hour in a time zone", "parameters": CLOCK}}]
SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.9, "seed": 7}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, schema, i, stream, sampling):
    messages = [{"role": "user", "content": f"Reply with JSON for example {i}."}]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    args = {"model": "default", "messages": messages, "response_format": fmt, "max_tokens": 200, **SAMPLING[sampling]}
    if not stream:
        reply = client.chat.completions.create(**args)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_reply_validates_one_at_a_time(client, stream, sampling):
    for i, schema in enumerate(SCHEMAS):
        text, finish = ask(client, schema, i, stream, sampling)
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_every_reply_validates_sixteen_at_once(client, server):
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: ask(client, SCHEMAS[i], i, i % 2 == 1, "sampled"), range(16)))
    for i, (text, _) in enumerate(replies):
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert server.metric("soma_batch_size_max") > 1


@pytest.mark.parametrize("seed", range(3))
def test_regex_completions_match(client, seed):
    pattern = r" [A-Z][a-z]{2,8}, [0-9]{4}\."
    reply = client.completions.create(model="default", prompt="The city and the year:", max_tokens=20, temperature=0.8,
                                      seed=seed, extra_body={"regex": pattern})
    assert re.fullmatch(pattern, reply.choices[0].text)
    gbnf = 'root ::= " " ("yes" | "no") "."'
    reply = client.completions.create(model="default", prompt="Is the sky blue?", max_tokens=5, extra_body={"grammar": gbnf})
    assert reply.choices[0].text in (" yes.", " no.")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_required_tool_choice_always_yields_a_valid_call(client, stream, sampling):
    args = {"model": "default", "messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": TOOLS,
            "tool_choice": "required", "max_tokens": 300, **SAMPLING[sampling]}
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **args):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                call["name"] = delta.function.name or call["name"]
                call["arguments"] += delta.function.arguments or ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        found = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        reply = client.chat.completions.create(**args)
        finish = reply.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert finish == "tool_calls" and found
    for name, arguments in found:
        jsonschema.validate(json.loads(arguments), {"weather": WEATHER, "clock": CLOCK}[name])


def test_a_three_step_tool_loop_reuses_the_prompt_prefix(client):
    """The client runs two tools over three steps (a forced call, a named call, then an answer); each
    step's prompt extends the last, so its prefix comes from the cache."""
    messages = [{"role": "system", "content": "You answer questions about places. " * 20},
                {"role": "user", "content": "What is the weather in Paris, and what hour is it there?"}]
    results = {"weather": {"city": "Paris", "celsius": 18}, "clock": {"hour": 14}}
    cached = []
    for choice in ["required", {"type": "function", "function": {"name": "clock"}}, "none"]:
        reply = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, temperature=0, max_tokens=80)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        message = reply.choices[0].message
        if choice == "none":
            assert reply.choices[0].finish_reason in ("stop", "length") and message.content and not message.tool_calls
            break
        assert reply.choices[0].finish_reason == "tool_calls"
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(results[call.function.name])})
    assert cached[1] > 0 and cached[2] > cached[1]


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}},
     "unsupported JSON schema keyword 'not' at '/not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}},
     "invalid json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs {json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]},
     "'if' at '/tools/0/function/parameters/if'"),
])
def test_bad_structured_requests_are_400s(server, body, message):
    status, payload = server.post("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                                           **body})
    assert status == 400 and re.search(message, payload["error"]["message"]), payload


def test_a_grammar_that_matches_nothing_is_a_400(server):
    status, payload = server.post("/v1/completions", {"model": "default", "prompt": "x", "regex": r"[^\s\S]"})
    assert status == 400 and "matches no text" in payload["error"]["message"]
    status, payload = server.post("/v1/completions", {"model": "default", "prompt": "x", "grammar": "root ::= undefined"})
    assert status == 400
    assert server.get("/v1/health")[0] == 200
