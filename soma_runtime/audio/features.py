"""Whisper's log-mel front end: 16 kHz mono samples -> [mels, frames] features, as transformers'
WhisperFeatureExtractor computes them: the audio padded (or cut) to a 30 s window, a centred STFT
(reflect padding, periodic Hann window, n_fft 400, hop 160) whose last frame is dropped, power through
Slaney-normalized mel filters on the Slaney scale, log10 floored at 1e-10, then at 8 below the
maximum, scaled to (x + 4) / 4. Knows audio, nothing of models."""
from __future__ import annotations

import functools

import numpy as np

from soma_runtime.errors import RequestError

SAMPLE_RATE, N_FFT, HOP, CHUNK_SECONDS = 16000, 400, 160, 30
WINDOW_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS
MEL_COUNTS = (80, 128)


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, np.float64)
    return np.where(hz < 1000.0, 3.0 * hz / 200.0, 15.0 + 27.0 * np.log(np.maximum(hz, 1e-10) / 1000.0) / np.log(6.4))


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    return np.where(mel < 15.0, 200.0 * mel / 3.0, 1000.0 * np.exp(np.log(6.4) * (mel - 15.0) / 27.0))


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int, n_fft: int = N_FFT, rate: int = SAMPLE_RATE) -> np.ndarray:
    """[n_fft // 2 + 1, n_mels] triangular filters between mel-spaced edges from 0 Hz to Nyquist, each
    scaled to unit area (Slaney's normalization)."""
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(rate / 2), n_mels + 2))
    bins = np.linspace(0, rate // 2, n_fft // 2 + 1)
    widths = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    rising, falling = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges[2:] - edges[:-2]))


def log_mel(audio: np.ndarray, n_mels: int = 80, window_samples: int | None = WINDOW_SAMPLES) -> np.ndarray:
    """[n_mels, frames] f32 features of 16 kHz mono `audio`, padded with silence (or cut) to
    `window_samples` (None: as long as it is, at least one hop)."""
    if n_mels not in MEL_COUNTS:
        raise RequestError(f"whisper's front end has {' or '.join(map(str, MEL_COUNTS))} mels, not {n_mels}")
    audio = np.asarray(audio, np.float64)
    if audio.ndim != 1:
        raise RequestError(f"audio must be mono samples [n], got shape {list(audio.shape)}")
    if not np.isfinite(audio).all():
        raise RequestError("audio samples must be finite")
    length = window_samples if window_samples is not None else max(len(audio), N_FFT // 2 + 1)
    audio = np.pad(audio[:length], (0, max(0, length - len(audio))))
    padded = np.pad(audio, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:-1]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)          # periodic Hann
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    logs = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10)).T
    logs = np.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).astype(np.float32)
