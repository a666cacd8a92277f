"""Text to phonemes for voices: a `Phonemizer` turns text into sentences of phonemes (IPA characters,
accents decomposed, clause punctuation kept) as piper-tts does. `EspeakPhonemizer` calls the system's
espeak-ng library (Debian's `espeak-ng`, loaded at run time: its GPL code stays outside this package)
one clause at a time; `[[ ... ]]` in the text passes raw phonemes through. Knows text and phonemes,
nothing of models."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import threading
import unicodedata
from typing import Protocol

from soma_runtime.errors import ModelLoadError, RequestError

RAW_BLOCK = re.compile(r"(\[\[.*?\]\])")
LANGUAGE_SWITCH = re.compile(r"\([^)]+\)")       # espeak's "(en)...(fr)" around words of another language
# espeak's clause punctuation (its Unicode properties, readclause.c): the terminator piper writes after a clause,
# and whether the clause ends a sentence. Marks that need no space after them (CJK, ¡ ¿, …) match none of
# piper's terminators: the clause gets none, but a full stop, question or exclamation still ends a sentence.
PLAIN = {".": ".", "?": "?", "!": "!", ",": ",", ":": ":", ";": ";", "–": ";", "—": ";", "\u037e": "?", "\u0387": ";",
         "،": ",", "؛": ";", "؟": "?", "۔": ".", "‼": "!", "⁇": "?", "｡": ".", "､": ",", "︐": ",", "︑": ",", "︒": ".",
         "︓": ":", "︔": ";", "︕": "!", "︖": "?", "﹐": ",", "﹑": ",", "﹒": ".", "﹔": ";", "﹕": ":", "﹖": "?", "﹗": "!",
         "።": ".", "፣": ",", "፤": ";", "፧": "?"}
NO_SPACE = {"¡": ";", "¿": ";", "…": ";", "。": ".", "、": ",", "！": "!", "，": ",", "．": ".", "：": ":", "；": ";",
            "？": "?", "।": ".", "։": ".", "།": "."}
SENTENCE_ENDS = {".", "?", "!"}
CLOSERS = "\"'”’»)]} \t\n"
CHARS_UTF8, PHONEMES_IPA = 1, 0x02
SYNCHRONOUS = 2


class Phonemizer(Protocol):
    def phonemize(self, text: str, voice: str) -> list[list[str]]:
        """Sentences of phonemes."""


class EspeakPhonemizer:
    """espeak-ng through its C API (espeak_TextToPhonemes), one process-wide instance: espeak keeps
    global state, so calls are serialized."""

    lock = threading.Lock()
    library = None

    def __init__(self):
        with self.lock:
            if EspeakPhonemizer.library is None:
                EspeakPhonemizer.library = load_espeak()

    def phonemize(self, text: str, voice: str, vowel_clusters: set[tuple[str, ...]] | None = None) -> list[list[str]]:
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}")
        sentences: list[list[str]] = []
        raw_last = False
        parts = RAW_BLOCK.split(text)
        for i, part in enumerate(parts):
            if part.startswith("[["):
                if not sentences:
                    sentences.append([])
                if i > 0 and parts[i - 1].endswith(" "):
                    sentences[-1].append(" ")
                sentences[-1].extend(part[2:-2].strip())
                if i < len(parts) - 1 and parts[i + 1].startswith(" "):
                    sentences[-1].append(" ")
                raw_last = True
                continue
            found = self.clauses(part, voice, vowel_clusters)
            if raw_last and found:
                sentences[-1].extend(found.pop(0))
            sentences.extend(found)
            raw_last = False
        if sentences and not sentences[-1]:
            sentences.pop()
        return sentences

    def clauses(self, text: str, voice: str, vowel_clusters) -> list[list[str]]:
        """espeak's clauses, each with its terminator, grouped into sentences."""
        lib, out, sentence = self.library, [], []
        data = text.encode() + b"\0"
        buffer = ctypes.create_string_buffer(data)
        start = ctypes.addressof(buffer)
        pointer = ctypes.c_void_p(start)
        with self.lock:        # the voice is set every time: other code in the process may share the library
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise RequestError(f"espeak-ng has no voice {voice!r}")
            while pointer.value:
                before = pointer.value
                phonemes = lib.espeak_TextToPhonemes(ctypes.byref(pointer), CHARS_UTF8, PHONEMES_IPA)
                consumed = data[before - start: (pointer.value or start + len(data) - 1) - start].decode(errors="replace")
                terminator, ends = terminator_of(consumed[:-1] if pointer.value else consumed)
                clause = LANGUAGE_SWITCH.sub("", (phonemes or b"").decode()) + terminator
                if terminator in (",", ":", ";"):
                    clause += " "
                sentence.extend(unicodedata.normalize("NFD", clause))
                if ends:
                    out.append(merge_clusters(sentence, vowel_clusters))
                    sentence = []
        if sentence:
            out.append(merge_clusters(sentence, vowel_clusters))
        return out


def terminator_of(clause: str) -> tuple[str, bool]:
    """(terminator, ends a sentence) of the text espeak read as one clause (its look-ahead character
    dropped): the first of the punctuation run it ends with, past closing quotes and brackets."""
    text = clause.rstrip(CLOSERS)
    run = len(text)
    while run and (text[run - 1] in PLAIN or text[run - 1] in NO_SPACE):
        run -= 1
    if run == len(text):
        return "", False
    mark = "…" if text.startswith("...", run) else text[run]        # espeak reads three dots as an ellipsis
    kind = PLAIN.get(mark) or NO_SPACE[mark]
    return ("" if mark in NO_SPACE else kind), kind in SENTENCE_ENDS


def merge_clusters(phonemes: list[str], clusters) -> list[str]:
    """Known multi-character vowel clusters as single phonemes (longest first)."""
    if not clusters:
        return phonemes
    longest, out, i = max(len(c) for c in clusters), [], 0
    while i < len(phonemes):
        n = next((n for n in range(min(longest, len(phonemes) - i), 1, -1) if tuple(phonemes[i:i + n]) in clusters), 0)
        out.append("".join(phonemes[i:i + n]) if n else phonemes[i])
        i += n or 1
    return out


def load_espeak():
    """espeak-ng 1.52 from the espeakng-loader package (the release piper-tts's phonemes come from), else
    the system's library."""
    try:
        import espeakng_loader
        name, data = espeakng_loader.get_library_path(), os.path.dirname(espeakng_loader.get_data_path())
    except ImportError:
        name, data = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1", None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        raise ModelLoadError("voices need espeak-ng: pip install espeakng-loader, or apt-get install espeak-ng") from None
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    if lib.espeak_Initialize(SYNCHRONOUS, 0, data and data.encode(), 0) < 0:
        raise ModelLoadError("espeak-ng did not initialize (its data files are missing?)")
    return lib
