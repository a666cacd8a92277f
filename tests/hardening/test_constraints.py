"""Structured output under hostile constraints (issue 52, faults 1, 2, 3 and 17): grammars and schemas
past the size and depth limits are RequestErrors (400s on the server, one line from the CLI), never a
dead process; those within them compile on a stack of their own, whatever the caller's; tool lists and
tool_choice of the wrong shape are named; a regex whose counted repetitions expand past the limit is
refused, and a matcher that breaks mid-generation is an error, never an empty reply; the compiled
grammars kept are bounded by memory.

Whatever could crash is compiled in a worker process (`python -m tests.hardening.test_constraints`), on a
caller's thread of WORKER_STACK as a server's may be, so a regression kills the worker, not pytest."""
from __future__ import annotations

import json
import os
import random
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from soma_runtime.engine.grammar import (
    CACHE_BYTES,
    MAX_REPEATED,
    MAX_RULES,
    MAX_SCHEMA_DEPTH,
    MAX_SUBSCHEMAS,
    MAX_TEXT,
    Constraint,
    Grammars,
    Guide,
    matcher_bytes,
)
from soma_runtime.errors import RequestError

WORKER_STACK = 512 << 10          # the thread a worker compiles from (a chain of ~150 rules overflowed it before)
WORKER_MEMORY = 4 << 30           # the worker's address space past what it maps at start
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
                                                                               "properties": {"city": {"type": "string"}}}}}


def lark_chain(n: int) -> str:
    """A Lark grammar of n + 1 rules, each the next one: its only sentence is "x"."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int, link=lambda ref: {"$ref": ref}) -> dict:
    """A schema whose n definitions each lead to the next (through `link`), the last an integer."""
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 99}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def anyof_chain(n: int) -> dict:
    """n definitions, each null or the next."""
    return ref_chain(n, lambda ref: {"anyOf": [{"$ref": ref}, {"type": "null"}]})


def nested(n: int, wrap) -> dict:
    schema = {"type": "boolean"}
    for _ in range(n):
        schema = wrap(schema)
    return schema


@dataclass
class TinyTokenizer:
    path: str
    vocab: int
    eos: int


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TinyTokenizer:
    from tests.fixtures.decoders import build_tokenizer
    directory = str(tmp_path_factory.mktemp("constraint-tokenizer"))
    tok = build_tokenizer(directory)
    return TinyTokenizer(os.path.join(directory, "tokenizer.json"), tok.get_vocab_size(), tok.token_to_id("<|im_end|>"))


def compile_in_worker(tokenizer: TinyTokenizer, cases: list[dict], timeout: float = 120) -> list[dict]:
    """Each case ({kind, text} or {schema}, optional steps and seed) compiled, then generated from for a
    few steps, in a worker process: per case its outcome ('ok' or the error), text and whether the grammar
    completed. Fails naming the case the worker died on, if it dies."""
    proc = subprocess.run([sys.executable, "-m", "tests.hardening.test_constraints", tokenizer.path, str(tokenizer.vocab),
                           str(tokenizer.eos)], input=json.dumps(cases), capture_output=True, text=True, timeout=timeout,
                          check=False)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    outcomes = [line for line in lines if "outcome" in line]
    started = [line["started"] for line in lines if "started" in line]
    assert proc.returncode == 0 and len(outcomes) == len(cases), \
        f"the worker ended with {proc.returncode} in case {started[-1] if started else None}: {proc.stderr[-3000:]}"
    return outcomes


def worker(tokenizer_path: str, vocab: int, eos: int, cases: list[dict]) -> None:
    """The worker's side: one JSON line as each case starts, one with its outcome."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + WORKER_MEMORY, mapped + WORKER_MEMORY))
    threading.stack_size(WORKER_STACK)          # every thread started here but the compiler's
    with open(tokenizer_path) as f:
        grammars = Grammars(f.read(), vocab, [eos])
    for i, case in enumerate(cases):
        print(json.dumps({"started": i}), flush=True)
        outcome: dict = {}
        thread = threading.Thread(target=lambda case=case, outcome=outcome: outcome.update(run_case(grammars, case, eos)))
        thread.start()
        thread.join()
        print(json.dumps({"case": i, **outcome}), flush=True)


