"""Grammars and schemas generated up to and just past each constraint limit (chains of rules and `$ref`s,
nesting, wide alternations, long literals, counted repetitions, patternProperties) and seeded random ones
(regexes, schema trees): each compiles and what it generates holds to it, or it is a RequestError naming
the limit; never a crash or another error. All run in one worker process from a small caller's stack."""
from __future__ import annotations

import json
import random
import re

import jsonschema

from soma_runtime.engine.grammar import (
    MAX_PATTERN_PROPERTIES,
    MAX_REPEATED,
    MAX_RULES,
    MAX_SCHEMA_DEPTH,
    MAX_SUBSCHEMAS,
    MAX_TEXT,
)
from tests.hardening.test_constraints import anyof_chain, compile_in_worker, gbnf_chain, lark_chain, nested, ref_chain
from tests.hardening.test_constraints import tokenizer as tokenizer_fixture

tokenizer = tokenizer_fixture          # the tiny tokenizer the worker compiles for, built once per module
ROW_ITEMS = 2000                       # llguidance's most alternatives in one parser row (its max_items_in_row)
RANDOM = random.Random(0)
WORDS = ["".join(RANDOM.choice("abcdefghij") for _ in range(6)) + str(i) for i in range(12_000)]


def words_within(limit: int, written) -> list[str]:
    """As many WORDS as `written` (words -> text) keeps within `limit` characters."""
    low, high = 1, len(WORDS)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(written(WORDS[:mid])) <= limit else (low, mid - 1)
    return WORDS[:low]


def holds(pattern: str):
    """A check for regex constraints: a finished text matches whole; an unfinished one is cut by the steps."""
    return lambda text, done: not done or re.fullmatch(pattern, text, re.DOTALL)


def validates(schema):
    def check(text, done):
        if done:
            jsonschema.validate(json.loads(text), schema)
        return True
    return check


def chain_end(text, done) -> bool:
    """What a chain of `$ref`s (jsonschema's validator recurses along it) ends in: null or 0-99."""
    value = json.loads(text)
    return done and (value is None or 0 <= value <= 99)


def starts(literal: str):
    return lambda text, done: literal.startswith(text) and (text == literal or not done)


def one_of(options):
    return lambda text, done: done and text in options


