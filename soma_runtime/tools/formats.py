"""Tool-call formats by model family, told from the chat template: how a family writes its calls (so a
grammar can force them, or start forcing once a call opens) and how they are parsed back out of the
generated text. Families: Hermes/Qwen `<tool_call>{json}</tool_call>` (and the XML `<function=…>` form
of newer Qwen templates), Llama 3.x `{"name", "parameters"}`, Mistral `[TOOL_CALLS][…]`, and a generic
format for templates without tools: schema-constrained JSON described in the system prompt.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from soma_runtime.engine.grammar import JSON_OPTIONS, Constraint
from soma_runtime.errors import RequestError

RAW_STRING_KEYWORDS = {"type", "minLength", "maxLength", "description", "title", "default", "examples"}
MAX_PARALLEL_CALLS = 8          # calls one reply may make: a model cannot call on until its tokens run out
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # OpenAI's rule for a function's name


@dataclass
class ToolCall:
    name: str
    arguments: str                 # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def function_of(tool: dict) -> dict:
    """An OpenAI tool's function: {name, description, parameters}."""
    return tool.get("function", tool)


def call_schema(tools: list[dict], arguments_key: str = "arguments") -> dict:
    """One call to any of `tools`: {"name": <its name>, <arguments_key>: <its parameters>}."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                "properties": {"name": {"const": f["name"]},
                               arguments_key: f.get("parameters") or {"type": "object"}}}
               for f in map(function_of, tools)]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_of(value) -> ToolCall | None:
    """A ToolCall from a parsed JSON object {"name", "arguments" | "parameters"}, None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def loads_call(text: str) -> ToolCall | None:
    try:
        return call_of(json.loads(text))
    except json.JSONDecodeError:
        return None


def json_run(text: str, at: int, separator: str) -> tuple[list, int]:
    """JSON values one after another from `at`, `separator` (and whitespace) between them: those that parse
    whole, and where the run stopped (len(text) where it ran to the end)."""
    decoder, values = json.JSONDecoder(), []
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, len(text) - len(text[at:].lstrip()))
        except json.JSONDecodeError:
            break
        values.append(value)
        at = len(text) - len(text[at:].lstrip().removeprefix(separator).lstrip())
    return values, at


class CallFormat:
    """How one family writes tool calls. `opening` is the text a call starts with (where `auto` starts
    constraining); `None` where a call is the whole reply."""
    name = ""
    opening: str | None = None

    def system_prompt(self, tools: list[dict]) -> str | None:
        """Text to put in the system message, for templates that cannot show the tools themselves."""
        return None

    def forced(self, tools: list[dict], parallel: bool) -> Constraint:
        """The reply must be tool calls (tool_choice `required` or a named function)."""
        raise NotImplementedError

    def started(self, tools: list[dict], parallel: bool) -> Constraint | None:
        """For tool_choice `auto`: the reply runs free; once it opens a call, the call is forced."""
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a reply; text that holds no well-formed call is all content."""
        raise NotImplementedError


def lark_calls(opening: str, closing: str, body: str, parallel: bool, opened: bool = False) -> str:
    """A Lark grammar of `opening` call-`body` `closing`, once or repeated; `opened`: the first opening is
    already written (the constraint starts after it)."""
    call = f'"\\n"? {body} "\\n"? {json.dumps(closing)}'
    first = call if opened else f"{json.dumps(opening)} {call}"
    more = f' ("\\n"? {json.dumps(opening)} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return f"start: {first}{more}\n"


def inline(schema: dict) -> str:
    """A schema for Lark's `%json`, with the JSON options a schema constraint gets."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


class Hermes(CallFormat):
    """Qwen 2.5/3, Hermes, SmolLM3: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`."""
    name, opening, closing = "hermes", "<tool_call>", "</tool_call>"
    XML = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def __init__(self):
        self.strings: dict[str, set[str]] = {}        # per tool, its string-typed parameters (kept raw in the XML form)

    def body(self, tools: list[dict]) -> str:
        """One call's Lark rule: the JSON object {"name", "arguments"}."""
        return f"%json {inline(call_schema(tools))}"

    def forced(self, tools, parallel):
        self.remember(tools)
        return Constraint("lark", lark_calls(self.opening, self.closing, self.body(tools), parallel))

    def started(self, tools, parallel):
        self.remember(tools)
        return Constraint("lark", lark_calls(self.opening, self.closing, self.body(tools), parallel, opened=True), self.opening)

    def remember(self, tools: list[dict]) -> None:
        for f in map(function_of, tools):
            properties = (f.get("parameters") or {}).get("properties", {})
            self.strings[f["name"]] = {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}

    def parse(self, text):
        pattern = re.compile(re.escape(self.opening) + r"(.*?)(" + re.escape(self.closing) + r"|$)", re.DOTALL)
        found = pattern.findall(text)
        if found and not found[-1][1] and self.call(found[-1][0]) is None:
            found = found[:-1]                      # a call cut off by the token limit is dropped
        calls = [self.call(body) for body, _ in found]
        if not calls or None in calls:
            return text, []
        return text[:text.index(self.opening)].strip(), calls

    def call(self, body: str) -> ToolCall | None:
        """A call written as JSON, or in the XML form (`<function=name><parameter=p>value</parameter>`)."""
        found = self.XML.search(body)
        if found is None:
            return loads_call(body.strip())
        args, strings = {}, self.strings.get(found.group(1), set())
        for key, value in self.PARAMETER.findall(found.group(2)):
            try:
                args[key] = value if key in strings else json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
        return ToolCall(found.group(1), json.dumps(args, ensure_ascii=False))


