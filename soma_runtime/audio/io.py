"""Audio in: WAV files read natively (PCM 8/16/24/32-bit and IEEE float, any channel count, mixed to mono),
every size checked against the file, and resampling to the rate a model wants by the Kaiser-windowed sinc
(beta 5, ten zero crossings per side) scipy's resample_poly designs.

What one recording may cost is bounded from its header, before a sample is decoded:
  MIN_RATE..MAX_RATE  sample rates taken, 1 kHz to 384 kHz (telephone to studio converters), in and out
  MAX_SECONDS         the longest recording, an hour (callers may ask for less: `max_seconds`)
  MAX_SAMPLES         the most samples decoded, an hour at 48 kHz (faster rates take shorter recordings)
  MAX_CHANNELS        channels a frame may have
  MAX_FILE_BYTES      the largest file read from a path
A WAV whose RIFF or data size is 0xFFFFFFFF (or a data size of 0), as streaming writers leave them,
holds its samples to the end of the file.
"""
from __future__ import annotations

import functools
import io
import math
import os
import struct

import numpy as np

from soma_runtime.errors import RequestError

MIN_RATE, MAX_RATE = 1_000, 384_000
MAX_SECONDS = 3600
MAX_SAMPLES = MAX_SECONDS * 48_000
MAX_CHANNELS = 64
MAX_FILE_BYTES = 1 << 30          # an hour of 48 kHz 16-bit stereo PCM is 0.69 GB
MAX_CHUNKS = 1024                 # RIFF chunks walked before the data chunk (real files have a handful)
STREAMING_SIZES = (0, 0xFFFFFFFF)

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
PCM_KINDS = {(PCM, 8): "u1", (PCM, 16): "<i2", (PCM, 32): "<i4", (FLOAT, 32): "<f4", (FLOAT, 64): "<f8"}
BLOCK_FRAMES = 1 << 16            # frames converted at once (bounds the float64 working copy)
WORK_ELEMENTS = 1 << 20           # elements of a resampler's [outputs, taps] working arrays
ZERO_CROSSINGS, KAISER_BETA = 10, 5.0
MAX_POLYPHASE = 8192              # up or down factors beyond this (a prime rate) use the tabulated kernel
KERNEL_STEPS = 4096               # tabulated kernel points per zero crossing (linear interpolation: error < 1e-7)


def check_rate(rate, what: str) -> int:
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
        raise RequestError(f"{what}: a sample rate of {rate!r} Hz is outside the {MIN_RATE}-{MAX_RATE} Hz taken")
    return int(rate)


def check_length(frames: int, rate: int, max_seconds: float, name: str) -> None:
    """RequestError for a recording longer than `max_seconds` or than MAX_SAMPLES samples."""
    if frames > max_seconds * rate:
        raise RequestError(f"{name}: {frames / rate:.0f} s is longer than the {max_seconds:.0f} s taken")
    if frames > MAX_SAMPLES:
        raise RequestError(f"{name}: {frames} samples at {rate} Hz are more than the {MAX_SAMPLES} taken "
                           f"(an hour at 48 kHz)")


