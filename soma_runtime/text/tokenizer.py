"""Tokenizers: HF `tokenizers` objects, loaded from tokenizer.json or rebuilt from GGUF metadata.

GGUF stores the vocabulary under `tokenizer.ggml.*`. The `gpt2` kind is byte-level BPE whose text
splitting follows llama.cpp's pre-tokenizer named in `tokenizer.ggml.pre`; the `llama` kind is
SentencePiece BPE, its merges recovered from the token scores.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import reprlib

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.text.chat import MAX_TEMPLATE_CHARS

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizers (llama-vocab.cpp): regexes applied in order, each splitting further
PRE_TOKENIZER_SPLITS = {
    "default": [GPT2_SPLIT], "gpt2": [GPT2_SPLIT], "gpt-2": [GPT2_SPLIT],
    "smollm": [r"\p{N}", GPT2_SPLIT],
    "llama3": [LLAMA3_SPLIT], "llama-v3": [LLAMA3_SPLIT], "llama-bpe": [LLAMA3_SPLIT], "smaug-bpe": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT], "deepseek-r1-qwen": [QWEN2_SPLIT],
}
CONTROL, USER_DEFINED = 3, 4
MAX_JSON_BYTES = 256 * 2**20      # far above any real tokenizer.json or config


class Tokenizer:
    """Encode/decode text; knows the special tokens and whether to add BOS."""

    def __init__(self, hf: HFTokenizer, bos: str | None = None, eos: str | None = None, add_bos: bool = False,
                 chat_template: str | None = None):
        self.hf = hf
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = hf.token_to_id(bos) if bos else None
        self.eos_id = hf.token_to_id(eos) if eos else None
        self.add_bos = add_bos and self.bos_id is not None
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its piece's length bounds the text it covers)."""
        return max(len(piece) for piece in self.hf.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.hf.encode(check_text(text), add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_special and self.add_bos else ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_starts(self, text: str) -> tuple[list[int], list[int]]:
        """encode(text, add_special=False) and the character each of its tokens starts at."""
        encoding = self.hf.encode(check_text(text), add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the whole tokenizer (vocabulary, merges, normalizer, special tokens): equal only where
        every text tokenizes the same."""
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: dict, source: str = "GGUF") -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens in the metadata")
        check_vocab_fields(meta, len(tokens), source)
        try:
            if kind == "gpt2":
                hf = byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre", "default"))
            elif kind == "llama":
                hf = sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), meta.get("tokenizer.ggml.token_type"),
                                       meta.get("tokenizer.ggml.add_space_prefix", True))
            else:
                raise UnsupportedModelError(f"{source}: tokenizer kind {kind!r} is not supported (gpt2, llama)")
            add_added_tokens(hf, tokens, meta.get("tokenizer.ggml.token_type") or [])
        except Exception as e:                  # the tokenizers library raises plain Exceptions on a bad vocabulary
            if isinstance(e, (ModelLoadError, UnsupportedModelError)):
                raise
            raise ModelLoadError(f"{source}: the vocabulary does not make a tokenizer ({str(e)[:300]})") from e

        def token(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None
        return cls(hf, token("bos_token_id"), token("eos_token_id"),
                   meta.get("tokenizer.ggml.add_bos_token", kind == "llama"), meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, directory: str) -> Tokenizer:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{directory}: no tokenizer.json")
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise ModelLoadError(f"{path}: {os.path.getsize(path)} bytes is more than a tokenizer may be ({MAX_JSON_BYTES})")
        try:
            hf = HFTokenizer.from_file(path)
        except Exception as e:                             # the tokenizers library raises plain Exceptions
            raise ModelLoadError(f"{path}: not a readable tokenizer ({str(e)[:300]})") from e
        hf.no_truncation()
        hf.no_padding()
        config = read_json(os.path.join(directory, "tokenizer_config.json"))
        template = config.get("chat_template")
        template_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(template_file):
            try:
                with open(template_file, encoding="utf-8") as f:
                    template = f.read(MAX_TEMPLATE_CHARS + 1)      # a longer one fails as a template; raw prompts still run
            except UnicodeDecodeError as e:
                raise ModelLoadError(f"{template_file}: not UTF-8 text ({e})") from None
        return cls(hf, token_text(config.get("bos_token")), token_text(config.get("eos_token")),
                   bool(config.get("add_bos_token", False)), template)


# GGUF vocabulary fields: (key, element type, whether it has one entry per token)
VOCAB_FIELDS = (("tokenizer.ggml.tokens", str, True), ("tokenizer.ggml.scores", (int, float), True),
                ("tokenizer.ggml.token_type", int, True), ("tokenizer.ggml.merges", str, False))


def check_vocab_fields(meta: dict, n_tokens: int, source: str) -> None:
    """The GGUF vocabulary's arrays hold what they must, one entry per token where they should."""
    for key, kind, per_token in VOCAB_FIELDS:
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise ModelLoadError(f"{source}: {key} must be an array of {getattr(kind, '__name__', 'number')}s")
        if per_token and len(value) != n_tokens:
            raise ModelLoadError(f"{source}: {key} has {len(value)} entries for {n_tokens} tokens")
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.model", "tokenizer.chat_template"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ModelLoadError(f"{source}: {key} must be a string")


def check_text(text: str, what: str = "text") -> str:
    """`text` itself, if it is a string that UTF-8 can hold (a lone surrogate cannot); else RequestError."""
    if not isinstance(text, str):
        raise RequestError(f"{what} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{what} is not valid Unicode: {e.reason} at character {e.start}") from None
    return text


def check_ids(ids, vocab_size: int) -> list[int]:
    """Token ids (a list, tuple or 1-D array of integers in [0, vocab_size)) as a list of ints; else RequestError."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"token ids must be a list of integers, got {type(ids).__name__}")
    ids = [int(t) if isinstance(t, np.integer) else t for t in ids]
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < vocab_size:
            raise RequestError(f"token ids must be integers in [0, {vocab_size}); ids[{i}] is {reprlib.repr(t)}")
    return ids


def read_json(path: str, kind: type = dict):
    """A model directory's JSON file ({} or [] where it is absent): a JSON object (or `kind`), else ModelLoadError."""
    if not os.path.isfile(path):
        return kind()
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise ModelLoadError(f"{path}: {os.path.getsize(path)} bytes is more than a model's JSON file may be ({MAX_JSON_BYTES})")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as e:              # bad JSON, not UTF-8, or nested too deep
        raise ModelLoadError(f"{path}: invalid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, kind):
        raise ModelLoadError(f"{path}: expected a JSON {'object' if kind is dict else 'array'}, got {type(value).__name__}")
    return value


def token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise UnsupportedModelError(f"pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def sentencepiece_bpe(tokens, scores, types, add_space_prefix: bool) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = scores or [0.0] * len(tokens)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores), unk_token=tokens[0],
                                byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    *([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])])
    return hf


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE has no merge list: every split of a token into two vocabulary tokens is a
    merge, ranked by the merged token's score (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in merges]


def add_added_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (`<|im_end|>`) become special, user-defined ones are matched whole."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        hf.add_special_tokens(control)
    if user:
        hf.add_tokens(user)


class IncrementalDetokenizer:
    """Turn a growing token list into text pieces, never emitting half of a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_tail: list[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_tail)       # context so leading spaces decode as they will in the whole
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""                     # an incomplete character (or nothing new) so far
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