class HermesXML(Hermes):
    """Qwen3-Coder and later: `<tool_call>\n<function=name>\n<parameter=p>\nvalue\n</parameter>\n</function>`,
    string values written raw (here: without '<'), others as JSON."""
    name = "hermes_xml"

    def body(self, tools):
        return "(" + " | ".join(self.xml_call(function_of(t)) for t in tools) + ")"

    @staticmethod
    def xml_call(f: dict) -> str:
        parameters = f.get("parameters") or {}
        required = set(parameters.get("required", []))
        parts, end = [], '"\\n</parameter>\\n"'
        for key, schema in parameters.get("properties", {}).items():
            schema = schema if isinstance(schema, dict) else {}
            if schema.get("type") == "string" and "enum" in schema:
                value = "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + f") {end}"
            elif schema.get("type") == "string":            # one lexeme with its end: a value cannot hold '<'
                unenforced = set(schema) - RAW_STRING_KEYWORDS
                if unenforced:
                    raise RequestError(f"tool {f['name']}: the XML call form writes {key!r} raw and cannot enforce "
                                       f"{', '.join(sorted(unenforced))} on it")
                length = f"{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}"
                value = f"/[^<]{length}\\n<\\/parameter>\\n/"
            else:
                value = f"%json {inline(schema)} {end}"
            part = f'{json.dumps(f"<parameter={key}>")} "\\n" {value}'
            parts.append(part if key in required else f"({part})?")
        opening = json.dumps(f"<function={f['name']}>")
        return f'{opening} "\\n" {" ".join(parts)} "</function>"'


class Llama3(CallFormat):
    """Llama 3.1-3.3 with JSON tool calling: the reply is `{"name": …, "parameters": {…}}`."""
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def forced(self, tools, parallel):
        return Constraint.json_schema(call_schema(tools, "parameters"))

    def parse(self, text):
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        values, stopped = json_run(body, 0, ";")         # objects one after another, `;` between them
        calls = [call_of(v) for v in values]
        return (text, []) if stopped < len(body) or None in calls or not calls else ("", calls)


class Mistral(CallFormat):
    """Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, or `[TOOL_CALLS]name[ARGS]{…}` (v11)."""
    name, opening = "mistral", "[TOOL_CALLS]"

    def calls_schema(self, tools, parallel):
        return {"type": "array", "items": call_schema(tools), "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}

    def forced(self, tools, parallel):
        return Constraint("lark", f"start: {json.dumps(self.opening)} %json {inline(self.calls_schema(tools, parallel))}\n")

    def started(self, tools, parallel):
        return Constraint("lark", f"start: %json {inline(self.calls_schema(tools, parallel))}\n", self.opening)

    def parse(self, text):
        if self.opening not in text:
            return text, []
        content, _, body = text.partition(self.opening)
        if "[ARGS]" in body:
            calls = [ToolCall(name.strip(), args.strip()) for name, args in
                     (part.split("[ARGS]", 1) for part in body.split(self.opening) if "[ARGS]" in part)]
            return content.strip(), calls
        try:
            items = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []
        calls = [call_of(item) for item in (items if isinstance(items, list) else [items])]
        return (text, []) if None in calls else (content.strip(), calls)


class Generic(CallFormat):
    """For templates that know no tools (SmolLM2's): the tools are described in the system prompt and
    the reply is JSON, `{"tool_calls": [{"name", "arguments"}]}` or (when calls are optional)
    `{"response": "…"}`, as llama.cpp's generic format."""
    name = "generic"

    def system_prompt(self, tools):
        described = json.dumps([function_of(t) for t in tools], ensure_ascii=False)
        return ("You can call these tools:\n" + described + "\nTo call tools, reply with JSON only: "
                '{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}]}. '
                'To answer directly, reply {"response": <your answer>}.')

    def calls(self, tools, parallel) -> dict:
        return {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                "properties": {"tool_calls": {"type": "array", "items": call_schema(tools), "minItems": 1,
                                              "maxItems": MAX_PARALLEL_CALLS if parallel else 1}}}

    def forced(self, tools, parallel):
        return Constraint.json_schema(self.calls(tools, parallel))

    def started(self, tools, parallel):
        response = {"type": "object", "additionalProperties": False, "required": ["response"],
                    "properties": {"response": {"type": "string"}}}
        return Constraint.json_schema({"anyOf": [self.calls(tools, parallel), response]})

    def parse(self, text):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            calls = self.complete_calls(text)       # cut off by the token limit: the calls that were written whole
            return ("", calls) if calls else (text, [])
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        if not isinstance(value, dict) or not isinstance(value.get("tool_calls"), list):
            return text, []
        calls = [call_of(item) for item in value["tool_calls"]]
        return (text, []) if None in calls or not calls else ("", calls)

    @staticmethod
    def complete_calls(text: str) -> list[ToolCall]:
        """The whole calls at the start of a `{"tool_calls": [...` that was cut off."""
        start = re.match(r'\s*\{\s*"tool_calls"\s*:\s*\[', text)
        calls = [call_of(v) for v in json_run(text, start.end(), ",")[0]] if start else []
        return [] if None in calls else calls


def detect(template: str | None) -> CallFormat:
    """The family's format, from what its chat template writes."""
    source = template or ""
    if "<tool_call>" in source:
        return HermesXML() if "<function=" in source else Hermes()
    if "[TOOL_CALLS]" in source:
        return Mistral()
    if "tools" in source and ('"parameters"' in source or "<|python_tag|>" in source):
        return Llama3()
    return Generic()
