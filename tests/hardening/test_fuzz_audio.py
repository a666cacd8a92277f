"""Fuzzing the audio readers: hundreds of WAV and FLAC files mutated from real ones in their headers (sizes,
rates, channels, bits, frame alignment, chunk sizes, cuts, flipped and inserted bytes), each decoded to
16 kHz in a worker whose address space is capped. Every one must decode or end in a RequestError, within
seconds: no other exception, no allocation past the cap, none hung. A WAV that decodes gives the samples
scipy reads from it (where scipy reads it), a FLAC those libsndfile reads in one go, and the 16 kHz result
is finite and as long as its duration says.

The worker is this module: `python -m tests.hardening.test_fuzz_audio CAP_BYTES PATH...` prints a JSON
line per file."""
from __future__ import annotations

import io
import json
import os
import random
import struct
import subprocess
import sys

import numpy as np

from tests.hardening.fuzz_worker import capped, report

MEMORY_CAP = 1 << 30           # address space a decode may add on top of the worker's own
HANG_SECONDS = 10              # a decode still running after this is reported as hung (the guard, not a speed target)
CASES = {"wav": 240, "flac": 100}
RATE = 16000
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTILE_32 = [0, 1, 2, 7, 999, 1009, 8000, 44100, 383_987, 384_001, 1_000_003, 2**16 - 1, 2**31, 2**32 - 1]
HOSTILE_16 = [0, 1, 2, 3, 5, 8, 16, 24, 32, 63, 64, 65, 0xFFFE, 0xFFFF]