def run_case(grammars: Grammars, case: dict, eos: int) -> dict:
    """Compile the case, then take random allowed tokens (stopping where the grammar may end, at times)."""
    start, ids, done = time.perf_counter(), [], False
    rng = random.Random(case.get("seed", 0))
    try:
        constraint = Constraint.json_schema(case["schema"]) if "schema" in case else Constraint(case["kind"], case["text"])
        guide = grammars.guide(constraint)
        for _ in range(case.get("steps", 100)):
            allowed = [int(t) for t in guide.allowed()]
            if eos in allowed and (len(allowed) == 1 or rng.random() < 0.3):
                done = True
                break
            token = rng.choice([t for t in allowed if t != eos])
            guide.advance(token, "")
            ids.append(token)
            done = guide.done
            if done:
                break
        outcome = "ok"
    except RequestError as e:
        outcome = f"RequestError: {e}"
    except Exception as e:                          # noqa: BLE001  (what the tests look for: reported, never hidden)
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "text": grammars.tokenizer.decode_str(ids), "done": done,
            "seconds": time.perf_counter() - start}


# fault 1: the process died by SIGSEGV

def test_chains_of_3000_rules_refs_and_anyofs_are_request_errors_not_a_dead_process(tokenizer):
    cases = [{"kind": "lark", "text": lark_chain(3000)}, {"kind": "gbnf", "text": gbnf_chain(3000)},
             {"kind": "json_schema", "text": json.dumps(ref_chain(3000))}, {"schema": ref_chain(3000)},
             {"schema": json.dumps(anyof_chain(3000))}, {"schema": anyof_chain(1000)}]
    for case, outcome in zip(cases, compile_in_worker(tokenizer, cases)):
        assert outcome["outcome"].startswith("RequestError"), (case.get("kind"), outcome)
        assert any(str(limit) in outcome["outcome"] for limit in (MAX_RULES, MAX_SUBSCHEMAS, MAX_TEXT)), outcome


def test_chains_within_the_limits_compile_on_their_own_stack_and_hold(tokenizer):
    """From a 512 KiB thread, chains that overflowed an 8 MiB one (2,600 rules, 1,000 anyOf links) at
    the limits' scale: each compiles, and what is generated is its language's."""
    cases = [{"kind": "lark", "text": lark_chain(MAX_RULES - 2)}, {"kind": "gbnf", "text": gbnf_chain(MAX_RULES - 2)},
             {"schema": ref_chain(1800)}, {"schema": anyof_chain(650), "seed": 1}, {"schema": anyof_chain(650), "seed": 2}]
    outcomes = compile_in_worker(tokenizer, cases)
    assert [o["outcome"] for o in outcomes] == ["ok"] * len(cases), outcomes
    assert [o["text"] for o in outcomes[:2]] == ["x", "x"]
    for outcome in outcomes[2:]:
        value = json.loads(outcome["text"])
        assert outcome["done"] and (value is None or 0 <= value <= 99), outcome


def test_the_cli_refuses_a_chain_of_3000_refs_in_one_line(tmp_path):
    (tmp_path / "refs.json").write_text(json.dumps(ref_chain(3000)))
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "run", "--chat", "--prompt", "hi", "--json-schema",
                        str(tmp_path / "refs.json")], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("soma-runtime: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def still_serving(server):
    status, body = server.post("/v1/chat/completions", CHAT)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


@pytest.mark.parametrize("body, needle", [
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ref_chain(3000)}}},
     "characters"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": anyof_chain(1000)}}},
     "subschemas"),
    ({**CHAT, "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": '{"items":' * 10_000 + "{}" + "}" * 10_000}}},
     "characters"),
    ({**CHAT, "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": '{"items":' * 900 + "{}" + "}" * 900}}}, "deeper than"),
    ({"model": "default", "prompt": "x", "max_tokens": 2, "grammar": lark_chain(3000)}, "rules"),
    ({"model": "default", "prompt": "x", "max_tokens": 2, "regex": "a{1000000}"}, "repetitions"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": {"function": "weather"}}, "tool_choice"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": "weather"}, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0]"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text content part"),
])
def test_the_server_answers_hostile_constraints_with_400s_and_serves_on(server, body, needle):
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, error = server.post(route, body)
    assert status == 400 and needle in error["error"]["message"], (status, error)
    still_serving(server)


