"""The speak task: VoiceModel, a voice (piper) that says text."""
from __future__ import annotations

import numpy as np

from soma_runtime import loaders
from soma_runtime.engine.graph import FamilyRunner, GraphRunner
from soma_runtime.engine.speak import Voice, VoiceConfig
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.tasks.base import check_flag
from soma_runtime.tasks.graph import GraphModel


class VoiceModel(GraphModel):
    """A voice (piper): text to speech. Its graph stays runnable as a graph's (`run`)."""

    task = "speak"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner | FamilyRunner):
        super().__init__(model_id, loaded, backend, runner)
        self.voice = Voice(runner, VoiceConfig.from_piper(loaded.metadata["voice"], loaded.path + ".json"))

    @property
    def sample_rate(self) -> int:
        return self.voice.config.sample_rate

    def speak(self, text: str, speaker=None, speed: float = 1.0, stream: bool = False, **scales):
        """int16 samples of `text` said by the voice, and its rate; with `stream`, an iterator of each
        sentence's samples as it is made. `speaker`: a name or id (multi-speaker voices); `speed` scales the
        voice's pace; `noise_scale`, `noise_w` override the voice's own."""
        check_flag("stream", stream)
        unknown = set(scales) - {"noise_scale", "noise_w"}
        if unknown:
            raise RequestError(f"unknown speech options: {', '.join(sorted(unknown))}")
        sentences = self.voice.speak(text, speaker, speed, **scales)
        if stream:
            return sentences
        return np.concatenate([np.zeros(0, np.int16), *sentences]), self.sample_rate
