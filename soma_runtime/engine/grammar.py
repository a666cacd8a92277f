"""Grammar-constrained decoding through llguidance: a request's `Constraint` (JSON schema, any JSON
object, regex, Lark or GBNF grammar), compiled once per tokenizer and cached by (kind, text), and each
sequence's `Guide`, whose token mask is computed on a worker thread while the step's forward runs, then
applied to the logits before sampling.

A constraint may start `after` a marker in the generated text (the end of a reasoning block, a tool
call's opening tag): until then the stream runs free. Bad schemas and grammars fail closed: a
RequestError naming the keyword and its JSON pointer, or llguidance's own reason. Knows tokens and
text, nothing of models or backends.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from soma_runtime.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
CACHED_GRAMMARS = 256
MAX_TEXT = 1 << 20               # a schema or grammar's characters

# the JSON Schema keywords llguidance enforces, and the annotations that constrain nothing
ENFORCED = {"type", "properties", "required", "additionalProperties", "patternProperties", "items", "prefixItems",
            "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
            "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "multipleOf", "minProperties", "maxProperties"}
ANNOTATIONS = {"$schema", "$id", "$anchor", "$comment", "title", "description", "default", "examples", "readOnly",
               "writeOnly", "deprecated", "x-guidance", "strict"}
# between JSON tokens: a space, or one line break and an indent (as llama.cpp's grammars): a model cannot
# spin in whitespace forever, and pretty-printed JSON still fits
JSON_OPTIONS = {"whitespace_pattern": r"[ ]?|\n[ \t]{0,20}"}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match: `text` is the schema (JSON text), regex or grammar of `kind`.
    With `after`, the constraint starts once the generated text holds that marker."""
    kind: str
    text: str
    after: str | None = None

    @classmethod
    def json_schema(cls, schema, after: str | None = None) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(f"the JSON schema is not JSON: {e}") from None
        return cls("json_schema", json.dumps(schema, sort_keys=True), after)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (RequestError where the text is malformed)."""
        if self.kind not in KINDS:
            raise RequestError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not isinstance(self.text, str) or len(self.text) > MAX_TEXT:
            raise RequestError(f"a {self.kind} constraint must be text of at most {MAX_TEXT} characters")
        if self.kind == "json_schema":
            try:
                check_schema(json.loads(self.text))
            except json.JSONDecodeError as e:
                raise RequestError(f"the JSON schema is not JSON: {e}") from None
        try:
            if self.kind in ("json_schema", "json_object"):
                schema = self.text if self.kind == "json_schema" else '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            return llguidance.LLMatcher.grammar_from_lark(lark_of_gbnf(self.text) if self.kind == "gbnf" else self.text)
        except (ValueError, RuntimeError) as e:
            raise RequestError(f"invalid {self.kind}: {e}") from None


def lark_of_gbnf(text: str) -> str:
    """llama.cpp's GBNF as Lark (llguidance's converter raises plain Exceptions on a bad grammar)."""
    try:
        return gbnf_to_lark(text)
    except Exception as e:
        raise RequestError(f"invalid gbnf: {e}") from e


def constraint_of(json_schema=None, regex: str | None = None, grammar: str | None = None,
                  json_object: bool = False) -> Constraint | None:
    """The one constraint a library call gives, if any: a JSON schema (object or text), any JSON object, a
    regex, or a grammar (GBNF where it uses `::=`, else Lark)."""
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                  ("json_object", json_object or None)) if v is not None]
    if len(given) > 1:
        raise RequestError(f"give one constraint, not {' and '.join(given)}")
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint("regex", regex)
    if grammar is not None:
        return Constraint("gbnf" if isinstance(grammar, str) and "::=" in grammar else "lark", grammar)
    return Constraint("json_object", "") if json_object else None


def check_schema(schema, pointer: str = "") -> None:
    """RequestError naming the first keyword llguidance would not enforce, with its JSON pointer: a
    constraint never silently drops part of a schema."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(f"JSON schema at '{pointer or '/'}' must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        at = f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise RequestError(f"unsupported JSON schema keyword {key!r} at '{at}'")
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{at}/{name.replace('~', '~0').replace('/', '~1')}")
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}")
        elif key in ("items", "additionalProperties") and isinstance(value, (dict, bool)):
            check_schema(value, at)
        elif key == "items" and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}")


