"""Whisper's special tokens, read from its vocabulary by name, and the token sets its decoding uses:
the non-speech symbols suppressed by default (as openai-whisper and faster-whisper list them), the
prompt's start sequence, text decoding that drops every special token."""
from __future__ import annotations

import functools

from soma_runtime.errors import ModelLoadError
from soma_runtime.text.tokenizer import Tokenizer

LANGUAGES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id",
    "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg",
    "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br",
    "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so",
    "af", "oc", "ka", "be", "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt",
    "sa", "lb", "my", "bo", "tl", "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)
NON_SPEECH_SYMBOLS = (*'"#()*+/:;<=>@[\\]^_`{|}~「」『』', "<<", ">>", "<<<", ">>>", "--", "---", "-(", "-[", "('", '("',
                      "((", "))", "(((", ")))", "[[", "]]", "{{", "}}", "♪♪", "♪♪♪")
MISCELLANEOUS = "♩♪♫♬♭♮♯"


class WhisperTokens:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        hf = tokenizer.hf

        def special(*names: str, required: bool = True) -> int | None:
            for name in names:
                if (i := hf.token_to_id(name)) is not None:
                    return i
            if required:
                raise ModelLoadError(f"whisper's vocabulary lacks {names[0]}")
            return None

        self.eot, self.sot = special("<|endoftext|>"), special("<|startoftranscript|>")
        self.sot_prev, self.sot_lm = special("<|startofprev|>"), special("<|startoflm|>", required=False)
        self.no_timestamps = special("<|notimestamps|>")
        self.no_speech = special("<|nospeech|>", "<|nocaptions|>")
        self.transcribe, self.translate = special("<|transcribe|>", required=False), special("<|translate|>", required=False)
        self.timestamp_begin = self.no_timestamps + 1
        self.languages = {code: i for code in LANGUAGES if (i := hf.token_to_id(f"<|{code}|>")) is not None}
        if self.timestamp_begin >= vocab_size:
            raise ModelLoadError("whisper's vocabulary has no timestamp tokens")

    @property
    def multilingual(self) -> bool:
        return self.vocab_size >= 51865

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self.languages[language], self.transcribe if task == "transcribe" else self.translate]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.hf.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.hf.decode([t for t in tokens if t < self.eot])

    @functools.cached_property
    def non_speech(self) -> tuple[int, ...]:
        """Symbols that start speaker tags and sound annotations ("♪", "[DAVID]", "(laughs)"); hyphens
        and quotes only at a word's start."""
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in (*NON_SPEECH_SYMBOLS, *MISCELLANEOUS):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in MISCELLANEOUS:
                    result.add(tokens[0])
        return tuple(sorted(result))

    def suppressed(self, tokens: list[int] | None = (-1,)) -> tuple[int, ...]:
        """The ids never sampled: `tokens` (-1 standing for the non-speech symbols) and the special tokens
        that only prompts hold."""
        tokens = list(tokens or ())
        ids = [t for t in tokens if t >= 0] + (list(self.non_speech) if -1 in tokens else [])
        specials = (self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm, self.no_speech)
        ids += [t for t in specials if t is not None]
        return tuple(sorted(set(ids)))
