"""A transcript written out as the OpenAI transcription API and the CLI give it: text, json, verbose_json,
SubRip (srt) or WebVTT (vtt)."""
from __future__ import annotations

import json

from soma_runtime.engine.transcribe.segments import Transcript
from soma_runtime.errors import RequestError

FORMATS = ("text", "json", "verbose_json", "srt", "vtt")
LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian", "pt": "portuguese",
                  "nl": "dutch", "ru": "russian", "zh": "chinese", "ja": "japanese", "ko": "korean", "ar": "arabic"}


def clock(seconds: float, separator: str) -> str:
    millis = round(max(seconds, 0.0) * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{separator}{millis % 1000:03d}"


def verbose(t: Transcript, words: bool = False) -> dict:
    out = {"task": "transcribe", "language": LANGUAGE_NAMES.get(t.language, t.language), "duration": round(t.duration, 3),
           "text": t.text,
           "segments": [{"id": s.id - 1, "seek": 0, "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                         "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                         "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
                        for s in t.segments]}
    if words:
        out["words"] = [w for s in t.segments for w in s.words]
    return out


def render(t: Transcript, fmt: str, words: bool = False) -> str:
    """The transcript in `fmt` (one of FORMATS)."""
    if fmt == "text":
        return t.text + "\n"
    if fmt == "json":
        return json.dumps({"text": t.text}, ensure_ascii=False)
    if fmt == "verbose_json":
        return json.dumps(verbose(t, words), ensure_ascii=False)
    if fmt == "srt":
        return "\n".join(f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n"
                         for i, s in enumerate(t.segments, 1))
    if fmt == "vtt":
        return "WEBVTT\n\n" + "\n".join(f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments)
    raise RequestError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
