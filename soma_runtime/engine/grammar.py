"""Grammar-constrained decoding through llguidance: a request's `Constraint` (JSON schema, any JSON
object, regex, Lark or GBNF grammar), compiled once per tokenizer and cached by (kind, text), and each
sequence's `Guide`, whose token mask is computed on a worker thread while the step's forward runs, then
applied to the logits before sampling.

A constraint may start `after` a marker in the generated text (the end of a reasoning block, a tool
call's opening tag): until then the stream runs free. Bad schemas and grammars fail closed: a
RequestError naming the keyword and its JSON pointer, or llguidance's own reason; so does a matcher
that breaks mid-generation (on its lexer's or parser's limits), never a silent stop. Knows tokens and
text, nothing of models or backends.

What one constraint may cost is bounded before llguidance sees it:
  MAX_TEXT          characters of a schema (as JSON), regex or grammar
  MAX_SCHEMA_DEPTH  levels a JSON schema's objects and arrays nest
  MAX_SUBSCHEMAS    schemas within a schema (properties, items, branches, definitions), which also bounds
                    any chain of `$ref`s; MAX_PATTERN_PROPERTIES per object (compile time grows as their cube)
  MAX_RULES         rules of a Lark or GBNF grammar
  MAX_REPEATED      atoms that counted repetitions (`a{1000}`, `"x"{5,9}`, `x ~ 3`) add once written out:
                    llguidance's lexer expands them, and masks take time in proportion
and compiled on a thread with a COMPILE_STACK stack: llguidance recurses along chains of rules and
`$ref`s (chains of 1,000-2,600 overflowed a thread's 8 MiB default and killed the process), and the
deepest chains within these limits need 4-8 MiB of it; masks and tokens taken need little. The compiled
matchers are cached by estimated memory (CACHE_BYTES) as well as by count.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from soma_runtime.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_TEXT = 64 << 10
MAX_SCHEMA_DEPTH = 64
MAX_SUBSCHEMAS = 2048
MAX_PATTERN_PROPERTIES = 64
MAX_RULES = 2048
MAX_REPEATED = 32_768
COMPILE_STACK = 256 << 20
CACHED_GRAMMARS = 256
CACHE_BYTES = 128 << 20
# a compiled matcher's memory, estimated from its text: measured 16-140 KiB for small ones, 20-470 bytes a
# character for large ones (a long literal the most: its lexer is precomputed over the vocabulary)
MATCHER_BYTES, MATCHER_BYTES_PER_CHAR = 256 << 10, 512
MAX_INT_BITS = 1024              # a schema's integers (Python writes at most 4300 digits)
ERROR_CHARS = 300                # of llguidance's reason in an error message (it may quote the whole grammar)
TERSE = llguidance.LLParserLimits(verbose_errors=False)      # errors without the parser's state (and the grammar)
TERSE_MARK, NOTHING_ALLOWED = "<non-verbose/>", "NoExtensionBias"     # in llguidance's error texts

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
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

# the pieces of regex and Lark syntax that repetition counting must step over whole
REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
PLAIN = re.compile(r'[^\\\[\](){}~"/]+')
ESCAPE = re.compile(r"\\(?:[pPxuUN]\{[^}]*\}|[pP]\w|.)?", re.DOTALL)
LARK_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"i?')
LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/[imslux]*")
LARK_COMMENT = re.compile(r"//[^\n]*")
LARK_JSON = re.compile(r"%json\s*")
LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)


def one_line(reason: str) -> str:
    """llguidance's reason on one line, cut short (its parse errors quote the grammar's lines)."""
    reason = " ".join(reason.replace(TERSE_MARK, "").split())
    return reason if len(reason) <= ERROR_CHARS else reason[:ERROR_CHARS] + "..."


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match: `text` is the schema (JSON text), regex or grammar of `kind`.
    With `after`, the constraint starts once the generated text holds that marker."""
    kind: str
    text: str
    after: str | None = None

    @classmethod
    def json_schema(cls, schema, after: str | None = None) -> Constraint:
        """From a schema given as JSON text or as the value itself (checked before it is written out: a
        self-sharing value could write out to far more than it holds)."""
        if isinstance(schema, str):
            schema = parse_schema(schema)
        else:
            check_json(schema)
        try:
            return cls("json_schema", json.dumps(schema, sort_keys=True), after)
        except ValueError as e:             # an integer past Python's digit limit for str()
            raise RequestError(f"the JSON schema cannot be written as JSON: {e}") from None

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (RequestError where the text is malformed or past the limits)."""
        if self.kind not in KINDS:
            raise RequestError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not isinstance(self.text, str) or len(self.text) > MAX_TEXT:
            raise RequestError(f"a {self.kind} constraint must be text of at most {MAX_TEXT} characters")
        if self.kind == "json_schema":
            check_schema(parse_schema(self.text))
        elif self.kind == "regex":
            check_repeated(repeated_atoms(self.text), "regex")
        text = lark_of_gbnf(self.text) if self.kind == "gbnf" else self.text
        if self.kind in ("lark", "gbnf"):
            check_lark(text, self.kind)
        try:
            if self.kind in ("json_schema", "json_object"):
                schema = self.text if self.kind == "json_schema" else '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(text)
            return llguidance.LLMatcher.grammar_from_lark(text)
        except (ValueError, RuntimeError) as e:
            raise RequestError(f"invalid {self.kind}: {one_line(str(e))}") from None


def lark_of_gbnf(text: str) -> str:
    """llama.cpp's GBNF as Lark (llguidance's converter raises plain Exceptions on a bad grammar, and takes
    time as the square of the rules: they are counted first)."""
    rules = text.count("::=")
    if rules > MAX_RULES:
        raise RequestError(f"a gbnf grammar may have at most {MAX_RULES} rules, this one has {rules}")
    try:
        return gbnf_to_lark(text)
    except Exception as e:
        raise RequestError(f"invalid gbnf: {one_line(str(e))}") from e


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


def parse_schema(text: str):
    """A schema given as JSON text, parsed and checked for size and depth (before anything recurses over it)."""
    if len(text) > MAX_TEXT:
        raise RequestError(f"the JSON schema is over the {MAX_TEXT} characters a constraint may have")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the JSON schema is not JSON: {e}") from None
    except RecursionError:                     # nested past the parser's own depth, far past ours
        raise RequestError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    check_json(schema)
    return schema


def check_json(value) -> None:
    """RequestError for a schema that is not JSON, nests deeper than MAX_SCHEMA_DEPTH or writes out to more
    than MAX_TEXT characters. Walked without recursion, stopping at the first excess: a deep or self-sharing
    value costs no more than the limits."""
    size, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = ()                   # levels count objects and arrays, as the server's body check does
        if isinstance(item, dict):
            bad = next((key for key in item if not isinstance(key, str)), None)
            if bad is not None:
                raise RequestError(f"the JSON schema has a key {bad!r}: JSON keys are strings")
            size, children = size + 2 + sum(len(key) + 4 for key in item), item.values()
        elif isinstance(item, (list, tuple)):
            size, children = size + 2 + len(item), item
        elif isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, int) and item.bit_length() > MAX_INT_BITS:
            raise RequestError(f"the JSON schema has an integer of {item.bit_length()} bits")
        elif item is not None and not isinstance(item, (bool, int, float)):
            raise RequestError(f"the JSON schema holds a {type(item).__name__}, which JSON cannot write")
        if size > MAX_TEXT:
            raise RequestError(f"the JSON schema is over the {MAX_TEXT} characters a constraint may have")
        if level > MAX_SCHEMA_DEPTH and isinstance(item, (dict, list, tuple)):
            raise RequestError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        stack.extend((child, level + 1) for child in children)


@dataclass
class SchemaSize:
    subschemas: int = 0
    repeated: int = 0           # the atoms its patterns' counted repetitions add


def check_schema(schema, pointer: str = "") -> SchemaSize:
    """RequestError for a schema past the limits (depth, size, subschemas, patternProperties, repetitions)
    or naming the first keyword llguidance would not enforce, with its JSON pointer: a constraint never
    silently drops part of a schema. The schema's size, where it passes."""
    check_json(schema)
    size = SchemaSize()
    check_keywords(schema, pointer, size)
    check_repeated(size.repeated, "JSON schema's patterns")
    return size


