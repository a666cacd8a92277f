"""Voice activity through the runtime against silero-vad's own get_speech_timestamps (its ONNX model on
onnxruntime) on speech the piper voice says: the same probabilities within 1e-4 and the same segments,
with silero's defaults and with faster-whisper's (2 s of silence to end, 400 ms of padding)."""
from __future__ import annotations

import numpy as np
import pytest
import silero_vad as silero
import torch

from soma_runtime.engine.vad import VoiceActivity, speech_segments
from soma_runtime.errors import RequestError
from soma_runtime.tasks import Runtime
from tests.loaders.test_onnx_models import package_data


@pytest.fixture(scope="module")
def vad():
    return VoiceActivity(Runtime("cpu").load(package_data("silero_vad", "silero_vad.onnx"), progress=False))


@pytest.mark.parametrize("options", [{}, {"min_silence_ms": 2000, "speech_pad_ms": 400, "min_speech_ms": 0},
                                     {"threshold": 0.3, "min_silence_ms": 300}], ids=["silero", "faster-whisper", "low"])
def test_segments_match_silero_vads_own(vad, speech, options):
    names = {"min_silence_ms": "min_silence_duration_ms", "speech_pad_ms": "speech_pad_ms",
             "min_speech_ms": "min_speech_duration_ms", "threshold": "threshold"}
    model = silero.load_silero_vad(onnx=True)
    theirs = silero.get_speech_timestamps(torch.from_numpy(speech), model, **{names[k]: v for k, v in options.items()})
    ours = vad.segments(speech, **options)
    assert ours == [(s["start"], s["end"]) for s in theirs]
    assert len(ours) >= 1


def test_probabilities_match_silero_vads_own(vad, speech):
    model = silero.load_silero_vad(onnx=True)
    theirs = [model(torch.from_numpy(speech[i:i + 512]), 16000).item() for i in range(0, len(speech) - 511, 512)]
    np.testing.assert_allclose(vad.probabilities(speech)[:len(theirs)], theirs, atol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_segment_rules_match_silero_on_random_probabilities(seed):
    """Probability runs that switch often, against silero-vad's own rules on the same numbers."""
    rng = np.random.default_rng(seed)
    probs = np.repeat(rng.choice([0.05, 0.4, 0.6, 0.95], 40), rng.integers(1, 12, 40)).tolist()
    total = len(probs) * 512 - int(rng.integers(0, 512))
    for ours, theirs in [({}, {}), ({"min_silence_ms": 2000, "speech_pad_ms": 400, "min_speech_ms": 0},
                                   {"min_silence_duration_ms": 2000, "speech_pad_ms": 400, "min_speech_duration_ms": 0})]:
        expected = silero.utils_vad.get_speech_timestamps_from_probs(probs, audio_length_samples=total, **theirs)
        assert speech_segments(probs, total, **ours) == [(s["start"], s["end"]) for s in expected]


def test_a_graph_that_is_not_a_vad_is_refused():
    from soma_runtime.ir.builder import GraphBuilder
    g = GraphBuilder()
    x = g.input("x", (1, 4), "f32")
    with pytest.raises(RequestError, match="not a Silero VAD"):
        VoiceActivity(Runtime("cpu").load(g.output(g.relu(x)), progress=False))
