"""Long-form transcription as faster-whisper does it: log-mel features of the whole recording, 30 s
windows taken from a seek position, each decoded with the previous text as its prompt (unless reset
after a high-temperature retry), retried at rising temperatures while its text is too repetitive (gzip
compression ratio) or too improbable (average log-probability), skipped when the model hears no speech,
cut into segments at its timestamp tokens; the seek then moves past what the window's last timestamp
covers. Knows decoding policy, nothing of graphs.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.audio.features import HOP, SAMPLE_RATE, log_mel
from soma_runtime.engine.kv import Sequence
from soma_runtime.engine.transcribe.lockstep import Steps, lockstep
from soma_runtime.engine.transcribe.runner import Hypothesis, WhisperRunner
from soma_runtime.engine.transcribe.search import Search, SearchOptions, SearchResult
from soma_runtime.engine.transcribe.tokens import WhisperTokens
from soma_runtime.engine.transcribe.words import Aligner, add_word_timestamps, word_timings, words_end
from soma_runtime.errors import RequestError

WINDOW_FRAMES = 3000                        # 30 s of 10 ms frames
INPUT_STRIDE = 2                            # frames per encoder position
TIME_PRECISION = 0.02                       # seconds per timestamp token
FRAMES_PER_SECOND = SAMPLE_RATE // HOP
SECONDS_PER_FRAME = HOP / SAMPLE_RATE
MAX_HYPOTHESES = 32                         # beams or sampled rows a window decodes (what the runner's pool holds)


@dataclass
class Options:
    """faster-whisper's transcription options and defaults."""
    language: str | None = None
    task: str = "transcribe"
    beam_size: int = 5
    best_of: int = 5
    patience: float = 1.0
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    log_prob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    prompt_reset_on_temperature: float = 0.5
    initial_prompt: str | None = None
    suppress_blank: bool = True
    suppress_tokens: tuple[int, ...] = (-1,)
    without_timestamps: bool = False
    max_initial_timestamp: float = 1.0
    max_new_tokens: int | None = None
    word_timestamps: bool = False
    seed: int | None = None

    def __post_init__(self):
        """RequestError naming the first option of the wrong type or out of its range, whoever built it."""
        for name in ("condition_on_previous_text", "suppress_blank", "without_timestamps", "word_timestamps"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("language", "initial_prompt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not utf8(value)):
                raise RequestError(f"{name} must be a string of text, got {value!r:.80}")
        if self.task not in ("transcribe", "translate"):
            raise RequestError(f"task must be transcribe or translate, got {self.task!r}")
        for name in ("beam_size", "best_of"):
            if not integer(getattr(self, name), 1, MAX_HYPOTHESES):
                raise RequestError(f"{name} must be an integer in [1, {MAX_HYPOTHESES}], got {getattr(self, name)!r}")
        counts = (("no_repeat_ngram_size", integer(self.no_repeat_ngram_size, 0), ">= 0"),
                  ("max_new_tokens", self.max_new_tokens is None or integer(self.max_new_tokens, 1), ">= 1 (or None)"),
                  ("seed", self.seed is None or integer(self.seed, 0), ">= 0 (or None)"))
        for name, good, wanted in counts:
            if not good:
                raise RequestError(f"{name} must be an integer {wanted}, got {getattr(self, name)!r}")
        if not isinstance(self.temperatures, (tuple, list)) or not self.temperatures or \
                not all(real(t, 0, 2) for t in self.temperatures):
            raise RequestError(f"temperature must be in [0, 2] (or a list of such), got {self.temperatures!r}")
        numbers = [("patience", real(self.patience, 0, 8) and self.patience > 0, "in (0, 8]"),
                   ("length_penalty", real(self.length_penalty), "finite"),
                   ("repetition_penalty", real(self.repetition_penalty) and self.repetition_penalty > 0, "> 0"),
                   ("prompt_reset_on_temperature", real(self.prompt_reset_on_temperature), "finite"),
                   ("max_initial_timestamp", real(self.max_initial_timestamp, 0), ">= 0")]
        numbers += [(name, getattr(self, name) is None or real(getattr(self, name)), "finite (or None)")
                    for name in ("compression_ratio_threshold", "log_prob_threshold", "no_speech_threshold")]
        for name, good, wanted in numbers:
            if not good:
                raise RequestError(f"{name} must be a number {wanted}, got {getattr(self, name)!r}")
        if self.suppress_tokens is not None and (not isinstance(self.suppress_tokens, (tuple, list))
                                                 or not all(integer(t, -1) for t in self.suppress_tokens)):
            raise RequestError(f"suppress_tokens must be a list of token ids (-1: the non-speech symbols), "
                               f"got {self.suppress_tokens!r:.80}")


def integer(value, low: int, high: float = math.inf) -> bool:
    """An int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def real(value, low: float = -math.inf, high: float = math.inf) -> bool:
    """A finite int or float (not a bool) in [low, high]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high


def utf8(text: str) -> bool:
    """Whether `text` is text UTF-8 can hold (no lone surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[dict] = field(default_factory=list)


@dataclass
class Attempt:
    result: SearchResult
    avg_logprob: float
    temperature: float
    compression_ratio: float


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data))


def features_of(audio: np.ndarray, n_mels: int) -> np.ndarray:
    """[mels, frames] of the whole recording (160 samples of silence appended, the last frame dropped as
    faster-whisper's extractor does); a window's part is padded with zeros to 3000 frames."""
    return log_mel(np.pad(np.asarray(audio, np.float32), (0, HOP)), n_mels, window_samples=None)


class Transcriber:
    def __init__(self, runner: WhisperRunner, tok: WhisperTokens, begin_suppress: tuple[int, ...], max_length: int,
                 aligner: Aligner | None = None):
        """`aligner`: the model's alignment heads, for word timestamps (None: the model has none)."""
        self.runner, self.tok, self.begin_suppress, self.max_length = runner, tok, begin_suppress, max_length
        self.aligner = aligner

    def segments(self, features: np.ndarray, opts: Options, language: str,
                 progress: Callable[[float], None] | None = None) -> Iterator[Segment]:
        """The recording's segments, in order, as each window is decoded."""
        for _, segment in lockstep(self.runner, [self.steps(features, opts, language, progress)]):
            yield segment

    def many(self, recordings: list[tuple[np.ndarray, Options, str]], width: int) -> Iterator[tuple[int, Segment]]:
        """Several recordings (features, options, language) decoded together, `width` at a time, their
        windows' decoder steps batched: (recording index, segment) as each is found."""
        return lockstep(self.runner, (self.steps(*r) for r in recordings), width)

    def steps(self, features: np.ndarray, opts: Options, language: str,
              progress: Callable[[float], None] | None = None) -> Steps:
        """The recording's decoding as steps (see lockstep), yielding its segments as they are found."""
        tok = self.tok
        content_frames = features.shape[-1] - 1
        rng = np.random.default_rng(opts.seed)
        seek, all_tokens, reset_since, index = 0, [], 0, 0
        if opts.initial_prompt:
            all_tokens += tok.encode(" " + opts.initial_prompt.strip())
        if any(t >= tok.vocab_size for t in opts.suppress_tokens or ()):
            raise RequestError(f"suppress_tokens holds an id past the vocabulary's {tok.vocab_size}")
        suppress = tok.suppressed(opts.suppress_tokens) if opts.suppress_tokens else ()
        if opts.word_timestamps and self.aligner is None:
            raise RequestError("this model names no alignment heads: word timestamps are not available")
        last_speech = 0.0
        while seek < content_frames:
            time_offset = seek * SECONDS_PER_FRAME
            size = min(WINDOW_FRAMES, content_frames - seek)
            prompt = self.prompt(all_tokens[reset_since:], language, opts)
            encoded = self.runner.encode(self.window(features, seek)[None])
            [opened] = self.runner.open_windows(encoded)
            try:
                attempt = yield from self.with_fallback(opened, prompt, opts, suppress, rng)
            finally:
                self.runner.close([opened])
            result = attempt.result
            if opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold and not (
                    opts.log_prob_threshold is not None and attempt.avg_logprob > opts.log_prob_threshold):
                seek += size                                    # silence: on to the next window
                if progress:
                    progress(min(content_frames, seek) * SECONDS_PER_FRAME)
                continue
            pieces, seek, single_ending = self.split(result.tokens, time_offset, size, seek)
            if opts.word_timestamps:
                text = [t for p in pieces for t in p["tokens"] if t < tok.eot]
                alignment = word_timings(self.aligner, tok, encoded[0], tok.sot_sequence(language, opts.task), text, size)
                last_speech = add_word_timestamps(pieces, alignment, time_offset, last_speech, tok.eot)
                end = words_end(pieces)
                if not single_ending and end is not None and end > time_offset:
                    seek = round(end * FRAMES_PER_SECOND)
                last_speech = end if end is not None else last_speech
            for piece in pieces:
                text = tok.decode(piece["tokens"])
                if piece["start"] == piece["end"] or not text.strip():
                    continue
                all_tokens += piece["tokens"]
                index += 1
                yield Segment(index, piece["start"], piece["end"], text, piece["tokens"], attempt.temperature,
                              attempt.avg_logprob, attempt.compression_ratio, result.no_speech_prob, piece.get("words", []))
            if not opts.condition_on_previous_text or attempt.temperature > opts.prompt_reset_on_temperature:
                reset_since = len(all_tokens)
            if progress:
                progress(min(content_frames, seek) * SECONDS_PER_FRAME)

    def detect_language(self, features: np.ndarray) -> tuple[str, dict[str, float]]:
        """The language of the first window (a multilingual model's language tokens after sot)."""
        window = self.window(features, 0)
        [opened] = self.runner.open_windows(self.runner.encode(window[None]))
        h = Hypothesis(Sequence(), opened)
        try:
            logits = self.runner.forward([(h, [self.tok.sot])])[0]
        finally:
            self.runner.close([opened], [h])
        codes = list(self.tok.languages)
        scores = logits[[self.tok.languages[c] for c in codes]]
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        ranked = dict(sorted(zip(codes, probs.tolist()), key=lambda kv: -kv[1]))
        return next(iter(ranked)), ranked

    @staticmethod
    def window(features: np.ndarray, seek: int) -> np.ndarray:
        """3000 frames from `seek`, zeros past the recording's end."""
        window = np.zeros((features.shape[0], WINDOW_FRAMES), np.float32)
        part = features[:, seek: min(seek + WINDOW_FRAMES, features.shape[-1] - 1)]
        window[:, :part.shape[1]] = part
        return window

    def prompt(self, previous: list[int], language: str, opts: Options) -> list[int]:
        prompt = [self.tok.sot_prev, *previous[-(self.max_length // 2 - 1):]] if previous else []
        prompt += self.tok.sot_sequence(language, opts.task)
        return prompt + ([self.tok.no_timestamps] if opts.without_timestamps else [])

    def with_fallback(self, window, prompt: list[int], opts: Options, suppress, rng) -> Steps:
        """Steps decoding at each temperature until the text is neither repetitive nor improbable (or is
        silence); returns that Attempt, or failing all, the most probable one under the compression threshold."""
        max_length = len(prompt) + opts.max_new_tokens if opts.max_new_tokens is not None else self.max_length
        if max_length > self.max_length:
            raise RequestError(f"a prompt of {len(prompt)} tokens and max_new_tokens {opts.max_new_tokens} exceed "
                               f"whisper's {self.max_length} tokens")
        attempts, below = [], []
        for temperature in opts.temperatures:
            sampled = temperature > 0
            search = SearchOptions(beam_size=1 if sampled else opts.beam_size, patience=opts.patience,
                                   length_penalty=opts.length_penalty, repetition_penalty=opts.repetition_penalty,
                                   no_repeat_ngram_size=opts.no_repeat_ngram_size, temperature=temperature,
                                   num_hypotheses=opts.best_of if sampled else 1, max_length=max_length,
                                   suppress_tokens=suppress,
                                   suppress_blank=self.begin_suppress if opts.suppress_blank else (),
                                   max_initial_timestamp_index=round(opts.max_initial_timestamp / TIME_PRECISION))
            result = yield from Search(self.runner, self.tok, search, rng).decode(window, prompt)
            length = len(result.tokens)
            avg_logprob = result.score * length ** opts.length_penalty / (length + 1)
            attempt = Attempt(result, avg_logprob, temperature, compression_ratio(self.tok.decode(result.tokens).strip()))
            attempts.append(attempt)
            retry = False
            if opts.compression_ratio_threshold is not None:
                if attempt.compression_ratio > opts.compression_ratio_threshold:
                    retry = True
                else:
                    below.append(attempt)
            if opts.log_prob_threshold is not None and avg_logprob < opts.log_prob_threshold:
                retry = True
            if (opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold
                    and opts.log_prob_threshold is not None and avg_logprob < opts.log_prob_threshold):
                retry = False                                   # silence
            if not retry:
                return attempt
        best = max(below or attempts, key=lambda a: a.avg_logprob)
        return Attempt(best.result, best.avg_logprob, opts.temperatures[-1], best.compression_ratio)

    def split(self, tokens: list[int], time_offset: float, size: int, seek: int) -> tuple[list[dict], int, bool]:
        """Pieces {start, end, tokens} cut at consecutive timestamp pairs, the next seek (past the window when
        it ends on a lone timestamp: nothing after it, else at the last closed pair), and whether it did."""
        begin = self.tok.timestamp_begin
        single_ending = len(tokens) >= 2 and tokens[-2] < begin <= tokens[-1]
        cuts = [i for i in range(1, len(tokens)) if tokens[i] >= begin and tokens[i - 1] >= begin]
        if not cuts:
            stamps = [t for t in tokens if t >= begin]
            duration = size * SECONDS_PER_FRAME
            if stamps and stamps[-1] != begin:
                duration = (stamps[-1] - begin) * TIME_PRECISION
            return [{"start": time_offset, "end": time_offset + duration, "tokens": tokens}], seek + size, single_ending
        pieces, last = [], 0
        for cut in cuts + ([len(tokens)] if single_ending else []):
            piece = tokens[last:cut]
            pieces.append({"start": time_offset + (piece[0] - begin) * TIME_PRECISION,
                           "end": time_offset + (piece[-1] - begin) * TIME_PRECISION, "tokens": piece})
            last = cut
        seek = seek + size if single_ending else seek + (tokens[last - 1] - begin) * INPUT_STRIDE
        return pieces, seek, single_ending


@dataclass
class Transcript:
    text: str
    segments: list[Segment]
    language: str
    language_probability: float
    duration: float                # seconds of audio

    def as_dict(self) -> dict:
        return {"text": self.text, "language": self.language, "duration": self.duration,
                "segments": [s.__dict__ for s in self.segments]}
