"""Whisper's log-mel front end against transformers' WhisperFeatureExtractor in the same run (80 and 128
mels; speech-like, noisy, short, long and silent audio): within 1e-6 of its numpy path (f64, what it
runs without torch), and of its default torch path within that path's own f32 error (it strays up to
2e-5 from the numpy one on these signals)."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from soma_runtime.audio.features import SAMPLE_RATE, log_mel
from soma_runtime.errors import RequestError


def signals() -> dict:
    rng = np.random.default_rng(0)
    t = np.arange(SAMPLE_RATE * 7) / SAMPLE_RATE
    voiced = np.sin(2 * np.pi * (120 + 40 * np.sin(2 * np.pi * 3 * t)) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    return {"voiced": (voiced * 0.3 + rng.normal(0, 0.01, t.size)).astype(np.float32),
            "noise": rng.normal(0, 0.2, SAMPLE_RATE * 3).astype(np.float32),
            "short": rng.normal(0, 0.1, 1234).astype(np.float32),
            "long": rng.normal(0, 0.05, SAMPLE_RATE * 41).astype(np.float32),     # cut to the 30 s window
            "silence": np.zeros(SAMPLE_RATE, np.float32)}


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("name", sorted(signals()))
def test_log_mel_matches_whisper_feature_extractor(n_mels, name):
    audio = signals()[name]
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    window = np.pad(audio[:480000], (0, max(0, 480000 - len(audio))))
    exact = extractor._np_extract_fbank_features(window[None], "cpu")[0]
    default = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    ours = log_mel(audio, n_mels)
    assert ours.shape == exact.shape == default.shape == (n_mels, 3000)
    np.testing.assert_allclose(ours, exact, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ours, default, atol=5e-5, rtol=0)


def test_bad_audio_is_a_request_error():
    with pytest.raises(RequestError, match="mono"):
        log_mel(np.zeros((2, 100)))
    with pytest.raises(RequestError, match="finite"):
        log_mel(np.array([0.0, np.nan]))
    with pytest.raises(RequestError, match="80 or 128"):
        log_mel(np.zeros(100), n_mels=64)
