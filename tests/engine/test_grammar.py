"""Constrained decoding on a tiny random model, whose unconstrained text is noise: every reply matches its
regex, validates against its JSON schema (checked by `jsonschema`) or parses by its grammar, sampled or
greedy, alone or sixteen in one continuous batch with a matcher each; bad constraints fail closed."""
from __future__ import annotations

import json
import queue
import re

import jsonschema
import pytest

from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.grammar import Constraint, check_schema, constraint_of
from soma_runtime.errors import RequestError
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model

SCHEMAS = [
    {"type": "object", "properties": {"tier": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "slot": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["tier", "slot"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{6}$"}}, "required": ["id"],
     "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x"],
                     "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}}, "required": ["a", "b"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-grammar"))
    build_model("llama", directory)
    return Runtime("cpu").load(directory, progress=False)


def generated(model, constraint, **params) -> str:
    params = {"max_tokens": 200, **params}
    return "".join(t.text for t in model.generate("The quick brown fox", constraint=constraint, **params))


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_replies_validate_against_their_schema(tiny, schema, sampling):
    text = generated(tiny, Constraint.json_schema(schema), **sampling)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_grammar_replies_match(tiny, seed):
    pattern = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}\."
    assert re.fullmatch(pattern, generated(tiny, Constraint("regex", pattern), temperature=1.0, seed=seed))
    lark = 'start: item ("," item)*\nitem: /[0-9]+/ | "fox"\n'
    assert re.fullmatch(r"([0-9]+|fox)(,([0-9]+|fox))*", generated(tiny, Constraint("lark", lark), temperature=1.0, seed=seed))
    gbnf = 'root ::= "yes" | "no"'
    assert generated(tiny, constraint_of(grammar=gbnf), temperature=1.0, seed=seed) in ("yes", "no")


def together(engine, requests) -> list[list]:
    """Each request's tokens, all submitted at once to a scheduler of their own (which must batch them)."""
    scheduler = Scheduler(engine, max_batch=16)
    try:
        inbox, tokens, open_jobs = queue.Queue(), [[] for _ in requests], len(requests)
        for i, req in enumerate(requests):
            scheduler.submit(req, lambda item, i=i: inbox.put((i, item)))
        while open_jobs:
            i, item = inbox.get(timeout=120)
            assert not isinstance(item, Exception), item
            if item is None:
                open_jobs -= 1
            else:
                tokens[i].append(item)
        assert scheduler.stats.max_batch > 1
    finally:
        scheduler.close()
    return tokens


def test_sixteen_constrained_streams_in_one_batch(tiny):
    """Each sequence in a continuous batch keeps its own matcher; the scheduler runs them together."""
    reqs = [tiny.request(tiny.prompt_ids(f"Prompt {i}"), 120, constraint=Constraint.json_schema(SCHEMAS[i % len(SCHEMAS)]),
                         temperature=1.0, seed=i) for i in range(16)]
    for i, tokens in enumerate(together(tiny.engine, reqs)):
        jsonschema.validate(json.loads("".join(t.text for t in tokens)), SCHEMAS[i % len(SCHEMAS)])


def test_mask_time_is_reported(tiny):
    generated(tiny, Constraint.json_schema(SCHEMAS[0]), temperature=0)
    metrics = tiny.metrics()
    assert 0 < metrics["mask_ms_mean"] <= metrics["mask_ms_p99"]


@pytest.mark.parametrize("schema, pointer", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at '/properties/a/not'"),
    ({"type": "array", "items": {"uniqueItems": True}}, "'uniqueItems' at '/items/uniqueItems'"),
    ({"anyOf": [{"type": "string"}, {"if": {}}]}, "'if' at '/anyOf/1/if'"),
    ({"frobnicate": 1}, "'frobnicate' at '/frobnicate'"),
])
def test_unsupported_keywords_fail_closed_naming_their_pointer(schema, pointer):
    with pytest.raises(RequestError, match=re.escape(pointer)):
        check_schema(schema)


@pytest.mark.parametrize("constraint, message", [
    (Constraint("regex", "[a-"), "invalid regex"),
    (Constraint("lark", "start: undefined_rule"), "invalid lark"),
    (Constraint("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "invalid json_schema"),
    (Constraint("json_schema", '{"type": "string", "format": "hostnamex"}'), "Unknown format"),
    (Constraint("regex", r"[^\s\S]"), "matches no text"),
    (Constraint("yaml", "a: 1"), "unknown constraint kind"),
])
def test_bad_constraints_are_request_errors(tiny, constraint, message):
    with pytest.raises(RequestError, match=message):
        tiny.request(tiny.prompt_ids("x"), 8, constraint=constraint)


def test_one_constraint_at_a_time(tiny):
    with pytest.raises(RequestError, match="one constraint"):
        tiny.generate("x", json_schema={"type": "integer"}, regex="[0-9]+")
    with pytest.raises(RequestError, match="not JSON"):
        Constraint.json_schema("{type: integer")


def test_constrained_and_free_streams_share_a_batch_and_keep_their_solo_tokens(tiny):
    """Free streams stay sampled where the model runs (only their tokens come back); constrained ones get
    their logits; each stream's tokens are what it gets alone."""
    def requests():
        return [tiny.request(tiny.prompt_ids(f"Prompt {i}"), 40, temperature=0.8, seed=i,
                             constraint=Constraint.json_schema(SCHEMAS[i % len(SCHEMAS)]) if i % 2 else None) for i in range(6)]
    alone = [[t.id for t in tiny.scheduler.run(req)] for req in requests()]
    assert [[t.id for t in tokens] for tokens in together(tiny.engine, requests())] == alone


def test_a_masked_draw_equals_the_draw_over_the_masked_vocabulary():
    """The sampler runs over the allowed tokens alone (fast on a 128k vocabulary); it must choose what the
    whole pipeline chooses with every other logit at -inf, for the same uniform."""
    import numpy as np

    from soma_runtime.engine.generate.sampling import Sampler, SamplingParams
    from soma_runtime.ir.sampling import choose
    rng = np.random.default_rng(0)
    for trial in range(300):
        logits = (rng.standard_normal(1000) * 3).astype(np.float32)
        allowed = rng.random(1000) < rng.choice([0.005, 0.05, 0.5, 1.0])
        allowed[trial % 1000] = True
        params = SamplingParams(temperature=float(rng.choice([0, 0.7, 1.3])), top_k=int(rng.choice([0, 1, 5, 40, 2000])),
                                top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0, 0.05, 0.2])), seed=trial)
        masked = np.where(allowed, logits, -np.inf)
        expected = choose(masked, Sampler(params).draw())
        assert Sampler(params)(logits, [], [], np.flatnonzero(allowed)) == expected, (trial, params)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.5, 1.0])
def test_allowed_ids_are_the_masks_set_bits(density):
    import numpy as np

    from soma_runtime.engine.grammar import set_bits
    rng = np.random.default_rng(1)
    bits = rng.random(1000) < density
    words = np.packbits(np.pad(bits, (0, 1024 - 1000)), bitorder="little").view(np.int32)
    assert np.array_equal(set_bits(words, 1000), np.flatnonzero(bits))
