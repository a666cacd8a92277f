"""The `speak` task: a piper voice, a VITS graph (phoneme ids, their count, noise/length scales, and a
speaker for multi-speaker voices -> audio) run through the runtime a sentence at a time, as piper-tts
runs it: text -> sentences of phonemes (a Phonemizer, espeak-ng by default) -> ids as the voice's map
gives them (begin, a pad after each phoneme, end) -> audio, peak-normalized, as 16-bit PCM.

What one request may ask, checked here for the API, the CLI and the server alike, before the graph runs
(a graph run's memory and time grow with the speech it makes: phonemes times the length scale):
  MAX_TEXT        characters of text (OpenAI's limit on /v1/audio/speech)
  MAX_SENTENCES   sentences said, each one graph run (a sentence said in pieces counts each piece)
  MAX_PHONEMES    phonemes one graph run takes at a length scale of 1, MAX_PHONEMES / length scale when
                  slower (5 to 12 s of speech): a longer sentence is said in pieces, each cut after its last
                  clause break within the bound (espeak's , ; : marks, where piper's phrases break), else
                  after its last word, else at the bound
  MAX_SPOKEN      phonemes times the length scale one request says (six to eight minutes of speech)
  SPEEDS          speed (OpenAI's range); the voice's length_scale / speed, the length scale the graph is
                  given (piper's: 1 / speed), must lie in LENGTH_SCALES, as must the voice's own
  NOISE_SCALES    noise_scale (variation of the voice) and noise_w (variation of its timing), piper's scales
A voice config (.onnx.json) out of these ranges, or with a rate outside audio.io's, is a ModelLoadError.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.audio.io import MAX_RATE, MIN_RATE
from soma_runtime.audio.phonemize import EspeakPhonemizer, Phonemizer
from soma_runtime.engine.graph import FamilyRunner, GraphRunner
from soma_runtime.errors import ModelLoadError, RequestError

BOS, EOS, PAD = "^", "$", "_"
MAX_TEXT = 4096
MAX_SENTENCES = 256
MAX_PHONEMES = 128
MAX_SPOKEN = 8192
SPEEDS = (0.25, 4.0)
LENGTH_SCALES = (0.25, 4.0)
NOISE_SCALES = (0.0, 2.0)
CLAUSE_BREAKS = {",", ";", ":"}
ID_BUCKET = 32          # ids are padded to a multiple of this (the length input gives the true count): a plan per bucket


def number_in(value, name: str, bounds: tuple[float, float], error=RequestError) -> float:
    """`value` as a float if it is a finite number (not a bool) within `bounds`; else `error` naming it."""
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise error(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class VoiceConfig:
    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8
    num_speakers: int = 1
    speaker_id_map: dict[str, int] = field(default_factory=dict)
    vowel_clusters: frozenset = frozenset()

    @classmethod
    def from_piper(cls, config: dict, source: str) -> VoiceConfig:
        """The voice's `.onnx.json`: its phoneme map, rate, espeak voice and default scales."""
        try:
            if config.get("phoneme_type", "espeak") != "espeak":
                raise ModelLoadError(f"{source}: phoneme type {config['phoneme_type']!r}; espeak voices are spoken")
            ids = {str(k): [int(i) for i in v] for k, v in config["phoneme_id_map"].items()}
            if not all(s in ids for s in (BOS, EOS, PAD)):
                raise ModelLoadError(f"{source}: the phoneme map lacks {BOS!r}, {EOS!r} or {PAD!r}")
            inference = config.get("inference", {})
            voice = cls(int(config["audio"]["sample_rate"]), str(config.get("espeak", {}).get("voice", "en-us")), ids,
                        inference.get("noise_scale", 0.667), inference.get("length_scale", 1.0),
                        inference.get("noise_w", 0.8), int(config.get("num_speakers", 1)),
                        {str(k): int(v) for k, v in config.get("speaker_id_map", {}).items()},
                        frozenset(tuple(c) for c in config.get("vowel_clusters", []) or []))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{source}: not a piper voice config ({type(e).__name__}: {e})") from None
        voice.check(source)
        return voice

    def check(self, source: str) -> None:
        """ModelLoadError naming the first value out of its range."""
        def fail(message: str):
            return ModelLoadError(f"{source}: {message}")
        if not MIN_RATE <= self.sample_rate <= MAX_RATE:
            raise fail(f"a sample rate of {self.sample_rate} Hz is outside the {MIN_RATE}-{MAX_RATE} Hz taken")
        number_in(self.noise_scale, "inference.noise_scale", NOISE_SCALES, fail)
        number_in(self.noise_w, "inference.noise_w", NOISE_SCALES, fail)
        number_in(self.length_scale, "inference.length_scale", LENGTH_SCALES, fail)
        if self.num_speakers < 1 or not all(0 <= i < self.num_speakers for i in self.speaker_id_map.values()):
            raise fail(f"its {self.num_speakers} speakers do not hold its speaker ids {sorted(self.speaker_id_map.values())[:8]}")
        if any(i < 0 for ids in self.phoneme_id_map.values() for i in ids):
            raise fail("its phoneme map holds negative ids")


