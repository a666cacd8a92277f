"""Whisper's runner (cached decoder: paged self K/V, cross K/V written once per window) on a tiny random
WhisperForConditionalGeneration saved as a HF directory with whisper's real vocabulary: step logits
against transformers within 1e-4 and the same greedy tokens, beams forked mid-page keeping their own
caches; the same model converted by CTranslate2's own converter (f32, f16, int8) loads to the same
weights, and transcribes random audio to the same tokens as faster-whisper on that directory."""
from __future__ import annotations

import ctranslate2
import numpy as np
import pytest
import torch
from faster_whisper import WhisperModel

from soma_runtime.engine.kv import Sequence
from soma_runtime.engine.transcribe.runner import Hypothesis
from soma_runtime.errors import RequestError
from soma_runtime.loaders import load
from soma_runtime.tasks import Runtime
from tests.fixtures.whisper import SOT, build_whisper


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whisper")
    return build_whisper(str(directory)), str(directory)


@pytest.fixture(scope="module")
def ours(whisper_dir):
    return Runtime(backend="cpu").load(whisper_dir[1], progress=False)


@pytest.fixture(scope="module")
def features():
    return np.random.default_rng(0).normal(0, 1, (1, 80, 3000)).astype(np.float32)


def test_cached_steps_match_transformers(whisper_dir, ours, features):
    model, _ = whisper_dir
    runner = ours.runner
    [window] = runner.open_windows(runner.encode(features))
    h = Hypothesis(Sequence(), window)
    ids = [SOT, 400, 1200, 7, 31000, 220, 18, 50]
    try:
        steps = [runner.forward([(h, ids[:3])], [0, 1, 2])] + [runner.forward([(h, [t])]) for t in ids[3:]]
    finally:
        runner.close([window], [h])
    with torch.no_grad():
        theirs = model(input_features=torch.from_numpy(features), decoder_input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.concatenate(steps), theirs, atol=1e-4, rtol=0)


def greedy_theirs(model, features, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        encoded = model.model.encoder(torch.from_numpy(features)).last_hidden_state
        for _ in range(n):
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_greedy_tokens_and_forked_beams_match_transformers(whisper_dir, ours, features):
    """Greedy decoding from a prompt, then a fork of its 21 cached tokens (mid-page: block 16) continued on
    two different tokens: each branch's next logits are transformers' for its own prefix."""
    model, _ = whisper_dir
    runner = ours.runner
    prompt = [SOT, 50362 + 1]
    [window] = runner.open_windows(runner.encode(features))
    h = Hypothesis(Sequence(), window)
    tokens, feed = [], prompt
    try:
        for _ in range(20):
            token = int(runner.forward([(h, feed)])[0].argmax())
            tokens.append(token)
            feed = [token]
        assert tokens == greedy_theirs(model, features, prompt, 20)
        fork = runner.fork(h)
        a, b = runner.forward([(h, [11]), (fork, [2000])])
    finally:
        runner.close([window], [h] + ([fork] if "fork" in locals() else []))
    with torch.no_grad():
        for branch, last in ((a, 11), (b, 2000)):
            ids = torch.tensor([prompt + tokens[:-1] + [last]])
            theirs = model(input_features=torch.from_numpy(features), decoder_input_ids=ids).logits[0, -1].numpy()
            np.testing.assert_allclose(branch, theirs, atol=1e-4, rtol=0)
    assert runner.pool.in_use == 0 and runner.cross.in_use == 0


@pytest.mark.parametrize("quantization,atol", [(None, 0.0), ("float16", 1e-3), ("int8", 0.02)])
def test_ctranslate2_conversions_load_to_the_same_weights(whisper_dir, quantization, atol, tmp_path):
    _, directory = whisper_dir
    out = str(tmp_path / "ct2")
    ctranslate2.converters.TransformersConverter(directory, copy_files=["tokenizer.json"]).convert(out, quantization=quantization)
    ours, theirs = load(out), load(directory)
    assert ours.task == "transcribe" and ours.config == theirs.config
    assert set(ours.weights.tensors) == set(theirs.weights.tensors)
    for name, value in theirs.weights.tensors.items():
        np.testing.assert_allclose(ours.weights[name], value, atol=atol * max(1.0, float(np.abs(value).max())), rtol=0,
                                   err_msg=name)


def test_random_audio_transcribes_to_faster_whispers_tokens(whisper_dir, tmp_path):
    _, directory = whisper_dir
    out = str(tmp_path / "ct2")
    ctranslate2.converters.TransformersConverter(directory, copy_files=["tokenizer.json"]).convert(out)
    audio = np.random.default_rng(1).normal(0, 0.1, 16000 * 4).astype(np.float32)
    ours = Runtime(backend="cpu").load(out, progress=False)
    theirs = WhisperModel(out, device="cpu", compute_type="float32", cpu_threads=2)
    for beam in (1, 3):
        mine = ours.transcribe(audio, beam_size=beam, temperature=0.0, no_speech_threshold=None, vad=False)
        segments, _ = theirs.transcribe(audio, beam_size=beam, temperature=0.0, no_speech_threshold=None, language="en")
        assert [s.tokens for s in mine.segments] == [s.tokens for s in segments]
    clips = [np.random.default_rng(2 + i).normal(0, 0.1, 16000 * seconds).astype(np.float32)
             for i, seconds in enumerate((7, 2, 4))]
    batched = ours.transcribe(clips, beam_size=3, temperature=0.0, no_speech_threshold=None, vad=False, batch_size=2)
    for transcript, clip in zip(batched, clips):
        segments, _ = theirs.transcribe(clip, beam_size=3, temperature=0.0, no_speech_threshold=None, language="en")
        assert [s.tokens for s in transcript.segments] == [s.tokens for s in segments]
    assert ours.runner.pool.in_use == 0 and ours.runner.cross.in_use == 0


def test_a_failing_recording_in_a_batch_releases_every_cache(ours, features):
    """One recording's bad options fail the batch with a clear error; the others' windows and beams, already
    decoding, are closed and their pages given back."""
    from soma_runtime.engine.transcribe.segments import Options
    good, bad = Options(beam_size=2, temperatures=(0.0,)), Options(max_new_tokens=1000)
    jobs = [(features[0], good, "en"), (features[0], good, "en"), (features[0], bad, "en")]
    with pytest.raises(RequestError, match="exceed whisper's 448 tokens"):
        list(ours.transcriber.many(jobs, width=3))
    assert ours.runner.pool.in_use == 0 and ours.runner.cross.in_use == 0