def at_and_past_the_limits() -> list[tuple[dict, object]]:
    """(case, check) pairs: a check for what must compile and hold, or the text its RequestError must hold."""
    alternation = words_within(MAX_TEXT, lambda w: "(" + "|".join(w) + ")")
    lark_words = WORDS[:ROW_ITEMS - 1]
    enum_words = words_within(MAX_TEXT, lambda w: json.dumps({"enum": w}, sort_keys=True))
    literal = "".join(WORDS)[:MAX_TEXT]
    consts = [{"const": i} for i in range(MAX_SUBSCHEMAS - 1)]
    single = {"minItems": 1, "maxItems": 1}
    prop = {"type": "object", "required": ["a"], "additionalProperties": False}
    patterns = {f"^{w}[0-9]?$": {"type": "boolean"} for w in WORDS[:MAX_PATTERN_PROPERTIES + 1]}
    return [
        ({"kind": "lark", "text": lark_chain(MAX_RULES - 2)}, one_of(["x"])),
        ({"kind": "lark", "text": lark_chain(MAX_RULES - 1)}, "rules"),
        ({"kind": "gbnf", "text": gbnf_chain(MAX_RULES - 2)}, one_of(["x"])),
        ({"kind": "gbnf", "text": gbnf_chain(MAX_RULES - 1)}, "rules"),
        ({"kind": "lark", "text": "start: " + " | ".join(f"r{i}" for i in range(ROW_ITEMS - 1)) + "\n"
          + "".join(f'r{i}: "{w}"\n' for i, w in enumerate(WORDS[:ROW_ITEMS - 1]))}, one_of(WORDS[:ROW_ITEMS - 1])),
        ({"kind": "lark", "text": "start: " + " | ".join(f"r{i}" for i in range(MAX_RULES - 1)) + "\n"
          + "".join(f'r{i}: "{w}"\n' for i, w in enumerate(WORDS[:MAX_RULES - 1]))}, "matcher's limits"),
        ({"schema": ref_chain(1800)}, chain_end),
        ({"schema": ref_chain(2100)}, "characters"),
        ({"schema": anyof_chain(650)}, chain_end),
        ({"schema": anyof_chain(700)}, "subschemas"),
        ({"schema": {"anyOf": consts}}, validates({"anyOf": consts})),
        ({"schema": {"anyOf": consts + [True]}}, "subschemas"),
        ({"schema": nested(MAX_SCHEMA_DEPTH - 1, lambda s: {"type": "array", "items": s, **single}), "steps": 300},
         validates(nested(MAX_SCHEMA_DEPTH - 1, lambda s: {"type": "array", "items": s, **single}))),
        ({"schema": nested(MAX_SCHEMA_DEPTH, lambda s: {"type": "array", "items": s, **single})}, "deeper than"),
        ({"schema": nested(MAX_SCHEMA_DEPTH // 2 - 1, lambda s: {**prop, "properties": {"a": s}}), "steps": 300},
         validates(nested(MAX_SCHEMA_DEPTH // 2 - 1, lambda s: {**prop, "properties": {"a": s}}))),
        ({"schema": nested(MAX_SCHEMA_DEPTH // 2, lambda s: {**prop, "properties": {"a": s}})}, "deeper than"),
        ({"kind": "regex", "text": "(" + "|".join(alternation) + ")"}, one_of(alternation)),
        ({"kind": "regex", "text": "(" + "|".join(alternation) + "|" + "x" * 20 + ")"}, "characters"),
        ({"kind": "lark", "text": "start: " + " | ".join(json.dumps(w) for w in lark_words)}, one_of(lark_words)),
        ({"kind": "lark", "text": "start: " + " | ".join(json.dumps(w) for w in WORDS[:ROW_ITEMS + 1])}, "matcher's limits"),
        ({"schema": {"enum": enum_words}}, one_of([json.dumps(w) for w in enum_words])),
        ({"schema": {"enum": enum_words + ["x" * 20]}}, "characters"),
        ({"kind": "regex", "text": literal, "steps": 40}, starts(literal)),
        ({"kind": "regex", "text": literal + "x"}, "characters"),
        ({"kind": "lark", "text": f"start: {json.dumps(literal[:MAX_TEXT - 9])}", "steps": 40}, starts(literal[:MAX_TEXT - 9])),
        ({"schema": {"const": literal[:MAX_TEXT - 20]}, "steps": 40}, starts(json.dumps(literal[:MAX_TEXT - 20]))),
        ({"kind": "regex", "text": f"[a-c]{{2,{MAX_REPEATED + 1}}}", "seed": 3}, holds(f"[a-c]{{2,{MAX_REPEATED + 1}}}")),
        ({"kind": "regex", "text": f"[a-c]{{2,{MAX_REPEATED + 2}}}"}, "repetitions"),
        ({"kind": "regex", "text": "((a{32}){32}){32}", "steps": 30}, starts("a" * 32 ** 3)),
        ({"kind": "regex", "text": "((a{32}){32}){33}"}, "repetitions"),
        ({"kind": "lark", "text": f'start: "ab"{{{MAX_REPEATED // 2}}}', "steps": 30}, starts("ab" * (MAX_REPEATED // 2))),
        ({"kind": "lark", "text": f'start: "ab"{{{MAX_REPEATED // 2 + 2}}}'}, "repetitions"),
        ({"kind": "lark", "text": f"start: /x{{{MAX_REPEATED + 2}}}/"}, "repetitions"),
        ({"schema": {"type": "string", "pattern": f"^[a-c]{{{MAX_REPEATED // 2}}}$"}, "steps": 30},
         lambda text, done: re.fullmatch(r'"[a-c]*', text)),
        ({"schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^x{{{MAX_REPEATED // 2 + 2}}}$"},
                                                      "b": {"type": "string", "pattern": f"^y{{{MAX_REPEATED // 2 + 2}}}$"}}}},
         "repetitions"),
        ({"schema": {"type": "object", "patternProperties": dict(list(patterns.items())[:MAX_PATTERN_PROPERTIES]),
                     "additionalProperties": False}, "steps": 60},
         validates({"type": "object", "patternProperties": dict(list(patterns.items())[:MAX_PATTERN_PROPERTIES]),
                    "additionalProperties": False})),
        ({"schema": {"type": "object", "patternProperties": patterns}}, "patternProperties"),
    ]


def random_regex(rng: random.Random, depth: int = 0) -> str:
    """A regex of classes, literals, groups and alternations under counted repetitions (Python and Rust
    read it alike), its counts drawn so that some expand past MAX_REPEATED."""
    parts = []
    for _ in range(rng.randint(1, 3)):
        if depth < 3 and rng.random() < 0.4:
            part = "(" + "|".join(random_regex(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"
        else:
            part = rng.choice(["[a-c]", "x", "yz", "[0-9]", "[^<]"])
        count = rng.choice(["", "?", "*", "+", f"{{{rng.randint(1, 64)}}}", f"{{0,{rng.choice([8, 8, 200, 2000, 40_000])}}}"])
        parts.append(part + count)
    return "".join(parts)


def random_schema(rng: random.Random, depth: int, defs: list[str], budget: list[int]) -> dict:
    """A schema tree of objects, arrays, anyOf, enums, consts, bounded integers and `$ref`s to `defs`, of at
    most budget[0] subschemas in all (budgets are drawn so that some pass MAX_SUBSCHEMAS)."""
    budget[0] -= 1
    kind = rng.choice(["object", "array", "anyOf", "leaf", "ref"]) if depth < 12 and budget[0] > 0 else "leaf"
    width = min(rng.choice([1, 2, 3, 300]), max(budget[0], 1))
    if kind == "object":
        names = [f"p{i}" for i in range(width)]
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1, defs, budget) for n in names},
                "required": names[:1], "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1, defs, budget), "maxItems": rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1, defs, budget) for _ in range(width)]}
    if kind == "ref" and defs:
        return {"$ref": f"#/$defs/{rng.choice(defs)}"}
    return rng.choice([{"type": "boolean"}, {"type": "integer", "minimum": -9, "maximum": 99}, {"const": "k"},
                       {"enum": ["a", "b", None]}, {"type": "null"}])


def generated_at_random(count: int) -> list[tuple[dict, object]]:
    rng = random.Random(52)
    cases = []
    for i in range(count):
        regex = random_regex(rng)
        cases.append(({"kind": "regex", "text": regex, "seed": i, "steps": 40}, holds(regex)))
        budget = [rng.choice([30, 300, 1500, 3000])]
        names = [f"d{j}" for j in range(rng.randint(0, 4))]
        defs = {name: random_schema(rng, 6, names[j + 1:], budget) for j, name in enumerate(names)}   # no cycles
        schema = {**random_schema(rng, 0, names, budget), **({"$defs": defs} if defs else {})}
        cases.append(({"schema": schema, "seed": i, "steps": 150}, validates(schema)))
    return cases


def test_constraints_at_and_past_the_limits_compile_and_hold_or_are_named_request_errors(tokenizer):
    cases = at_and_past_the_limits()
    for (case, check), outcome in zip(cases, compile_in_worker(tokenizer, [case for case, _ in cases])):
        where = json.dumps(case)[:160], outcome["outcome"][:300]
        if isinstance(check, str):
            assert outcome["outcome"].startswith("RequestError") and check in outcome["outcome"], where
        else:
            assert outcome["outcome"] == "ok" and check(outcome["text"], outcome["done"]), (where, outcome["text"][:200])


def test_random_regexes_and_schemas_hold_or_are_request_errors(tokenizer):
    cases = generated_at_random(30)
    outcomes = compile_in_worker(tokenizer, [case for case, _ in cases])
    for (case, check), outcome in zip(cases, outcomes):
        assert outcome["outcome"] == "ok" or outcome["outcome"].startswith("RequestError"), (case, outcome)
        if outcome["outcome"] == "ok":
            assert check(outcome["text"], outcome["done"]), (case, outcome["text"])
    assert sum(o["outcome"] == "ok" for o in outcomes) > len(cases) // 2, [o["outcome"][:100] for o in outcomes]
    assert max(o["seconds"] for o in outcomes) < 10