class Voice:
    def __init__(self, runner: GraphRunner | FamilyRunner, config: VoiceConfig, phonemizer: Phonemizer | None = None):
        self.runner, self.config = runner, config
        self.phonemizer = phonemizer if phonemizer is not None else EspeakPhonemizer()

    def phonemes(self, text: str, length_scale: float = 1.0) -> list[list[str]]:
        """The text's sentences of phonemes, each short enough for one graph run at `length_scale` (long
        ones said in pieces); RequestError for text that is not, or is more than one request says."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError("the text to speak must be a non-empty string")
        if len(text) > MAX_TEXT:
            raise RequestError(f"text of {len(text)} characters is over the {MAX_TEXT} one request may speak")
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise RequestError(f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}, "
                               "not text") from None
        if "\0" in text:
            raise RequestError(f"the text holds a NUL character at character {text.index(chr(0))}")
        found = self.phonemizer.phonemize(text, self.config.espeak_voice, self.config.vowel_clusters)
        most = int(MAX_PHONEMES / max(1.0, length_scale))
        sentences = [piece for s in found if s for piece in pieces(s, most)]
        if len(sentences) > MAX_SENTENCES:
            raise RequestError(f"the text makes {len(sentences)} sentences, over the {MAX_SENTENCES} one request may speak")
        spoken = sum(map(len, sentences)) * length_scale
        if spoken > MAX_SPOKEN:
            raise RequestError(f"the text makes {spoken:.0f} phonemes (times the length scale), over the {MAX_SPOKEN} "
                               "one request may speak")
        return sentences

    def ids(self, phonemes: list[str]) -> list[int]:
        """Phoneme ids as piper maps them: begin, pad, each known phoneme and a pad, end."""
        m = self.config.phoneme_id_map
        ids = [*m[BOS], *m[PAD]]
        for p in phonemes:
            if p in m:
                ids += [*m[p], *m[PAD]]
        return ids + m[EOS]

    def speaker_id(self, speaker) -> int | None:
        """The graph's speaker id of a name or an id (a string of digits that names no speaker is an id)."""
        c = self.config
        if isinstance(speaker, str) and speaker not in c.speaker_id_map and speaker.isdecimal():
            speaker = int(speaker)
        if c.num_speakers <= 1:
            if speaker not in (None, 0) or isinstance(speaker, bool):
                raise RequestError("this voice has one speaker")
            return None
        if speaker is None:
            return 0
        if isinstance(speaker, str):
            if speaker not in c.speaker_id_map:
                raise RequestError(f"unknown speaker {speaker!r}; this voice has {', '.join(c.speaker_id_map)}")
            return c.speaker_id_map[speaker]
        if type(speaker) is not int or not 0 <= speaker < c.num_speakers:
            raise RequestError(f"speaker must be a name or an id in [0, {c.num_speakers}), got {speaker!r}")
        return speaker

    def scales(self, speed, noise_scale, noise_w) -> tuple[float, float, float]:
        """(noise_scale, length_scale, noise_w) for the graph: the voice's own unless given, each checked."""
        c = self.config
        speed = number_in(speed, "speed", SPEEDS)
        length = c.length_scale / speed
        if not LENGTH_SCALES[0] <= length <= LENGTH_SCALES[1]:
            raise RequestError(f"speed {speed} makes this voice's length scale {length:g} (its own "
                               f"{c.length_scale:g} / speed), outside [{LENGTH_SCALES[0]}, {LENGTH_SCALES[1]}]")
        noise_scale = c.noise_scale if noise_scale is None else number_in(noise_scale, "noise_scale", NOISE_SCALES)
        noise_w = c.noise_w if noise_w is None else number_in(noise_w, "noise_w", NOISE_SCALES)
        return noise_scale, length, noise_w

    def audio(self, ids: list[int], speaker: int | None, scales: tuple[float, float, float]) -> np.ndarray:
        """The graph's float audio for one sentence's ids."""
        padded = ids + self.config.phoneme_id_map[PAD][:1] * (-len(ids) % ID_BUCKET)
        inputs = {"input": np.asarray([padded], np.int64), "input_lengths": np.asarray([len(ids)], np.int64),
                  "scales": np.asarray(scales, np.float32)}
        if speaker is not None:
            inputs["sid"] = np.asarray([speaker], np.int64)
        return next(iter(self.runner.run(inputs).values())).reshape(-1)

    def speak(self, text: str, speaker=None, speed: float = 1.0, noise_scale: float | None = None,
              noise_w: float | None = None) -> Iterator[np.ndarray]:
        """int16 PCM at the voice's rate, one array per sentence as each is made; every argument is checked
        before the first sentence is."""
        scales = self.scales(speed, noise_scale, noise_w)
        sid = self.speaker_id(speaker)
        return self.sentences(self.phonemes(text, scales[1]), sid, scales)

    def sentences(self, sentences: list[list[str]], sid: int | None, scales) -> Iterator[np.ndarray]:
        """Each sentence's audio, made as it is asked for."""
        for phonemes in sentences:
            audio = self.audio(self.ids(phonemes), sid, scales)
            peak = float(np.abs(audio).max()) if audio.size else 0.0
            audio = np.zeros_like(audio) if peak < 1e-8 else audio / peak
            yield np.clip(np.clip(audio, -1.0, 1.0) * 32767, -32767, 32767).astype(np.int16)


def pieces(phonemes: list[str], most: int) -> list[list[str]]:
    """A sentence's phonemes in pieces of at most `most`: each cut after its last clause break within the
    bound, else at its last word break, else at the bound; the spaces at a cut dropped."""
    out = []
    while len(phonemes) > most:
        head = phonemes[:most]
        cut = last_break(head, CLAUSE_BREAKS) or last_break(head, {" "}) or most
        out.append(stripped(phonemes[:cut]))
        phonemes = stripped(phonemes[cut:])
    return [p for p in out + [phonemes] if p]


def last_break(phonemes: list[str], marks: set[str]) -> int:
    """The index just past the last of `marks` in `phonemes` after its first, 0 if none."""
    return next((i + 1 for i in range(len(phonemes) - 1, 0, -1) if phonemes[i] in marks), 0)


def stripped(phonemes: list[str]) -> list[str]:
    first, last = 0, len(phonemes)
    while first < last and phonemes[first] == " ":
        first += 1
    while last > first and phonemes[last - 1] == " ":
        last -= 1
    return phonemes[first:last]
