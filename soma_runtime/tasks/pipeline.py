"""Speech in, speech out: Pipeline, a recognizer, a chat model and a voice run one after another."""
from __future__ import annotations

import reprlib
from dataclasses import dataclass

import numpy as np

from soma_runtime.engine.transcribe.segments import Transcript
from soma_runtime.errors import RequestError
from soma_runtime.tasks.base import Model
from soma_runtime.tasks.speech import SpeechModel
from soma_runtime.tasks.text import TextModel
from soma_runtime.tasks.voice import VoiceModel


@dataclass
class Reply:
    """What a speech pipeline heard, what it answered, and the answer spoken."""
    heard: Transcript
    text: str
    samples: np.ndarray
    rate: int


PIPELINE_SETS = {"transcribe": ("audio",), "chat": ("messages", "stream", "max_tokens"), "speak": ("text",)}


class Pipeline:
    """Speech in, speech out: the recognizer's transcript is the user's turn for the chat model, whose reply
    the voice says. Each stage's output is the next one's input; the stages keep their own options."""

    def __init__(self, asr: SpeechModel, llm: TextModel, tts: VoiceModel, system: str | None = None):
        for model, task in ((asr, "transcribe"), (llm, "generate"), (tts, "speak")):
            if not isinstance(model, Model) or model.task != task:
                got = f"{model.id} runs the {model.task} task" if isinstance(model, Model) else f"got a {type(model).__name__}"
                raise RequestError(f"{got}; this stage needs a {task} model")
        if not (system is None or isinstance(system, str)):
            raise RequestError(f"system must be text, got {type(system).__name__}")
        self.asr, self.llm, self.tts, self.system = asr, llm, tts, system

    def __call__(self, audio, max_tokens: int = 256, transcribe: dict | None = None, chat: dict | None = None,
                 speak: dict | None = None) -> Reply:
        """`transcribe`, `chat` and `speak`: each stage's own options, by name (but those the pipeline sets)."""
        for name, options in (("transcribe", transcribe), ("chat", chat), ("speak", speak)):
            if options is None:
                continue
            if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
                raise RequestError(f"{name} options must be a dict of its arguments by name, got {reprlib.repr(options)}")
            if set(options) & set(PIPELINE_SETS[name]):
                raise RequestError(f"{name} options cannot set {', '.join(PIPELINE_SETS[name])}: the pipeline does")
        heard = self.asr.transcribe(audio, **(transcribe or {}))
        if not heard.text:
            raise RequestError("no speech was heard in the audio")
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": heard.text}]
        text = self.llm.chat(messages, stream=False, max_tokens=max_tokens, **(chat or {})).strip()
        samples, rate = self.tts.speak(text or "...", **(speak or {}))
        return Reply(heard, text, samples, rate)
