"""The transcribe task: SpeechModel, a speech recognizer (whisper); the recordings it hears (Heard) and its
options by name (transcribe_options)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from soma_runtime import loaders
from soma_runtime.audio.features import SAMPLE_RATE
from soma_runtime.audio.io import load_audio
from soma_runtime.engine.transcribe.runner import MAX_BATCH, WhisperRunner
from soma_runtime.engine.transcribe.segments import Options as TranscribeOptions
from soma_runtime.engine.transcribe.segments import Transcriber, Transcript, features_of
from soma_runtime.engine.transcribe.speech_map import VAD_BEYOND_SECONDS, VAD_OPTIONS, SpeechMap, restore, speech_only
from soma_runtime.engine.transcribe.tokens import WhisperTokens
from soma_runtime.engine.transcribe.words import Aligner
from soma_runtime.engine.vad import VoiceActivity
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.loaders import package_file
from soma_runtime.tasks.base import Model
from soma_runtime.tasks.graph import GraphModel


@dataclass
class Heard:
    """A recording to transcribe: the samples decoded (its speech, when VAD cut it), and how to map back."""
    samples: np.ndarray
    duration: float
    speech_map: SpeechMap | None

    def features(self, n_mels: int) -> np.ndarray:
        return features_of(self.samples, n_mels)

    def transcript(self, segments: list, language: str, probability: float) -> Transcript:
        for s in segments if self.speech_map else ():
            restore(s, self.speech_map)
        return Transcript("".join(s.text for s in segments).strip(), segments, language, probability, self.duration)


class SpeechModel(Model):
    """A speech recognizer (whisper): transcribe audio to text with timestamped segments."""

    task = "transcribe"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: WhisperRunner):
        super().__init__(model_id, loaded, backend)
        self.runner, self.tokenizer = runner, loaded.tokenizer
        self.tokens = WhisperTokens(loaded.tokenizer, loaded.config.vocab_size)
        begin = loaded.metadata.get("suppress_ids_begin", loaded.metadata.get("begin_suppress_tokens", [220, self.tokens.eot]))
        heads = loaded.metadata.get("alignment_heads")
        aligner = Aligner(loaded.config, loaded.weights, backend, heads) if heads else None
        self.transcriber = Transcriber(runner, self.tokens, tuple(begin), loaded.config.max_target_positions, aligner)
        self.vad: VoiceActivity | None = None

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> SpeechModel:
        return cls(model_id, loaded, backend, WhisperRunner(loaded.config, loaded.weights, backend, precision.activations))

    def transcribe(self, audio, language: str | None = None, beam_size: int = 5, word_timestamps: bool = False,
                   vad: bool | None = None, progress: bool | None = None, batch_size: int = 4,
                   **options) -> Transcript | list[Transcript]:
        """Text and timestamped segments of `audio` (a file path, its bytes, or 16 kHz mono samples), decoded
        as faster-whisper does (its options by name: temperature, best_of, patience, length_penalty,
        condition_on_previous_text, initial_prompt, no_speech_threshold, ...). `language`: the spoken
        language's code; detected from the first 30 s when a multilingual model is not told. `vad`: only the
        speech Silero VAD finds is transcribed (faster-whisper's VAD filter), by default beyond 30 s.
        A list of recordings gives a list of transcripts, `batch_size` of them decoding at once (each
        one's current window a part of every decoder step)."""
        opts = transcribe_options(beam_size=beam_size, word_timestamps=word_timestamps, **options)
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            raise RequestError(f"batch_size must be an integer in [1, {MAX_BATCH}], got {batch_size!r}")
        many = isinstance(audio, (list, tuple))
        if many and not audio:
            raise RequestError("transcribe a recording, or a list of one or more")
        heard = [self.heard(a, vad) for a in (audio if many else [audio])]
        found = [[] for _ in heard]
        with tqdm(total=round(sum(len(h.samples) for h in heard) / SAMPLE_RATE, 2), unit="s", desc="transcribing",
                  delay=1.0, leave=False, disable=None if progress is None else not progress) as bar:
            done = [0.0] * len(heard)

            def advancer(i: int):
                def advance(seconds: float) -> None:
                    done[i] = seconds
                    bar.update(round(sum(done), 2) - bar.n)
                return advance
            jobs = [(i, h.features(self.loaded.config.num_mel_bins)) for i, h in enumerate(heard) if len(h.samples)]
            spoken = [(i, *self.language(f, language)) for i, f in jobs]
            decoded = self.transcriber.many([(f, opts, lang, advancer(i)) for (i, f), (_, lang, _) in zip(jobs, spoken)],
                                            batch_size)
            for j, segment in decoded:
                found[jobs[j][0]].append(segment)
        languages = {i: (lang, p) for i, lang, p in spoken}
        transcripts = [h.transcript(segments, *languages.get(i, (language or "en", 0.0)))
                       for i, (h, segments) in enumerate(zip(heard, found))]
        return transcripts if many else transcripts[0]

    def heard(self, audio, vad: bool | None) -> Heard:
        """A recording's samples, cut to its speech where `vad` says (by default beyond 30 s)."""
        samples = load_audio(audio)
        duration = len(samples) / SAMPLE_RATE
        if vad or (vad is None and duration > VAD_BEYOND_SECONDS):
            chunks = self.voice_activity().segments(samples, **VAD_OPTIONS)
            return Heard(speech_only(samples, chunks), duration, SpeechMap(chunks, SAMPLE_RATE))
        return Heard(samples, duration, None)

    def voice_activity(self) -> VoiceActivity:
        """Silero VAD (the silero-vad package's ONNX graph), run through the runtime; loaded once."""
        if self.vad is None:
            loaded = loaders.load(package_file("silero_vad", os.path.join("data", "silero_vad.onnx")))
            self.vad = VoiceActivity(GraphModel.open("silero-vad", loaded, self.backend, None, None, None, False))
        return self.vad

    def language(self, features: np.ndarray, language: str | None) -> tuple[str, float]:
        if not self.tokens.multilingual:
            if language not in (None, "en"):
                raise RequestError(f"this model is English-only; language {language!r} is not available")
            return "en", 1.0
        if language is None:
            language, probs = self.transcriber.detect_language(features)
            return language, probs[language]
        if language not in self.tokens.languages:
            raise RequestError(f"unknown language {language!r}; one of {', '.join(self.tokens.languages)}")
        return language, 1.0


def transcribe_options(**options) -> TranscribeOptions:
    """faster-whisper's options by name, checked (a temperature may be one value or a fallback list)."""
    unknown = set(options) - set(TranscribeOptions.__dataclass_fields__) - {"temperature"}
    if unknown:
        raise RequestError(f"unknown transcription options: {', '.join(sorted(unknown))}")
    if "temperature" in options:
        t = options.pop("temperature")
        options["temperatures"] = tuple(t) if isinstance(t, (list, tuple)) else (t,)
    return TranscribeOptions(**options)