class Grammars:
    """One tokenizer's compiled constraints: a validated prototype matcher per (kind, text), copied for
    each sequence. The llguidance tokenizer is built on first use (a fraction of a second)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self.source, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, eos_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self.source, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tokenizer

    def guide(self, constraint: Constraint) -> Guide:
        """A fresh Guide for one sequence (RequestError for a constraint that cannot be enforced)."""
        return Guide(self.prototype(constraint).deep_copy(), constraint.after, self.vocab_size)

    def prototype(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The constraint's compiled matcher, from the cache or compiled now (never consumed: copied per sequence)."""
        key = (constraint.kind, constraint.text)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        prototype = self.compile(constraint)
        with self.lock:
            self.cache[key] = prototype
            while len(self.cache) > CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return prototype

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = constraint.grammar()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise RequestError(f"invalid {constraint.kind}: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {constraint.kind}: {matcher.get_error()}")
        mask, first = allocate_token_bitmask(1, self.vocab_size), matcher.deep_copy()
        fill_next_token_bitmask(first, mask)
        if first.is_error() or not mask.any():
            raise RequestError(f"the {constraint.kind} matches no text")
        return matcher


MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="soma-grammar")   # llguidance drops the GIL
BIT = np.arange(32)


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    """The positions (< n) of the set bits of int32 `words`, ascending. A JSON grammar's mask is mostly
    zero words: only the others are unpacked (a 128k vocabulary's whole mask takes ten times longer)."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) > len(words) // 8:
        return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:n])
    bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32).view(bool)
    ids = (nonzero[:, None] * 32 + BIT)[bits]
    return ids[ids < n]


class Guide:
    """One sequence's constraint state: waits for its marker, then masks each step's logits to the tokens
    the grammar allows, consuming each token chosen; `done` once the grammar is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, after: str | None, vocab_size: int):
        self.matcher, self.waiting_for, self.vocab_size = matcher, after, vocab_size
        self.seen = ""                                   # the generated text's tail, while waiting for the marker
        self.mask = allocate_token_bitmask(1, vocab_size)
        self.ids: np.ndarray | None = None               # the tokens allowed next, once worked out
        self.ready: Future | None = None
        self.mask_seconds: list[float] = []

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken, which llguidance logs): nothing more may follow."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())

    def prepare(self) -> None:
        """Start computing the next step's mask (on the worker thread, beside the forward)."""
        if self.active and self.ready is None and self.ids is None:
            self.ready = MASKS.submit(self._fill)

    def _fill(self) -> None:
        start = time.perf_counter()
        fill_next_token_bitmask(self.matcher, self.mask)             # no numpy here: the GIL stays free
        self.mask_seconds.append(time.perf_counter() - start)

    def allowed(self) -> np.ndarray | None:
        """The token ids the grammar allows next, ascending (the same until a token is taken); None while
        the constraint has not started."""
        if not self.active:
            return None
        self.prepare()
        if self.ready is not None:
            self.ready.result()
            self.ready = None
            self.ids = set_bits(self.mask[0], self.vocab_size)
        return self.ids

    def advance(self, token: int, piece: str) -> None:
        """Take the chosen token (`piece`, its text): the grammar consumes it, or it may reveal the marker."""
        if self.active:
            self.ids = None
            self.matcher.consume_token(token)          # a token the mask allowed: refused only by a broken matcher
            return
        self.seen = (self.seen + piece)[-4 * len(self.waiting_for):]
        if self.waiting_for in self.seen:
            self.waiting_for = None