def read_wav(data: bytes, source: str = "audio", max_seconds: float = MAX_SECONDS) -> tuple[np.ndarray, int]:
    """(mono f32 samples in [-1, 1], sample rate) of a RIFF/WAVE file's bytes; RequestError naming what
    is wrong with a file that is not one, is cut short, says sizes it does not hold, or is too long."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise RequestError(f"{source}: not a WAV file (no RIFF/WAVE header)")
    view = memoryview(data)
    at, fmt, samples = 12, None, None
    for _ in range(MAX_CHUNKS):
        if at + 8 > len(data):
            break
        chunk, size = bytes(view[at:at + 4]), struct.unpack("<I", view[at + 4:at + 8])[0]
        if chunk == b"data" and fmt is not None and size in STREAMING_SIZES:
            size = len(data) - at - 8
        body = view[at + 8:at + 8 + size]
        if len(body) < size:
            raise RequestError(f"{source}: its {chunk.decode('latin-1').strip()} chunk says {size} bytes, "
                               f"the file holds {len(body)}")
        if chunk == b"fmt ":
            if size < 16:
                raise RequestError(f"{source}: its fmt chunk is {size} bytes, under 16")
            fmt = struct.unpack("<HHIIHH", body[:16]) + ((struct.unpack("<H", body[24:26])[0],) if size >= 26 else (None,))
        elif chunk == b"data":
            samples = body
            break
        at += 8 + size + (size & 1)
    else:
        raise RequestError(f"{source}: more than {MAX_CHUNKS} chunks before its data")
    if fmt is None or samples is None:
        raise RequestError(f"{source}: no {'fmt' if fmt is None else 'data'} chunk")
    tag, channels, rate, _, align, bits, sub = fmt
    tag = sub if tag == EXTENSIBLE and sub is not None else tag
    if not 1 <= channels <= MAX_CHANNELS or bits < 1 or align != channels * ((bits + 7) // 8):
        raise RequestError(f"{source}: an impossible format ({channels} channels, {rate} Hz, {bits} bits, {align}-byte frames)")
    check_rate(rate, source)
    if (tag, bits) not in PCM_KINDS and (tag, bits) != (PCM, 24):
        raise RequestError(f"{source}: WAV format {tag} at {bits} bits is not read (PCM 8/16/24/32, float 32/64)")
    frames = len(samples) // align
    check_length(frames, rate, max_seconds, source)
    mono = np.empty(frames, np.float32)
    for first in range(0, frames, BLOCK_FRAMES):
        last = min(frames, first + BLOCK_FRAMES)
        mono[first:last] = pcm_values(samples[first * align:last * align], tag, bits).reshape(-1, channels).mean(axis=1)
    if not np.isfinite(mono).all():
        raise RequestError(f"{source}: its samples are not all finite")
    return mono, rate


def pcm_values(raw, tag: int, bits: int) -> np.ndarray:
    """A WAV's interleaved sample bytes as float64 values in [-1, 1]."""
    if (tag, bits) == (PCM, 24):
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        return ((triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)) << 8 >> 8) / 2.0**23
    values = np.frombuffer(raw, PCM_KINDS[(tag, bits)]).astype(np.float64)
    if tag == PCM:
        return (values - 128) / 128 if bits == 8 else values / 2.0 ** (bits - 1)
    return values


