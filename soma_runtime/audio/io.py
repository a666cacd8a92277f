"""Audio in: WAV files read natively (PCM 8/16/24/32-bit and IEEE float, any channel count, mixed to mono),
every size checked against the file, and resampling to the rate a model wants by the polyphase filter
scipy's resample_poly designs (a Kaiser-windowed sinc, beta 5, ten zero crossings per side)."""
from __future__ import annotations

import math
import struct

import numpy as np

from soma_runtime.errors import RequestError

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
MAX_CHANNELS = 64
OUTPUT_CHUNK = 1 << 16            # output samples gathered at once (bounds the [chunk, taps] working array)


def read_wav(data: bytes, source: str = "audio") -> tuple[np.ndarray, int]:
    """(mono f32 samples in [-1, 1], sample rate) of a RIFF/WAVE file's bytes; RequestError naming what
    is wrong with a file that is not one, is cut short, or says sizes it does not hold."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise RequestError(f"{source}: not a WAV file (no RIFF/WAVE header)")
    at, fmt, samples = 12, None, None
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        body = data[at + 8:at + 8 + size]
        if len(body) < size and chunk != b"data":
            raise RequestError(f"{source}: its {chunk!r} chunk says {size} bytes, the file holds {len(body)}")
        if chunk == b"fmt ":
            if size < 16:
                raise RequestError(f"{source}: its fmt chunk is {size} bytes, under 16")
            fmt = struct.unpack("<HHIIHH", body[:16]) + ((struct.unpack("<H", body[24:26])[0],) if size >= 26 else (None,))
        elif chunk == b"data":
            if len(body) < size:
                raise RequestError(f"{source}: its data chunk says {size} bytes, the file holds {len(body)}")
            samples = body
            break
        at += 8 + size + (size & 1)
    if fmt is None or samples is None:
        raise RequestError(f"{source}: no {'fmt' if fmt is None else 'data'} chunk")
    tag, channels, rate, _, align, bits, sub = fmt
    tag = sub if tag == EXTENSIBLE and sub is not None else tag
    if not 1 <= channels <= MAX_CHANNELS or rate < 1 or align != channels * ((bits + 7) // 8):
        raise RequestError(f"{source}: an impossible format ({channels} channels, {rate} Hz, {bits} bits, {align}-byte frames)")
    kinds = {(PCM, 8): "u1", (PCM, 16): "<i2", (PCM, 32): "<i4", (FLOAT, 32): "<f4", (FLOAT, 64): "<f8"}
    frames = len(samples) // align
    raw = samples[:frames * align]
    if (tag, bits) == (PCM, 24):
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)) << 8 >> 8) / 2.0**23
    elif (tag, bits) in kinds:
        values = np.frombuffer(raw, kinds[(tag, bits)]).astype(np.float64)
        if tag == PCM:
            values = (values - 128) / 128 if bits == 8 else values / 2.0 ** (bits - 1)
    else:
        raise RequestError(f"{source}: WAV format {tag} at {bits} bits is not read (PCM 8/16/24/32, float 32/64)")
    values = values.reshape(frames, channels).mean(axis=1)
    if not np.isfinite(values).all():
        raise RequestError(f"{source}: its samples are not all finite")
    return values.astype(np.float32), rate


def resample(audio: np.ndarray, rate: int, to: int) -> np.ndarray:
    """`audio` at `rate` Hz, resampled to `to` Hz (scipy.signal.resample_poly's result, padtype constant)."""
    if rate == to:
        return np.asarray(audio, np.float32)
    g = math.gcd(rate, to)
    up, down = to // g, rate // g
    taps = lowpass(up, down) * up
    half = (len(taps) - 1) // 2
    pre = down - half % down
    taps = np.concatenate([np.zeros(pre), taps])
    n_out = -(-len(audio) * up // down)
    skip = (half + pre) // down
    per_phase = -(-len(taps) // up)
    phases = np.zeros(per_phase * up)
    phases[:len(taps)] = taps
    phases = phases.reshape(per_phase, up).T                     # [up, per_phase]: tap j*up + p of phase p
    x = np.concatenate([np.zeros(per_phase), np.asarray(audio, np.float64), np.zeros(per_phase)])
    out = np.empty(n_out)
    for first in range(0, n_out, OUTPUT_CHUNK):
        k = np.arange(first, min(n_out, first + OUTPUT_CHUNK)) + skip
        t = k * down                                              # the output's time on the upsampled grid
        newest = t // up                                          # the latest input sample at or before it
        window = x[(newest + per_phase)[:, None] - np.arange(per_phase)]
        out[first:first + len(k)] = np.einsum("kj,kj->k", window, phases[t % up])
    return out.astype(np.float32)


def lowpass(up: int, down: int) -> np.ndarray:
    """firwin(20 * max(up, down) + 1, 1 / max(up, down), window=("kaiser", 5.0)): unit gain at DC."""
    rate = max(up, down)
    n = 20 * rate + 1
    m = np.arange(n) - (n - 1) / 2
    h = np.sinc(m / rate) / rate * np.kaiser(n, 5.0)
    return h / h.sum()


MAX_SECONDS = 3600                # the longest recording taken (a bound on what one request makes us hold)


def load_audio(source, rate: int = 16000, max_seconds: float = MAX_SECONDS, name: str = "audio") -> np.ndarray:
    """Mono f32 samples at `rate` of a file path, its bytes, or samples already at `rate`. WAV is read
    here; FLAC, OGG/Vorbis/Opus and MP3 through soundfile (libsndfile). RequestError for anything else,
    an empty or cut-short file, or more than `max_seconds`."""
    if isinstance(source, np.ndarray):
        samples, got = np.asarray(source, np.float32), rate
        if samples.ndim != 1:
            raise RequestError(f"{name}: samples must be mono [n], got shape {list(samples.shape)}")
    else:
        if isinstance(source, str):
            name = source if name == "audio" else name
            try:
                with open(source, "rb") as f:
                    source = f.read(int(max_seconds * 48000 * 4 * 2) + (1 << 20))
            except OSError as e:
                raise RequestError(f"{name}: cannot read ({e.strerror})") from None
        data = bytes(source)
        samples, got = read_wav(data, name) if data[:4] == b"RIFF" else read_encoded(data, name, max_seconds)
    if not len(samples):
        raise RequestError(f"{name}: holds no samples")
    if len(samples) > max_seconds * got:
        raise RequestError(f"{name}: {len(samples) / got:.0f} s is longer than the {max_seconds:.0f} s taken")
    if not np.isfinite(samples).all():
        raise RequestError(f"{name}: samples must be finite")
    return resample(samples, got, rate) if got != rate else samples


def read_encoded(data: bytes, name: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """A compressed file's samples, its length checked from its header before it is decoded."""
    import io

    import soundfile
    try:
        info = soundfile.info(io.BytesIO(data))
        if info.samplerate > 0 and info.frames > max_seconds * info.samplerate:
            raise RequestError(f"{name}: {info.frames / info.samplerate:.0f} s is longer than the {max_seconds:.0f} s taken")
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise RequestError(f"{name}: not a readable audio file (wav, flac, ogg, mp3): {e}") from None
    return samples.mean(axis=1).astype(np.float32), int(rate)


def wav_header(rate: int, frames: int | None = None) -> bytes:
    """A 16-bit mono WAV header; for a stream of unknown length (frames None) its sizes are at their
    maximum, as streaming writers leave them."""
    data = 0xFFFFFFFF if frames is None else 2 * frames
    riff = 0xFFFFFFFF if frames is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit mono PCM samples as a WAV file."""
    samples = np.asarray(samples, "<i2")
    return wav_header(rate, len(samples)) + samples.tobytes()
