"""The `speak` task: a piper voice, a VITS graph (phoneme ids, their count, noise/length scales, and a
speaker for multi-speaker voices -> audio) run through the runtime a sentence at a time, as piper-tts
runs it: text -> sentences of phonemes (a Phonemizer, espeak-ng by default) -> ids as the voice's map
gives them (begin, a pad after each phoneme, end) -> audio, peak-normalized, as 16-bit PCM.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.audio.phonemize import EspeakPhonemizer, Phonemizer
from soma_runtime.engine.graph import FamilyRunner, GraphRunner
from soma_runtime.errors import ModelLoadError, RequestError

BOS, EOS, PAD = "^", "$", "_"
MAX_TEXT = 100_000             # characters one request may ask to hear


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
            return cls(int(config["audio"]["sample_rate"]), str(config.get("espeak", {}).get("voice", "en-us")), ids,
                       float(inference.get("noise_scale", 0.667)), float(inference.get("length_scale", 1.0)),
                       float(inference.get("noise_w", 0.8)), int(config.get("num_speakers", 1)),
                       {str(k): int(v) for k, v in config.get("speaker_id_map", {}).items()},
                       frozenset(tuple(c) for c in config.get("vowel_clusters", []) or []))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{source}: not a piper voice config ({type(e).__name__}: {e})") from None


class Voice:
    def __init__(self, runner: GraphRunner | FamilyRunner, config: VoiceConfig, phonemizer: Phonemizer | None = None):
        self.runner, self.config = runner, config
        self.phonemizer = phonemizer if phonemizer is not None else EspeakPhonemizer()

    def phonemes(self, text: str) -> list[list[str]]:
        if not isinstance(text, str) or not text.strip():
            raise RequestError("the text to speak must be a non-empty string")
        if len(text) > MAX_TEXT:
            raise RequestError(f"text of {len(text)} characters is over the {MAX_TEXT} one request may speak")
        return [s for s in self.phonemizer.phonemize(text, self.config.espeak_voice, self.config.vowel_clusters) if s]

    def ids(self, phonemes: list[str]) -> list[int]:
        """Phoneme ids as piper maps them: begin, pad, each known phoneme and a pad, end."""
        m = self.config.phoneme_id_map
        ids = [*m[BOS], *m[PAD]]
        for p in phonemes:
            if p in m:
                ids += [*m[p], *m[PAD]]
        return ids + m[EOS]

    def speaker_id(self, speaker) -> int | None:
        c = self.config
        if c.num_speakers <= 1:
            if speaker not in (None, 0):
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

    def audio(self, ids: list[int], speaker: int | None, speed: float, noise_scale: float, noise_w: float) -> np.ndarray:
        """The graph's float audio for one sentence's ids."""
        inputs = {"input": np.asarray([ids], np.int64), "input_lengths": np.asarray([len(ids)], np.int64),
                  "scales": np.asarray([noise_scale, self.config.length_scale / speed, noise_w], np.float32)}
        if speaker is not None:
            inputs["sid"] = np.asarray([speaker], np.int64)
        return next(iter(self.runner.run(inputs).values())).reshape(-1)

    def speak(self, text: str, speaker=None, speed: float = 1.0, noise_scale: float | None = None,
              noise_w: float | None = None) -> Iterator[np.ndarray]:
        """int16 PCM at the voice's rate, one array per sentence as each is made."""
        if not isinstance(speed, (int, float)) or not 0.1 <= speed <= 10:
            raise RequestError(f"speed must be in [0.1, 10], got {speed!r}")
        sid = self.speaker_id(speaker)
        noise_scale = self.config.noise_scale if noise_scale is None else float(noise_scale)
        noise_w = self.config.noise_w if noise_w is None else float(noise_w)
        for phonemes in self.phonemes(text):
            audio = self.audio(self.ids(phonemes), sid, float(speed), noise_scale, noise_w)
            peak = float(np.abs(audio).max()) if audio.size else 0.0
            audio = np.zeros_like(audio) if peak < 1e-8 else audio / peak
            yield np.clip(np.clip(audio, -1.0, 1.0) * 32767, -32767, 32767).astype(np.int16)
