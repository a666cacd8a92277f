"""The encode_image task on tiny random ViT and DeiT models against transformers in the same run: logits and the
[CLS] embedding within 1e-4 (of the largest value) on the same pixel values, and end to end on scikit-image's photos
(our preprocessing and graph against transformers' processor and model), the same top-k labels, a batch equal to one
image at a time; bad images, arguments and models are RequestErrors, a directory the graph cannot serve a load error."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.tasks import Runtime
from tests.fixtures.vit import LABELS, build, photos, processor

TOL = 1e-4
KINDS = ("ViTForImageClassification", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher")


def close(got, want):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def loaded(tmp_path, kind="ViTForImageClassification", **overrides):
    reference = build(tmp_path, kind, **overrides)
    return reference, Runtime("cpu").load(str(tmp_path), progress=False)


def base(reference):
    return reference.deit if hasattr(reference, "deit") else getattr(reference, "vit", reference)


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    return list(photos().values())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_on_the_same_pixel_values(kind, tmp_path):
    reference, ours = loaded(tmp_path, kind)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(pixel_values=pixels).logits
    assert ours.task == "encode_image"
    close(ours.forward(pixels.numpy())["logits"], want)


@pytest.mark.parametrize("kind", KINDS)
def test_photos_end_to_end_give_transformers_logits_and_top_labels(kind, tmp_path, images):
    reference, ours = loaded(tmp_path, kind)
    inputs = processor(tmp_path)(images=images, return_tensors="pt")["pixel_values"]
    np.testing.assert_array_equal(ours.pixel_values(images), inputs.numpy())     # the processor, to the value
    with torch.no_grad():
        want = reference(pixel_values=inputs).logits
    close(ours.forward(ours.pixel_values(images))["logits"], want)
    found = ours.classify_image(images, top_k=3)
    probabilities = torch.softmax(want, dim=-1)
    for labelled, row in zip(found, probabilities):
        scores, ids = row.topk(3)
        assert [label for label, _ in labelled] == [LABELS[int(i)] for i in ids]
        np.testing.assert_allclose([score for _, score in labelled], scores.numpy(), atol=1e-5)


@pytest.mark.parametrize("kind", ["ViTModel", *KINDS])
def test_embed_image_is_the_cls_state_after_the_final_layernorm(kind, tmp_path, images):
    reference, ours = loaded(tmp_path, kind)
    inputs = processor(tmp_path)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = base(reference)(pixel_values=inputs).last_hidden_state[:, 0]
    close(ours.embed_image(images), want)
    close(ours.embed_image(images[1]), want[1])                # one image: its [D] vector


def test_a_batch_equals_one_image_at_a_time(tmp_path, images):
    _, ours = loaded(tmp_path)
    batch = ours.embed_image(images)
    alone = np.stack([ours.embed_image(image) for image in images])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-6 * np.abs(alone).max())
    assert [ours.classify_image(image, top_k=2) for image in images] == \
        [[(label, pytest.approx(score, abs=1e-6)) for label, score in found] for found in ours.classify_image(images, top_k=2)]


def test_more_images_than_a_run_takes_go_in_several_runs(tmp_path, images):
    _, ours = loaded(tmp_path)
    many = (images * 5)[:17]                                    # MAX_BATCH 16, then 1
    np.testing.assert_allclose(ours.embed_image(many), np.concatenate([ours.embed_image(images)] * 5)[:17], atol=1e-5)


def test_bad_images_and_top_k_are_request_errors(tmp_path, images):
    _, ours = loaded(tmp_path)
    with pytest.raises(RequestError, match="not an image"):
        ours.classify_image(b"this is text, not a picture")
    with pytest.raises(RequestError, match=r"images\[1\]"):
        ours.embed_image([images[0], np.zeros((4, 4, 5), np.uint8)])
    for top_k in (0, len(LABELS) + 1, True, 2.0):
        with pytest.raises(RequestError, match="top_k"):
            ours.classify_image(images[0], top_k=top_k)
    with pytest.raises(RequestError, match="1 to 64 images"):
        ours.embed_image([])


def test_a_model_without_a_classifier_embeds_but_does_not_classify(tmp_path, images):
    _, ours = loaded(tmp_path, "ViTModel")
    with pytest.raises(RequestError, match="no classifier"):
        ours.classify_image(images[0])


def test_a_model_of_another_task_refuses_image_methods():
    g = GraphBuilder()
    graph = Runtime("cpu").load(g.output(g.sqrt(g.input("x", ("N",), "f32"))))
    for method in (graph.classify_image, graph.embed_image):
        with pytest.raises(RequestError, match="encode_image"):
            method(np.zeros((8, 8, 3), np.uint8))


def test_a_processor_of_another_size_is_refused_at_load(tmp_path):
    build(tmp_path)
    config = tmp_path / "preprocessor_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "size": {"height": 48, "width": 48}}))
    with pytest.raises(UnsupportedModelError, match=r"\[48, 48\].*\[32, 32\].*interpolat"):
        Runtime("cpu").load(str(tmp_path), progress=False)
    config.unlink()
    with pytest.raises(ModelLoadError, match="preprocessor_config.json: missing"):
        Runtime("cpu").load(str(tmp_path), progress=False)


def test_position_embeddings_of_another_image_size_are_refused(tmp_path):
    build(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "image_size": 48}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "preprocessor_config.json").read_text()), "size": {"height": 48, "width": 48}}))
    with pytest.raises(ModelLoadError, match="pos_embd.*image_size"):
        Runtime("cpu").load(str(tmp_path), progress=False)


@pytest.mark.parametrize("field, value, needle", [("patch_size", 64, "holds no patch"),
                                                  ("num_attention_heads", 5, "not a multiple of 5 heads"),
                                                  ("hidden_act", "relu", "hidden_act 'relu' is not supported"),
                                                  ("image_size", [32], "image_size must be")])
def test_a_config_the_template_cannot_build_is_a_load_error_naming_the_field(tmp_path, field, value, needle):
    build(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), field: value}))
    with pytest.raises(ModelLoadError, match=needle):
        Runtime("cpu").load(str(tmp_path), progress=False)