def resample(audio: np.ndarray, rate: int, to: int) -> np.ndarray:
    """`audio` at `rate` Hz, resampled to `to` Hz: scipy.signal.resample_poly's result (padtype constant)
    where the reduced up/down factors are at most MAX_POLYPHASE, else the same kernel evaluated at each
    output's time (a prime rate's filter would have millions of taps)."""
    rate, to = check_rate(rate, "resampling from"), check_rate(to, "resampling to")
    if rate == to:
        return np.asarray(audio, np.float32)
    g = math.gcd(rate, to)
    if max(rate, to) // g <= MAX_POLYPHASE:
        return polyphase(audio, to // g, rate // g)
    return tabulated(audio, rate, to)


def polyphase(audio: np.ndarray, up: int, down: int) -> np.ndarray:
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
    chunk = max(1, WORK_ELEMENTS // per_phase)
    for first in range(0, n_out, chunk):
        k = np.arange(first, min(n_out, first + chunk)) + skip
        t = k * down                                              # the output's time on the upsampled grid
        newest = t // up                                          # the latest input sample at or before it
        window = x[(newest + per_phase)[:, None] - np.arange(per_phase)]
        out[first:first + len(k)] = np.einsum("kj,kj->k", window, phases[t % up])
    return out.astype(np.float32)


def lowpass(up: int, down: int) -> np.ndarray:
    """firwin(20 * max(up, down) + 1, 1 / max(up, down), window=("kaiser", 5.0)): unit gain at DC."""
    rate = max(up, down)
    n = 2 * ZERO_CROSSINGS * rate + 1
    m = np.arange(n) - (n - 1) / 2
    h = np.sinc(m / rate) / rate * np.kaiser(n, KAISER_BETA)
    return h / h.sum()


@functools.lru_cache(maxsize=1)
def kernel_table() -> np.ndarray:
    """sinc(u) * kaiser(u / 10) at u = i / KERNEL_STEPS for u in [0, 10], then zeros (two, for interpolation)."""
    u = np.arange(ZERO_CROSSINGS * KERNEL_STEPS + 2) / KERNEL_STEPS
    inside = np.clip(1 - (u / ZERO_CROSSINGS) ** 2, 0, None)
    table = np.sinc(u) * np.i0(KAISER_BETA * np.sqrt(inside)) / np.i0(KAISER_BETA)
    table[u >= ZERO_CROSSINGS] = 0.0
    return table


def tabulated(audio: np.ndarray, rate: int, to: int) -> np.ndarray:
    """resample_poly's kernel (a low-pass at the lower Nyquist) evaluated at each output's exact time
    k * rate / to from the tabulated kernel; each output's weights sum to one."""
    cutoff = min(1.0, to / rate)                                  # of the input's Nyquist
    span = math.ceil(ZERO_CROSSINGS / cutoff)                     # input samples on each side of an output
    offsets = np.arange(-span, span + 2)
    x = np.concatenate([np.zeros(span + 1), np.asarray(audio, np.float64), np.zeros(span + 2)])
    table = kernel_table()
    n_out = -(-len(audio) * to // rate)
    out = np.empty(n_out)
    chunk = max(1, WORK_ELEMENTS // len(offsets))
    for first in range(0, n_out, chunk):
        k = np.arange(first, min(n_out, first + chunk), dtype=np.int64)
        newest, frac = k * rate // to, (k * rate % to) / to        # the output's time: newest + frac input samples
        at = np.abs(frac[:, None] - offsets) * (cutoff * KERNEL_STEPS)
        i = np.minimum(at.astype(np.int64), len(table) - 2)
        weights = table[i] + (table[i + 1] - table[i]) * (at - i)
        window = x[newest[:, None] + offsets + span + 1]
        out[first:first + len(k)] = np.einsum("kj,kj->k", window, weights) / weights.sum(axis=1)
    return out.astype(np.float32)


def load_audio(source, rate: int = 16000, max_seconds: float = MAX_SECONDS, name: str = "audio") -> np.ndarray:
    """Mono f32 samples at `rate` of a file path, its bytes, or samples already at `rate` (floats in
    [-1, 1], or 16/32-bit PCM integers, scaled by 1/2^15 and 1/2^31, as a WAV's are). WAV is read here;
    FLAC, OGG/Vorbis/Opus and MP3 through soundfile (libsndfile). RequestError for anything else, an
    empty or cut-short file, or more than `max_seconds`."""
    rate = check_rate(rate, name)
    if isinstance(source, np.ndarray):
        samples, got = samples_of(source, name), rate
    elif isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        if isinstance(source, (str, os.PathLike)):
            name = os.fspath(source) if name == "audio" else name
            source = read_file(source, name)
        data = bytes(source)
        samples, got = (read_wav(data, name, max_seconds) if data[:4] == b"RIFF"
                        else read_encoded(data, name, max_seconds))
    else:
        raise RequestError(f"{name}: audio is a file path, the file's bytes or a numpy array of samples, "
                           f"got {type(source).__name__}")
    if not len(samples):
        raise RequestError(f"{name}: holds no samples")
    check_length(len(samples), got, max_seconds, name)
    if not np.isfinite(samples).all():
        raise RequestError(f"{name}: samples must be finite")
    return resample(samples, got, rate) if got != rate else samples


def samples_of(array: np.ndarray, name: str) -> np.ndarray:
    """Mono samples given as an array, as f32: floats as they are, PCM integers scaled to [-1, 1]."""
    if array.ndim != 1:
        raise RequestError(f"{name}: samples must be mono [n], got shape {list(array.shape)}")
    kind = array.dtype
    if kind.kind == "f":
        return array.astype(np.float32)
    if kind.kind == "i" and kind.itemsize in (2, 4):
        return (array / 2.0 ** (8 * kind.itemsize - 1)).astype(np.float32)
    raise RequestError(f"{name}: samples are floats in [-1, 1] or int16/int32 PCM, got an array of {kind}")


def read_file(path, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RequestError(f"{name}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(f"{name}: larger than the {MAX_FILE_BYTES} bytes read")
    return data


def read_encoded(data: bytes, name: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """A compressed file's mono samples, decoded a block at a time: its rate and channels checked from its
    header first, and its length both from the header and as it is decoded (a header may lie)."""
    import soundfile
    blocks, decoded = [], 0
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate = check_rate(f.samplerate, name)
            if not 1 <= f.channels <= MAX_CHANNELS:
                raise RequestError(f"{name}: {f.channels} channels (at most {MAX_CHANNELS} are read)")
            check_length(f.frames, rate, max_seconds, name)
            while len(block := f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)):
                decoded += len(block)
                check_length(decoded, rate, max_seconds, name)
                blocks.append(block.mean(axis=1, dtype=np.float64).astype(np.float32))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise RequestError(f"{name}: not a readable audio file (wav, flac, ogg, mp3): {e}") from None
    return np.concatenate([np.zeros(0, np.float32), *blocks]), rate


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
