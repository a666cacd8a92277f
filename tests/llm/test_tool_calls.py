"""Tool calls per family, on tiny random models whose templates show tools as each family's do: tool and
call messages rendered exactly as transformers' `apply_chat_template(..., tools=...)` renders them; a
forced call (`required`, or a named function) always parses from the model's own format into a call
whose arguments validate; each format's parser on replies written the family's way; reasoning split off."""
from __future__ import annotations

import json

import jsonschema
import pytest
import transformers

from soma_runtime.engine.grammar import Constraint, Grammars
from soma_runtime.tasks import Runtime
from soma_runtime.tools.formats import Generic, Hermes, Llama3, Mistral, detect
from soma_runtime.tools.turn import ReplyStream, Turn
from tests.fixtures import templates
from tests.fixtures.decoders import CHATML, build_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "The time in a zone", "parameters": CLOCK}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": '{"celsius": 4}'},
    {"role": "assistant", "content": "It is 4 degrees."},
    {"role": "user", "content": "And the time there?"},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}


@pytest.fixture(scope="module", params=sorted(templates.FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tools-{request.param}")
    build_model("llama", str(directory), max_position_embeddings=4096)
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text().replace(json.dumps(CHATML)[1:-1], json.dumps(templates.FAMILIES[request.param])[1:-1]))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<|im_start|>",
                                              eos_token="<|im_end|>", chat_template=templates.FAMILIES[request.param])
    return request.param, Runtime("cpu").load(str(directory), progress=False), hf


def with_object_arguments(messages):
    """The conversation as transformers' templates take it: call arguments as objects."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def test_the_family_is_detected_from_its_template(family):
    name, model, _ = family
    assert detect(model.chat_template.source).name == name


def test_tools_and_tool_messages_render_as_transformers_does(family):
    _, model, hf = family
    ours = model.turn(CONVERSATION, TOOLS).text
    theirs = hf.apply_chat_template(with_object_arguments(CONVERSATION), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}], ids=["required", "named"])
@pytest.mark.parametrize("seed", range(3))
def test_forced_calls_parse_and_validate(family, choice, seed):
    _, model, _ = family
    reply = model.chat(CONVERSATION, stream=False, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=1500,
                       parallel_tool_calls=seed != 0)
    assert reply.tool_calls, reply
    if seed == 0:
        assert len(reply.tool_calls) == 1
    for call in reply.tool_calls:
        assert call.name == "clock" or choice == "required"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt, text, content, calls", [
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.", [("weather", {"city": "Oslo"})]),
    (Hermes(), '<tool_call>\n<function=clock>\n<parameter=zone>\n2\n</parameter>\n</function>\n</tool_call>', "",
     [("clock", {"zone": 2})]),
    (Hermes(), '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
     "", [("a", {}), ("b", {"x": 1})]),
    (Hermes(), "Plain text, <tool_call> broken", "Plain text, <tool_call> broken", []),
    (Llama3(), '<|python_tag|>{"name": "clock", "parameters": {"zone": 1}}', "", [("clock", {"zone": 1})]),
    (Llama3(), "{not json at all", "{not json at all", []),
    (Mistral(), '[TOOL_CALLS][{"name": "clock", "arguments": {"zone": -3}}]', "", [("clock", {"zone": -3})]),
    (Mistral(), '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}', "", [("weather", {"city": "Rome"})]),
    (Generic(), '{"tool_calls": [{"name": "clock", "arguments": {"zone": 0}}]}', "", [("clock", {"zone": 0})]),
    (Generic(), '{"response": "Hello"}', "Hello", []),
])
def test_each_format_parses_its_replies(fmt, text, content, calls):
    got_content, got = fmt.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_reasoning_is_split_off_and_the_constraint_waits_for_its_end(tmp_path):
    from soma_runtime.text.chat import ChatTemplate
    turn = Turn(ChatTemplate(templates.THINKING), [{"role": "user", "content": "hi"}], constraint=Constraint.json_schema(CLOCK))
    assert turn.thinks and turn.constraint.after == "</think>"
    closed = Turn(ChatTemplate(templates.THINKING), [{"role": "user", "content": "hi"}])
    assert closed.constraint is None
    reply = turn.read('<think>\nthe user wants a zone</think>\n\n{"zone": 3}')
    assert (reply.reasoning, reply.content) == ("the user wants a zone", '{"zone": 3}')
    stream, pieces = ReplyStream(turn), []
    for piece in ["<think>", "\nthe user", " wants a zone</th", "ink>\n\n", '{"zone"', ": 3}"]:
        pieces += stream.feed(piece)
    pieces += stream.finish()
    assert "".join(v for k, v in pieces if k == "reasoning").strip() == "the user wants a zone"
    assert "".join(v for k, v in pieces if k == "content") == '{"zone": 3}'


def test_a_guide_starts_at_its_marker(family):
    _, model, _ = family
    grammars: Grammars = model.engine.grammars
    guide = grammars.guide(Constraint("regex", "[0-9]+", after="</think>"))
    assert guide.allowed() is None
    for piece in ["<think>", "hmm", "</th", "ink>"]:
        guide.advance(0, piece)
    allowed = guide.allowed()
    vocab = model.engine.cfg.vocab_size
    assert allowed is not None and 0 < len(allowed) < vocab
    assert all(model.tokenizer.decode([t]).isdigit() for t in allowed if t < model.tokenizer.vocab_size)


def test_streamed_calls_come_whole_at_the_end():
    fmt = Hermes()
    turn = Turn.__new__(Turn)
    turn.format, turn.calls, turn.thinks = fmt, fmt, False
    stream = ReplyStream(turn)
    text = 'Checking.\n<tool_call>\n{"name": "clock", "arguments": {"zone": 2}}\n</tool_call>'
    pieces = [p for i in range(0, len(text), 5) for p in stream.feed(text[i:i + 5])] + stream.finish()
    assert "".join(v for k, v in pieces if k == "content") == "Checking.\n"
    assert [(v.name, v.arguments) for k, v in pieces if k == "call"] == [("clock", '{"zone": 2}')]


@pytest.mark.parametrize("messages, message", [
    ("not a list", "messages must be a non-empty list"),
    ([{"role": "assistant", "content": None, "tool_calls": "x"}], r"messages\[0\].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}], r"messages\[0\].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], "not JSON"),
])
def test_malformed_tool_messages_are_request_errors(family, messages, message):
    from soma_runtime.errors import RequestError
    _, model, _ = family
    with pytest.raises(RequestError, match=message):
        model.turn(messages, TOOLS)


def test_the_xml_form_keeps_string_parameters_raw():
    from soma_runtime.tools.formats import HermesXML
    fmt = HermesXML()
    fmt.forced(TOOLS, parallel=True)                     # the format learns which parameters are strings
    reply = ("<tool_call>\n<function=weather>\n<parameter=city>\n1984\n</parameter>\n"
             "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    _, calls = fmt.parse(reply)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "1984", "unit": "celsius"})]
    _, calls = fmt.parse("<tool_call>\n<function=clock>\n<parameter=zone>\n-3\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"zone": -3}


def test_the_xml_form_fails_closed_on_a_string_keyword_it_cannot_enforce():
    from soma_runtime.errors import RequestError
    from soma_runtime.tools.formats import HermesXML
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]}}}
    with pytest.raises(RequestError, match="cannot enforce pattern"):
        HermesXML().forced([tool], parallel=False)