def seed_wavs() -> list[bytes]:
    """Real WAVs: 16-bit mono, 8-bit stereo, 24-bit, float stereo, WAVE_FORMAT_EXTENSIBLE, a LIST chunk before
    the data, and a streamed one (sizes left at 0xFFFFFFFF)."""
    import soundfile

    from soma_runtime.audio.io import wav_bytes, wav_header
    t = np.arange(RATE // 4) / RATE
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    seeds = [wav_bytes((tone * 32767).astype(np.int16), RATE), wav_header(RATE) + (tone * 32767).astype("<i2").tobytes()]
    for rate, channels, subtype, fmt in ((22050, 2, "PCM_U8", "WAV"), (8000, 1, "PCM_24", "WAV"),
                                         (44100, 2, "FLOAT", "WAV"), (48000, 2, "PCM_16", "WAVEX")):
        buffer = io.BytesIO()
        soundfile.write(buffer, np.tile(tone[:, None], (1, channels)), rate, subtype=subtype, format=fmt)
        seeds.append(buffer.getvalue())
    plain = seeds[0]
    listed = plain[:36] + b"LIST" + struct.pack("<I", 10) + b"INFOabcdef" + plain[36:]
    return seeds + [listed[:4] + struct.pack("<I", len(listed) - 8) + listed[8:]]


def seed_flacs() -> list[bytes]:
    import soundfile
    t = np.arange(RATE // 2) / RATE
    tone = 0.5 * np.sin(2 * np.pi * 330 * t)
    seeds = []
    for rate, channels, subtype in ((RATE, 1, "PCM_16"), (44100, 2, "PCM_24"), (8000, 1, "PCM_S8")):
        buffer = io.BytesIO()
        soundfile.write(buffer, np.tile(tone[:, None], (1, channels)), rate, subtype=subtype, format="FLAC")
        seeds.append(buffer.getvalue())
    return seeds


def wav_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every size and format field of a WAV's chunks: RIFF size, each chunk's size,
    and the fmt chunk's tag, channels, rate, byte rate, frame size and bits."""
    fields, at = [(4, 4)], 12
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        fields.append((at + 4, 4))
        if chunk == b"fmt ":
            fields += [(at + 8, 2), (at + 10, 2), (at + 12, 4), (at + 16, 4), (at + 20, 2), (at + 22, 2)]
        if chunk == b"data" or size == 0xFFFFFFFF:
            break
        at += 8 + size + (size & 1)
    return fields


def flac_fields() -> list[tuple[int, int]]:
    """(bit offset, bit width) of STREAMINFO's fields after "fLaC" and the block header: block sizes, frame
    sizes, sample rate, channels - 1, bits - 1, total samples; and the block header's length."""
    base = 8 * 8
    return [(base, 16), (base + 16, 16), (base + 32, 24), (base + 56, 24), (base + 80, 20), (base + 100, 3), (base + 103, 5),
            (base + 108, 36), (8 * 5, 24)]


def set_bits(data: bytearray, offset: int, width: int, value: int) -> None:
    """Big-endian bit field `width` bits long at bit `offset` set to `value` (masked to its width)."""
    span = range(offset // 8, (offset + width + 7) // 8)
    word = int.from_bytes(bytes(data[i] for i in span), "big")
    shift = 8 * len(span) - (offset % 8) - width
    mask = ((1 << width) - 1) << shift
    word = (word & ~mask) | ((value << shift) & mask)
    data[span.start:span.stop] = word.to_bytes(len(span), "big")


def mutate(raw: bytes, rng: random.Random, flac: bool) -> bytes:
    """One or two of: a header field set to a hostile value, a cut, flipped bytes, bytes inserted or dropped
    (mostly in the header, where sizes and formats live)."""
    data = bytearray(raw)
    header = 42 if flac else 64
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.choice(["field", "field", "field", "truncate", "flip", "insert", "delete"])
        where = rng.randrange(min(header, len(data))) if rng.random() < 0.85 else rng.randrange(max(1, len(data)))
        if kind == "field" and flac:
            offset, width = rng.choice(flac_fields())
            value = rng.choice([0, 1, 2, 3, 7, 8000, 44100, 383_987, 1_000_003, 2**width - 1, rng.getrandbits(width)])
            set_bits(data, offset, width, value)
        elif kind == "field":
            offset, width = rng.choice(wav_fields(bytes(data)))
            values = HOSTILE_32 if width == 4 else HOSTILE_16
            data[offset:offset + width] = rng.choice(values).to_bytes(width + 4, "little")[:width]
        elif kind == "truncate":
            data = data[:where]
        elif kind == "flip":
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(min(header, len(data))) if data else 0
                if data:
                    data[at] ^= 1 << rng.randrange(8)
        elif kind == "insert":
            data[where:where] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            del data[where:where + rng.randint(1, 16)]
    return bytes(data)


def test_every_mutated_wav_and_flac_decodes_or_is_a_request_error(tmp_path):
    rng, paths = random.Random(20261206), []
    for kind, seeds in (("wav", seed_wavs()), ("flac", seed_flacs())):
        for i in range(CASES[kind]):
            path = tmp_path / f"case-{i}.{kind}"
            path.write_bytes(mutate(seeds[i % len(seeds)], rng, kind == "flac"))
            paths.append(str(path))
    assert len(paths) >= 200
    run = subprocess.run([sys.executable, "-m", "tests.hardening.test_fuzz_audio", str(MEMORY_CAP), *paths], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(results) == len(paths), run.stderr[-3000:]
    bad = [r for r in results if r["outcome"] not in ("decoded", "RequestError") or r["detail"] and r["outcome"] == "decoded"]
    assert not bad, bad[:10]
    slow = [r for r in results if r["seconds"] > HANG_SECONDS / 2]
    assert not slow, slow[:10]
    for kind in ("wav", "flac"):                                # the mutations reach both ends, for both formats
        assert {r["outcome"] for r in results if r["case"].endswith(kind)} == {"decoded", "RequestError"}


def wrong(data: bytes, out: np.ndarray) -> str | None:
    """What is wrong with a decode of `data` (`out`: its samples at 16 kHz), checked against scipy's reading
    of a WAV (where scipy reads it) or libsndfile's whole-file reading of a FLAC; None if nothing."""
    import scipy.io.wavfile
    import soundfile

    from soma_runtime.audio.io import read_encoded, read_wav
    if data[:4] == b"RIFF":
        samples, rate = read_wav(data)
        try:
            reference_rate, reference = scipy.io.wavfile.read(io.BytesIO(data))
        except Exception:                                       # noqa: BLE001  (scipy refuses more than we do)
            reference = None
        if reference is not None:
            scale = {np.uint8: 128, np.int16: 2**15, np.int32: 2**31}.get(reference.dtype.type, 1)
            values = reference.astype(np.float64) - (128 if reference.dtype == np.uint8 else 0)
            values = (values / scale).reshape(len(reference), -1).mean(axis=1)
            if reference_rate != rate or len(values) != len(samples) or not np.allclose(samples, values, atol=1e-6):
                return f"differs from scipy's reading ({rate} vs {reference_rate} Hz, {len(samples)} vs {len(values)} samples)"
    else:
        samples, rate = read_encoded(data, "flac", 3600)
        whole, whole_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        if whole_rate != rate or not np.array_equal(samples, whole.mean(axis=1, dtype=np.float64).astype(np.float32)):
            return "differs from libsndfile's whole-file reading"
    if not np.isfinite(out).all() or len(out) != -(-len(samples) * RATE // rate):
        return f"{len(out)} samples at 16 kHz from {len(samples)} at {rate} Hz"
    return None


def main(cap: int, paths: list[str]) -> None:
    import scipy.io.wavfile  # noqa: F401  (imported before the cap: the reference's own code is not what is capped)
    import soundfile  # noqa: F401

    from soma_runtime.audio.io import load_audio
    from soma_runtime.errors import RequestError
    capped(cap)

    def decode(path: str) -> tuple[str, str]:
        with open(path, "rb") as f:
            data = f.read()
        return "decoded", wrong(data, load_audio(data, RATE, name=path)) or ""
    for path in paths:
        report(path, decode, (RequestError,), HANG_SECONDS)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
