"""Tiny random encoders of every registered family against HF transformers in the same run:
hidden states and classification logits within 1e-4, over a padded batch of unequal lengths (f32
activations: the exact path; bf16 is checked on real weights in test_minilm)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.architectures.encoder import build_encoder, encoder_io
from soma_runtime.tasks import Runtime
from tests.fixtures.encoders import FAMILIES, build

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "this is a tiny test of encoders and some more words",
         "caf\u00e9 na\u00efve tokyo"]
TOL = 1e-4


def padded(model, texts):
    encodings = model.encoder.tokenize(texts)
    length = max(len(e.ids) for e in encodings)
    ids = torch.full((len(texts), length), model.loaded.config.pad_token_id)
    mask = torch.zeros((len(texts), length), dtype=torch.long)
    for row, e in enumerate(encodings):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        mask[row, : len(e.ids)] = 1
    return encodings, ids, mask


def close(got, want):
    want = want.detach().numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_transformers(family, tmp_path):
    reference = build(family, None, tmp_path)
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    encodings, ids, mask = padded(ours, TEXTS)
    hidden, _ = ours.encoder.run(encodings)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    for row, e in enumerate(encodings):                      # padding positions are nobody's output
        close(hidden[row, : len(e.ids)], want[row, : len(e.ids)])


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_classification_logits_match_transformers(family, tmp_path):
    reference = build(family, "sequence", tmp_path)
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    _, ids, mask = padded(ours, TEXTS)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    close(ours.encoder.classify(TEXTS, batch_size=3), want)
    label, _ = ours.classify(TEXTS[0])[0]
    assert label == reference.config.id2label[int(want[0].argmax())]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_classification_logits_match_transformers(family, tmp_path):
    reference = build(family, "token", tmp_path)
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    _, ids, mask = padded(ours, TEXTS[:1])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits[0]
    close(ours.encoder.token_logits(TEXTS[0])[0], want)
    labelled = ours.classify_tokens(TEXTS[0])
    assert [tok for tok, _ in labelled] == ours.tokenizer.hf.encode(TEXTS[0]).tokens
    assert [label for _, label in labelled] == [reference.config.id2label[int(i)] for i in want.argmax(-1)]


def test_zero_shot_scores_each_label_by_its_entailment_logit(tmp_path):
    reference = build("bert", "sequence", tmp_path)
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    labels = ["sports", "cooking", "travel"]
    scores = dict(ours.classify("the quick brown fox", labels))
    hypotheses = [f"This example is {x}." for x in labels]
    batch = ours.tokenizer.hf.encode_batch([("the quick brown fox", h) for h in hypotheses])
    ids = torch.tensor([e.ids for e in batch])              # equal lengths: every hypothesis is 4 words
    types = torch.tensor([e.type_ids for e in batch])
    with torch.no_grad():
        entail = reference(input_ids=ids, token_type_ids=types).logits[:, 0]
    want = torch.softmax(entail, 0).numpy()
    assert np.allclose([scores[x] for x in labels], want, atol=1e-5)


def test_modernbert_mean_pooling_head_matches_transformers(tmp_path):
    reference = build("modernbert", "sequence", tmp_path, pooling="mean")
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    _, ids, mask = padded(ours, TEXTS)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    close(ours.encoder.classify(TEXTS, batch_size=3), want)


def test_unsupported_encoder_and_mismatched_weights_are_clear_errors(tmp_path):
    import json

    from soma_runtime.errors import ModelLoadError, UnsupportedModelError
    build("bert", None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "deberta-v2", "conv_kernel_size": 3}))
    with pytest.raises(UnsupportedModelError, match="deberta-v2.*convolution.*not supported"):
        Runtime().load(str(tmp_path), progress=False, activations="f32")
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ModelLoadError, match="ffn_up.weight.*shape"):
        Runtime().load(str(tmp_path), progress=False, activations="f32")


@pytest.mark.parametrize("family, head, pooling", [*((f, h, "cls") for f in FAMILIES for h in (None, "sequence", "token")),
                                                   ("modernbert", "sequence", "mean")])
def test_an_encoder_graph_takes_exactly_the_inputs_its_io_declares(family, head, pooling, tmp_path):
    build(family, head, tmp_path, pooling=pooling)
    ours = Runtime().load(str(tmp_path), progress=False, activations="f32")
    graph = build_encoder(ours.loaded.config, ours.encoder.weights, head)
    assert tuple(graph.inputs) == encoder_io(ours.loaded.config, head).inputs