# fault 2: RecursionError and AttributeError tracebacks

@pytest.mark.parametrize("depth", [65, 900, 10_000])
def test_a_schema_nested_past_the_depth_limit_is_a_request_error(depth):
    as_text = '{"items":' * depth + "{}" + "}" * depth
    as_value = nested(depth, lambda schema: {"items": schema})
    for schema in (as_text, as_value):
        with pytest.raises(RequestError, match=f"deeper than {MAX_SCHEMA_DEPTH}|characters"):
            Constraint.json_schema(schema)
    assert Constraint.json_schema(nested(MAX_SCHEMA_DEPTH - 1, lambda schema: {"items": schema})).kind == "json_schema"


def test_a_schema_sharing_its_subschemas_is_measured_not_written_out():
    """Thirty levels of two references to one subschema hold 31 objects and write out to 2^30 of them."""
    schema = {"type": "integer"}
    for _ in range(30):
        schema = {"anyOf": [schema, schema]}
    start = time.perf_counter()
    with pytest.raises(RequestError, match="characters|subschemas"):
        Constraint.json_schema(schema)
    assert time.perf_counter() - start < 1


def test_a_schema_json_cannot_write_is_a_request_error():
    for schema in ({"enum": {1, 2}}, {1: {"type": "integer"}}, {"maximum": 10 ** 5000}):
        with pytest.raises(RequestError):
            Constraint.json_schema(schema)


def turn(tools, tool_choice):
    from soma_runtime.text.chat import ChatTemplate
    from soma_runtime.tools.turn import Turn
    from tests.fixtures.decoders import CHATML
    return Turn(ChatTemplate(CHATML), [{"role": "user", "content": "Weather?"}], tools, tool_choice)


@pytest.mark.parametrize("tool_choice, needle", [
    ({"function": "weather"}, "tool_choice must be"),
    ({"type": "function", "function": {"name": 5}}, "tool_choice must be"),
    ({"type": "function", "function": {"name": "clock"}}, "not among the tools"),
    ("weather", "tool_choice must be"),
    (["auto"], "tool_choice must be"),
])
def test_tool_choice_of_another_shape_is_a_request_error(tool_choice, needle):
    with pytest.raises(RequestError, match=needle):
        turn([WEATHER], tool_choice)


def test_tool_choice_required_without_tools_is_a_request_error():
    with pytest.raises(RequestError, match="needs tools"):
        turn(None, "required")
    assert turn(None, "auto").constraint is None


@pytest.mark.parametrize("tools, needle", [
    ({"weather": WEATHER}, "must be a list"),
    ([WEATHER] * 2, "two tools are named"),
    ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)], "at most 128"),
    ([{"type": "function", "function": {"name": "has space"}}], "name must be"),
    ([{"type": "retrieval", "function": {"name": "weather"}}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "weather", "parameters": {"properties": []}}}], "object of schemas"),
    ([{"type": "function", "function": {"name": "weather", "parameters": ref_chain(3000)}}], "characters"),
])
def test_tools_of_another_shape_are_request_errors(tools, needle):
    with pytest.raises(RequestError, match=needle):
        turn(tools, "auto")


# fault 3: a regex broken by its own size answered with an empty reply

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import build_model
    directory = str(tmp_path_factory.mktemp("tiny-constraints"))
    build_model("llama", directory)
    return Runtime("cpu").load(directory, progress=False)


@pytest.mark.parametrize("regex", ["a{1000000}", "((a{100}){100}){100}", "(ab{40}){1000}"])
def test_a_regex_whose_repetitions_expand_past_the_limit_is_refused(tiny, regex):
    with pytest.raises(RequestError, match=f"repetitions .* {MAX_REPEATED}"):
        tiny.generate("x", regex=regex, max_tokens=4)
    assert re.fullmatch("[a-c]{2,30000}", tiny.complete("x", regex="[a-c]{2,30000}", max_tokens=8, temperature=0))


