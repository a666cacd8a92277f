"""WAV files read as scipy writes them (PCM 8/16/24/32, float, stereo mixed to mono), resampling equal to
scipy's resample_poly, and broken files rejected with a reason."""
from __future__ import annotations

import io

import numpy as np
import pytest
import scipy.io.wavfile
import scipy.signal

from soma_runtime.audio.io import read_wav, resample
from soma_runtime.errors import RequestError


def wav_bytes(rate: int, samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    scipy.io.wavfile.write(buffer, rate, samples)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype, scale", [(np.uint8, None), (np.int16, 2**15), (np.int32, 2**31), (np.float32, 1.0)])
def test_wav_samples_read_as_scipy_writes_them(dtype, scale):
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.9, 0.9, (1000, 2))
    stored = ((x * 127 + 128).astype(np.uint8) if dtype is np.uint8 else (x * scale).astype(dtype))
    samples, rate = read_wav(wav_bytes(22050, stored))
    expected = (stored.astype(np.float64) - 128) / 128 if dtype is np.uint8 else stored.astype(np.float64) / scale
    assert rate == 22050 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, expected.mean(axis=1), atol=1e-7)


def test_24_bit_pcm():
    values = np.array([0, 1, -1, 2**23 - 1, -(2**23), 12345, -54321], np.int64)
    raw = b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in values)
    header = (b"RIFF" + (36 + len(raw)).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
              + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (8000).to_bytes(4, "little")
              + (24000).to_bytes(4, "little") + (3).to_bytes(2, "little") + (24).to_bytes(2, "little")
              + b"data" + len(raw).to_bytes(4, "little"))
    samples, _ = read_wav(header + raw)
    np.testing.assert_allclose(samples, values / 2**23, atol=1e-7)


@pytest.mark.parametrize("rate", [8000, 22050, 24000, 44100, 48000, 16000])
def test_resampling_equals_scipy_resample_poly(rate):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 0.3, rate * 2 + 17).astype(np.float32)
    g = np.gcd(rate, 16000)
    expected = scipy.signal.resample_poly(x.astype(np.float64), 16000 // g, rate // g)
    ours = resample(x, rate, 16000)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=2e-6)


@pytest.mark.parametrize("data, message", [
    (b"", "not a WAV"),
    (b"RIFF\x00\x00\x00\x00WAVEdata", "no fmt chunk"),
    (wav_bytes(16000, np.zeros(100, np.int16))[:-50], "data chunk says 200 bytes, the file holds 150"),
    (wav_bytes(16000, np.zeros(100, np.int16)).replace(b"\x01\x00\x01\x00", b"\x01\x00\x00\x00", 1), "impossible format"),
    (wav_bytes(16000, np.zeros(100, np.int16)).replace(b"fmt \x10\x00\x00\x00\x01\x00", b"fmt \x10\x00\x00\x00\x02\x00", 1),
     "format 2 at 16 bits is not read"),
])
def test_broken_wav_files_are_request_errors(data, message):
    with pytest.raises(RequestError, match=message):
        read_wav(data)
