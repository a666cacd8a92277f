"""The speech tasks' routes, OpenAI's: `/v1/audio/transcriptions` (a multipart upload: file, model,
language, prompt, response_format, temperature, timestamp_granularities[]) for `transcribe` models, and
`/v1/audio/speech` (JSON: model, input, voice, response_format wav|pcm, speed) for `speak` models, its
audio streamed a sentence at a time. A model runs one request at a time, off the event loop."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from soma_runtime.audio.io import wav_header
from soma_runtime.engine.speak import MAX_TEXT, SPEEDS
from soma_runtime.engine.transcribe.formats import FORMATS, render
from soma_runtime.errors import RequestError
from soma_runtime.server.http import ServerState, parse

FIELDS = {"model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]", "beam_size"}
MAX_FIELD_BYTES = 64 * 1024
SPEECH_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}


class SpeechRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str
    input: str = Field(min_length=1, max_length=MAX_TEXT)
    voice: str | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = Field(1.0, ge=SPEEDS[0], le=SPEEDS[1])


def locked(served, fn, *args, **kwargs):
    with served.lock:
        return fn(*args, **kwargs)


async def form_of(request: Request) -> tuple[bytes, dict]:
    """The uploaded file's bytes and the other fields, each checked: one file, known fields, short values."""
    try:
        form = await request.form(max_files=1, max_fields=len(FIELDS) + 4, max_part_size=MAX_FIELD_BYTES)
    except (HTTPException, MultiPartException) as e:    # malformed bodies, too many parts, parts too large
        raise RequestError(f"the upload is not a valid multipart form: {getattr(e, 'detail', None) or e}") from None
    upload, fields = None, {}
    for name, value in form.multi_items():
        if name == "file" and hasattr(value, "read"):
            upload = await value.read()
        elif name in FIELDS and isinstance(value, str):
            fields.setdefault(name, []).append(value)
        else:
            raise RequestError(f"unknown form field {name!r}; fields: file, {', '.join(sorted(FIELDS))}")
    if upload is None:
        raise RequestError("the form needs an audio file in its 'file' field")
    if "model" not in fields:
        raise RequestError("the form needs a 'model' field")
    return upload, fields


def transcription_options(fields: dict) -> dict:
    one = {k: v[-1] for k, v in fields.items()}
    options = {}
    if one.get("language"):
        options["language"] = one["language"]
    if one.get("prompt"):
        options["initial_prompt"] = one["prompt"]
    for name, kind in (("temperature", float), ("beam_size", int)):
        if name in one:
            try:
                options[name] = kind(one[name])
            except ValueError:
                raise RequestError(f"{name} must be a number, got {one[name]!r}") from None
    granularities = set(fields.get("timestamp_granularities[]", ["segment"]))
    if not granularities <= {"segment", "word"}:
        raise RequestError(f"timestamp_granularities must be segment or word, got {sorted(granularities)}")
    options["word_timestamps"] = "word" in granularities
    return options


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        upload, fields = await form_of(request)
        fmt = fields.get("response_format", ["json"])[-1]
        if fmt not in FORMATS:
            raise RequestError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        served = state.model(fields["model"][-1], "transcribe", "speech is made on /v1/audio/speech")
        options = transcription_options(fields)
        transcript = await run_in_threadpool(locked, served, served.model.transcribe, upload, progress=False, **options)
        text = render(transcript, fmt, options["word_timestamps"])
        if fmt in ("json", "verbose_json"):
            return Response(text, media_type="application/json")
        return PlainTextResponse(text, media_type="text/vtt" if fmt == "vtt" else "text/plain")

    @routes.post("/v1/audio/speech")
    async def speech(request: Request):
        body = await parse(request, SpeechRequest)
        served = state.model(body.model, "speak", "audio is transcribed on /v1/audio/transcriptions")
        voice = served.model.voice
        speaker = body.voice if body.voice in voice.config.speaker_id_map else None     # OpenAI's voice names: the default
        sentences = await run_in_threadpool(locked, served, served.model.speak, body.input, speaker, body.speed, stream=True)
        first = await run_in_threadpool(locked, served, next, sentences, None)          # errors before the stream starts

        def chunks():
            if body.response_format == "wav":
                yield wav_header(voice.config.sample_rate)
            if first is not None:
                yield first.astype("<i2").tobytes()
            while (samples := locked(served, next, sentences, None)) is not None:
                yield samples.astype("<i2").tobytes()
        return StreamingResponse(iterate_in_threadpool(chunks()), media_type=SPEECH_FORMATS[body.response_format],
                                 headers={"X-Sample-Rate": str(voice.config.sample_rate)})

    return routes