def test_a_matcher_that_breaks_mid_generation_is_an_error_not_an_empty_reply(tokenizer):
    """llguidance's copies share a lexer whose budget a{1000000} spends on the first mask: the next copy
    breaks. Such a sequence must end in an error, not stop as if its grammar were complete."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    with open(tokenizer.path) as f:
        grammars = Grammars(f.read(), tokenizer.vocab, [tokenizer.eos])
    constraint = Constraint("regex", "a{1000000}")
    prototype = llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_regex(constraint.text), log_level=0)
    fill_next_token_bitmask(prototype.deep_copy(), allocate_token_bitmask(1, tokenizer.vocab))
    guide = Guide(prototype.deep_copy(), constraint, tokenizer.vocab)
    with pytest.raises(RequestError, match="broke off mid-generation.*too many expressions"):
        guide.allowed()


def test_a_constraint_breaking_mid_batch_ends_its_own_request_alone(tiny, monkeypatch):
    """Three requests batched, the second's matcher breaks on its fourth step: it alone ends with the error;
    the other two get the tokens they get alone."""
    import queue

    from soma_runtime.engine.generate.batching import Scheduler
    allowed, steps = Guide.allowed, {}

    def breaking(guide):
        steps[id(guide)] = steps.get(id(guide), 0) + 1
        if steps[id(guide)] > 3:
            raise RequestError("the regex constraint broke off mid-generation (the test's)")
        return allowed(guide)
    monkeypatch.setattr(Guide, "allowed", breaking)
    broken = Constraint("regex", "[a-z ]+")

    def request(i):
        return tiny.request(tiny.prompt_ids(f"Prompt {i}"), 12, temperature=0, constraint=broken if i == 1 else None)
    alone = {i: [t.id for t in tiny.scheduler.run(request(i))] for i in (0, 2)}
    scheduler, inbox = Scheduler(tiny.engine, max_batch=8), queue.Queue()
    got = {0: [], 1: [], 2: []}
    try:
        for i in range(3):
            scheduler.submit(request(i), lambda item, i=i: inbox.put((i, item)))
        ended = 0
        while ended < 3:
            i, item = inbox.get(timeout=120)
            ended += item is None or isinstance(item, Exception)
            got[i].append(item if item is None or isinstance(item, Exception) else item.id)
    finally:
        scheduler.close()
    assert isinstance(got[1][-1], RequestError) and "broke off" in str(got[1][-1])
    assert got[0] == [*alone[0], None] and got[2] == [*alone[2], None]


# fault 17: the cache was bounded by count alone, and a constraint could be 1 MiB

def test_the_grammar_cache_is_bounded_by_memory(tokenizer):
    with open(tokenizer.path) as f:
        grammars = Grammars(f.read(), tokenizer.vocab, [tokenizer.eos])
    constraints = [Constraint("regex", f"{i}" + "xy" * (MAX_TEXT // 2 - 1)) for i in range(6)]
    for constraint in constraints:
        grammars.prototype(constraint)
    assert len(grammars.cache) == CACHE_BYTES // matcher_bytes(constraints[0]) < len(constraints)
    assert grammars.cached_bytes <= CACHE_BYTES and list(grammars.cache)[-1] == ("regex", constraints[-1].text)


def test_a_constraint_past_the_text_limit_is_refused_before_compiling(tiny):
    assert MAX_TEXT <= 256 << 10
    for constraint in (Constraint("regex", "x" * (MAX_TEXT + 1)), Constraint("lark", 'start: "' + "x" * MAX_TEXT + '"'),
                       Constraint("json_schema", json.dumps({"const": "x" * MAX_TEXT}))):
        with pytest.raises(RequestError, match=f"{MAX_TEXT}"):
            tiny.request(tiny.prompt_ids("x"), 4, constraint=constraint)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.stdin.read()))