def check_keywords(schema, pointer: str, size: SchemaSize) -> None:
    """check_schema's walk over the subschemas (recursive: check_json bounded the depth first)."""
    size.subschemas += 1
    if size.subschemas > MAX_SUBSCHEMAS:
        raise RequestError(f"a JSON schema may hold at most {MAX_SUBSCHEMAS} subschemas (properties, items, "
                           f"branches, definitions); this one has more (at '{pointer or '/'}')")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(f"JSON schema at '{pointer or '/'}' must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        at = f"{pointer}/{escape(key)}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise RequestError(f"unsupported JSON schema keyword {key!r} at '{at}'")
        if key in SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise RequestError(f"'{key}' at '{at}' must be an object of schemas, got {type(value).__name__}")
            if key == "patternProperties" and len(value) > MAX_PATTERN_PROPERTIES:
                raise RequestError(f"'patternProperties' at '{at}' may have at most {MAX_PATTERN_PROPERTIES} patterns")
            for name, sub in value.items():
                size.repeated += repeated_atoms(name) if key == "patternProperties" else 0
                check_keywords(sub, f"{at}/{escape(name)}", size)
        elif key in SUBSCHEMA_LISTS or (key == "items" and isinstance(value, list)):
            if not isinstance(value, list):
                raise RequestError(f"'{key}' at '{at}' must be a list of schemas, got {type(value).__name__}")
            for i, sub in enumerate(value):
                check_keywords(sub, f"{at}/{i}", size)
        elif key in ("items", "additionalProperties"):
            check_keywords(value, at, size)
        elif key in COUNTS and (type(value) is not int or value < 0):
            raise RequestError(f"'{key}' at '{at}' must be a non-negative integer, got {value!r:.40}")
        elif key == "required" and not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
            raise RequestError(f"'required' at '{at}' must be a list of property names")
        elif key == "pattern":
            if not isinstance(value, str):
                raise RequestError(f"'pattern' at '{at}' must be a regex, got {type(value).__name__}")
            size.repeated += repeated_atoms(value)


def escape(key: str) -> str:
    """A key as a JSON pointer writes it."""
    return key.replace("~", "~0").replace("/", "~1")


def check_lark(text: str, kind: str) -> None:
    """RequestError for a Lark grammar (or a GBNF one, converted) past MAX_RULES or MAX_REPEATED, or whose
    `%json` schemas are past the schema limits (their subschemas counted together)."""
    rules = len(LARK_RULE.findall(text))
    if rules > MAX_RULES:
        raise RequestError(f"a {kind} grammar may have at most {MAX_RULES} rules, this one has {rules}")
    repeated, subschemas = repeated_atoms(text, lark=True), 0
    for found in LARK_JSON.finditer(text):
        try:
            schema, _ = json.JSONDecoder().raw_decode(text, found.end())
        except (ValueError, RecursionError):
            continue                            # not JSON: llguidance says where
        size = check_schema(schema, f"%json at {found.start()}")
        repeated, subschemas = repeated + size.repeated, subschemas + size.subschemas
    if subschemas > MAX_SUBSCHEMAS:
        raise RequestError(f"a {kind} grammar's %json schemas may hold at most {MAX_SUBSCHEMAS} subschemas together")
    check_repeated(repeated, kind)


def check_repeated(atoms: int, what: str) -> None:
    if atoms > MAX_REPEATED:
        raise RequestError(f"the {what}'s counted repetitions (such as a{{1000}}) add over {MAX_REPEATED} items "
                           f"once written out; use unbounded ones (a+, a*) or smaller counts")


def repeated_atoms(text: str, lark: bool = False) -> int:
    """The atoms that counted repetitions add to a regex (with `lark`, a Lark grammar and its regexes) once
    written out: `a{1000}` adds 999, `(ab{3}){10}` 2 + 9 * 4; `*`, `+` and `?` add none. A count of 0 is
    taken as 1 (what it repeats is still compiled). Stops counting past MAX_REPEATED."""
    groups, added, at = [[0, 0]], 0, 0        # per open group: its atoms so far, and its last item's
    while at < len(text) and added <= MAX_REPEATED:
        plain = PLAIN.match(text, at)
        if plain is not None:
            groups[-1][0] += plain.end() - at
            groups[-1][1], at = 1, plain.end()
            continue
        char, atom, end = text[at], 1, at + 1
        repeat = REPEAT.match(text, at) if char == "{" or (lark and char == "~") else None
        if repeat is not None:
            count = max(int(repeat[1] or repeat[3]), int(repeat[2] or repeat[4] or 0), 1)
            group = groups[-1]
            added += group[1] * (count - 1)
            group[0], group[1] = group[0] + group[1] * (count - 1), group[1] * count
            at = repeat.end()
            continue
        string = LARK_STRING.match(text, at) if lark and char == '"' else None
        regex = LARK_REGEX.match(text, at) if lark and char == "/" else None
        if char == "\\":
            end = ESCAPE.match(text, at).end()
        elif string is not None:
            atom, end = max(string.end() - at - 2, 1), string.end()
        elif lark and text.startswith("//", at):
            atom, end = 0, LARK_COMMENT.match(text, at).end()
        elif regex is not None:
            inner = repeated_atoms(regex[1])
            added, atom, end = added + inner, len(regex[1]) + inner, regex.end()
        elif char == "[" and not lark:
            end = class_end(text, at)
        elif char in "([":
            groups.append([0, 0])
            at += 1
            continue
        elif char in ")]" and len(groups) > 1:
            atom = groups.pop()[0]
        groups[-1][0] += atom
        groups[-1][1], at = atom, end
    return added


def class_end(text: str, at: int) -> int:
    """Where the regex character class opening at `at` ends (nested classes, escapes, a leading ']')."""
    depth = 0
    while at < len(text):
        char = text[at]
        if char == "\\":
            at += 2
            continue
        if char == "[":
            depth, at = depth + 1, at + 1
            at += text.startswith("^", at)
            at += text.startswith("]", at)
            continue
        at += 1
        if char == "]":
            depth -= 1
            if depth == 0:
                return at
    return len(text)


STACK_SIZE = threading.Lock()


def on_big_stack(work: Callable[[], object]):
    """`work()` on a thread of its own with a COMPILE_STACK stack; its result, or its exception raised here."""
    outcome: Future = Future()

    def run():
        try:
            outcome.set_result(work())
        except BaseException as e:     # noqa: BLE001  (handed to the caller, whatever it is)
            outcome.set_exception(e)
    with STACK_SIZE:                    # the size is a process setting, read when a thread starts
        previous = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="soma-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    return outcome.result()


def matcher_bytes(constraint: Constraint) -> int:
    """A compiled matcher's memory, estimated from its text."""
    return MATCHER_BYTES + MATCHER_BYTES_PER_CHAR * len(constraint.text)


class Grammars:
    """One tokenizer's compiled constraints: a validated prototype matcher per (kind, text), copied for
    each sequence, the least recently used dropped past CACHED_GRAMMARS or CACHE_BYTES (estimated). The
    llguidance tokenizer is built on first use (a fraction of a second)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self.source, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, eos_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.cached_bytes = 0
        self.lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self.source, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tokenizer

    def guide(self, constraint: Constraint) -> Guide:
        """A fresh Guide for one sequence (RequestError for a constraint that cannot be enforced)."""
        return Guide(self.prototype(constraint).deep_copy(), constraint, self.vocab_size)

    def prototype(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The constraint's compiled matcher, from the cache or compiled now (never consumed: copied per sequence)."""
        key = (constraint.kind, constraint.text)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        prototype = self.compile(constraint)
        with self.lock:
            if key not in self.cache:
                self.cache[key] = prototype
                self.cached_bytes += matcher_bytes(constraint)
            while len(self.cache) > CACHED_GRAMMARS or self.cached_bytes > CACHE_BYTES:
                kind, text = next(iter(self.cache))
                self.cache.popitem(last=False)
                self.cached_bytes -= matcher_bytes(Constraint(kind, text))
        return prototype

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The constraint checked and compiled, on a stack its compile cannot overflow."""
        return on_big_stack(lambda: self.compiled(constraint))

    def compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0, limits=TERSE)
        if matcher.is_error():
            raise RequestError(f"invalid {constraint.kind}: {one_line(matcher.get_error())}")
        mask, first = allocate_token_bitmask(1, self.vocab_size), matcher.deep_copy()
        fill_next_token_bitmask(first, mask)
        if not mask.any() or NOTHING_ALLOWED in first.get_error():
            raise RequestError(f"the {constraint.kind} matches no text")
        allowed = [t for t in set_bits(mask[0], self.vocab_size) if t not in self.eos_ids]
        if allowed:                      # a first row past the parser's limits shows once a token is taken
            first.consume_token(int(allowed[0]))
        if first.is_error():
            raise RequestError(f"the {constraint.kind} is past the matcher's limits: {one_line(first.get_error())}")
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
    the grammar allows, consuming each token chosen; `done` once the grammar is complete. A matcher that
    breaks (on llguidance's limits) raises RequestError: its text so far no longer holds to the constraint."""

    def __init__(self, matcher: llguidance.LLMatcher, constraint: Constraint, vocab_size: int):
        self.matcher, self.kind, self.waiting_for, self.vocab_size = matcher, constraint.kind, constraint.after, vocab_size
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
        """The grammar is complete: nothing more may follow."""
        return self.active and self.matcher.is_stopped()

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
            self.check()
            self.ids = set_bits(self.mask[0], self.vocab_size)
        return self.ids

    def advance(self, token: int, piece: str) -> None:
        """Take the chosen token (`piece`, its text): the grammar consumes it, or it may reveal the marker."""
        if self.active:
            self.ids = None
            self.matcher.consume_token(token)          # a token the mask allowed: refused only by a broken matcher
            self.check()
            return
        self.seen = (self.seen + piece)[-4 * len(self.waiting_for):]
        if self.waiting_for in self.seen:
            self.waiting_for = None

    def check(self) -> None:
        if self.matcher.is_error():
            raise RequestError(f"the {self.kind} constraint broke off mid-generation on the matcher's limits "
                               f"({one_line(self.matcher.get_error())}); a simpler one may hold")
