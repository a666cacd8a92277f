"""Transcribing only the speech: the VAD's speech chunks cut from a recording and joined, and times in
the joined audio mapped back to the recording's (each chunk's time shifted by the silence dropped before
it), as faster-whisper's VAD filter does."""
from __future__ import annotations

import bisect

import numpy as np

VAD_OPTIONS = {"threshold": 0.5, "min_speech_ms": 0, "min_silence_ms": 2000, "speech_pad_ms": 400}   # faster-whisper's
VAD_BEYOND_SECONDS = 30.0        # recordings longer than this are filtered by default


class SpeechMap:
    def __init__(self, chunks: list[tuple[int, int]], rate: int):
        self.rate, self.ends, self.silence_before = rate, [], []
        dropped, previous_end = 0, 0
        for start, end in chunks:
            dropped += start - previous_end
            previous_end = end
            self.ends.append(end - dropped)
            self.silence_before.append(dropped / rate)

    def chunk_of(self, seconds: float, is_end: bool = False) -> int:
        sample = int(seconds * self.rate)
        if is_end and sample in self.ends:
            return self.ends.index(sample)
        return min(bisect.bisect(self.ends, sample), len(self.ends) - 1)

    def original(self, seconds: float, is_end: bool = False) -> float:
        return round(self.silence_before[self.chunk_of(seconds, is_end)] + seconds, 2)


def speech_only(audio: np.ndarray, chunks: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([audio[a:b] for a, b in chunks]) if chunks else np.zeros(0, np.float32)


def restore(segment, speech_map: SpeechMap) -> None:
    """A segment's (and its words') times on the recording's clock: each word within the chunk its middle
    falls in, the segment spanning its words."""
    if segment.words:
        for w in segment.words:
            chunk = speech_map.chunk_of((w["start"] + w["end"]) / 2)
            w["start"] = round(speech_map.silence_before[chunk] + w["start"], 2)
            w["end"] = round(speech_map.silence_before[chunk] + w["end"], 2)
        segment.start, segment.end = segment.words[0]["start"], segment.words[-1]["end"]
    else:
        segment.start, segment.end = speech_map.original(segment.start), speech_map.original(segment.end, is_end=True)
