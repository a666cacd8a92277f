"""The speech commands: `transcribe` (audio -> text, srt, vtt or json), `speak` (text -> a WAV file) and
`pipeline` (audio -> transcript -> chat reply -> spoken WAV)."""
from __future__ import annotations

import argparse
import os
import sys

from soma_runtime.engine.speak import MAX_TEXT, SPEEDS
from soma_runtime.engine.transcribe.formats import FORMATS
from soma_runtime.errors import RequestError

NEEDS = {"transcribe": "a whisper model", "speak": "a piper voice (its .onnx beside its .onnx.json)"}


def runtime(args):
    from soma_runtime.tasks import Runtime
    return Runtime(args.backend, threads=args.threads)


def load_for(args, task: str):
    """The model `--model` names, if it runs `task`; else an error naming the task it has."""
    model = runtime(args).load(args.model, sha256=args.sha256)
    if model.task != task:
        raise RequestError(f"{args.model} is a {model.task} model; {task} needs {NEEDS[task]}")
    return model


def text_of(args) -> str:
    """The text to say: the argument, or stdin ('-') read as UTF-8, no more than a request may speak."""
    if args.text != "-":
        return args.text
    data = sys.stdin.buffer.read(4 * MAX_TEXT + 1)          # UTF-8 takes at most 4 bytes a character
    if len(data) > 4 * MAX_TEXT:
        raise RequestError(f"the text on stdin is longer than the {MAX_TEXT} characters one request may speak")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise RequestError(f"the text on stdin is not UTF-8 (byte {e.start})") from None


def write(path: str, data: bytes) -> None:
    if path == "-":
        sys.stdout.buffer.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


def cmd_transcribe(args) -> int:
    from soma_runtime.engine.transcribe.formats import render
    model = load_for(args, "transcribe")
    options = {"temperature": args.temperature} if args.temperature is not None else {}
    transcripts = model.transcribe(args.audio, language=args.language, beam_size=args.beam_size, vad=args.vad,
                                   initial_prompt=args.prompt, word_timestamps=args.word_timestamps,
                                   batch_size=args.batch_size, **options)
    fmt = {"json": "verbose_json"}.get(args.format, args.format)
    out_dir = args.out_dir or ("." if len(args.audio) > 1 else None)
    for path, transcript in zip(args.audio, transcripts):
        text = render(transcript, fmt, args.word_timestamps) + ("\n" if fmt == "verbose_json" else "")
        if out_dir is None:
            sys.stdout.write(text)
        else:
            stem = os.path.splitext(os.path.basename(path))[0]
            write(os.path.join(out_dir, f"{stem}.{args.format}"), text.encode())
    return 0


def cmd_speak(args) -> int:
    from soma_runtime.audio.io import wav_bytes
    model = load_for(args, "speak")
    samples, rate = model.speak(text_of(args), speaker=args.speaker, speed=args.speed)
    write(args.out, wav_bytes(samples, rate))
    return 0


def cmd_pipeline(args) -> int:
    from soma_runtime.audio.io import wav_bytes
    reply = runtime(args).pipeline(args.asr, args.llm, args.tts, system=args.system)(args.audio, max_tokens=args.max_tokens)
    write(args.out, wav_bytes(reply.samples, reply.rate))
    print(f"heard: {reply.heard.text}\nreply: {reply.text}", file=sys.stderr)
    return 0


def add_common(p) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the physical cores)")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "reference"))


def add_parsers(sub, sha256_arg) -> None:
    t = sub.add_parser("transcribe", help="speech to text with a whisper model (CTranslate2 or HF directory)")
    t.add_argument("--model", "-m", default="whisper-tiny.en", help="a whisper directory or name (default: whisper-tiny.en)")
    t.add_argument("--audio", "-a", required=True, nargs="+", help="audio files: wav, flac, ogg or mp3")
    t.add_argument("--out-dir", default=None, help="write <name>.<format> per file here (default: stdout for one "
                   "file, the current directory for several)")
    t.add_argument("--batch-size", type=int, default=4, help="files decoding at once")
    t.add_argument("--format", "-f", default="text", choices=[f for f in FORMATS if f != "verbose_json"])
    t.add_argument("--language", default=None, help="the spoken language's code (default: detected)")
    t.add_argument("--beam-size", type=int, default=5)
    t.add_argument("--temperature", type=float, default=None, help="one temperature instead of the fallback list")
    t.add_argument("--prompt", default=None, help="text the first window is conditioned on (names, spellings)")
    t.add_argument("--vad", action=argparse.BooleanOptionalAction, default=None,
                   help="transcribe only the speech Silero VAD finds (default: beyond 30 s)")
    t.add_argument("--word-timestamps", action="store_true", help="each word's start and end (json format)")
    t.add_argument("--sha256", type=sha256_arg, default=None)
    add_common(t)
    t.set_defaults(run=cmd_transcribe)

    s = sub.add_parser("speak", help="text to speech with a piper voice (voice.onnx beside voice.onnx.json)")
    s.add_argument("--model", "-m", required=True, help="the voice's .onnx file")
    s.add_argument("--text", "-t", required=True, help=f"the text to say ('-': stdin), at most {MAX_TEXT} characters")
    s.add_argument("--out", "-o", required=True, help="the WAV file to write ('-': stdout)")
    s.add_argument("--speaker", default=None, help="a speaker's name or id (multi-speaker voices)")
    s.add_argument("--speed", type=float, default=1.0, help=f"the pace, {SPEEDS[0]:g} to {SPEEDS[1]:g}")
    s.add_argument("--sha256", type=sha256_arg, default=None)
    add_common(s)
    s.set_defaults(run=cmd_speak)

    p = sub.add_parser("pipeline", help="speech in, speech out: transcribe, answer with a chat model, say the answer")
    p.add_argument("--asr", default="whisper-tiny.en", help="the whisper model")
    p.add_argument("--llm", default="default", help="the chat model (default: the bundled SmolLM2)")
    p.add_argument("--tts", required=True, help="the piper voice's .onnx file")
    p.add_argument("--audio", "-a", required=True, help="the question, as an audio file")
    p.add_argument("--out", "-o", required=True, help="the WAV file the spoken reply goes to")
    p.add_argument("--system", default=None, help="a system prompt for the chat model")
    p.add_argument("--max-tokens", type=int, default=128)
    add_common(p)
    p.set_defaults(run=cmd_pipeline)
