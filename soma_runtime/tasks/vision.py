"""The encode_image task: ImageEncoderModel, a vision transformer (ViT, DeiT) from a HF directory: images in,
each one's embedding ([CLS] after the final layernorm) or its labels by the model's own classifier. Images are
preprocessed by the directory's preprocessor_config.json (image/preprocess.ImageProcessor) and run as batches."""
from __future__ import annotations

import reprlib

import numpy as np

from soma_runtime import loaders
from soma_runtime.architectures.encoder import matmul_weights_in
from soma_runtime.architectures.vit import OUTPUTS, build_vit
from soma_runtime.engine.graph import GraphRunner
from soma_runtime.errors import RequestError
from soma_runtime.image.io import load_image
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.tasks.base import Model

MAX_IMAGES = 64                   # images one call (one request) may take
MAX_BATCH = 16                    # images one run of the graph takes


class ImageEncoderModel(Model):
    """A vision transformer: `embed_image(images)` gives their embeddings, `classify_image(images, top_k)` their
    most likely labels (for a checkpoint with a classifier)."""

    task = "encode_image"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, runner: GraphRunner, precision: str):
        super().__init__(model_id, loaded, backend)
        self.runner, self.processor, self.precision = runner, loaded.processor, precision

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> ImageEncoderModel:
        weights = matmul_weights_in(loaded.weights, precision.activations)
        return cls(model_id, loaded, backend, GraphRunner(build_vit(loaded.config, weights, precision.activations), backend),
                   precision.activations)

    @property
    def labels(self) -> dict[int, str]:
        """The classifier's labels by class id ({} for a model without a classifier)."""
        if "classifier.weight" not in self.loaded.weights:
            return {}
        own = self.loaded.config.labels
        return {i: own.get(i, f"LABEL_{i}") for i in range(self.loaded.weights["classifier.weight"].shape[0])}

    def pixel_values(self, images) -> np.ndarray:
        """float32 [N, C, H, W] of a list of images (each anything image.io.load_image takes), as the model's
        transformers processor gives them."""
        if not isinstance(images, (list, tuple)) or not 1 <= len(images) <= MAX_IMAGES:
            raise RequestError(f"give 1 to {MAX_IMAGES} images, got {len(images) if isinstance(images, (list, tuple)) else 0}")
        return self.processor.batch([load_image(im, name=f"images[{i}]").pixels for i, im in enumerate(images)])

    def forward(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's outputs ("embedding" [N, D], and "logits" [N, labels] with a classifier) for preprocessed
        pixels [N, C, H, W], run MAX_BATCH images at a time."""
        runs = [self.runner.run({"pixels": pixels[start:start + MAX_BATCH]}) for start in range(0, len(pixels), MAX_BATCH)]
        names = self.runner.graph.outputs
        return {ours: np.concatenate([np.asarray(run[name], np.float32) for run in runs])
                for ours, name in zip(OUTPUTS, names)}

    def embed_image(self, images) -> np.ndarray:
        """The embedding of an image ([D]) or of a list of images ([N, D], one batch), float32: the [CLS] token's
        hidden state after the final layernorm (transformers' last_hidden_state[:, 0])."""
        many = isinstance(images, (list, tuple))
        out = self.forward(self.pixel_values(images if many else [images]))["embedding"]
        return out if many else out[0]

    def classify_image(self, images, top_k: int = 5) -> list[tuple[str, float]] | list[list[tuple[str, float]]]:
        """The `top_k` most likely of the model's own labels, (label, probability) by softmax over its logits, best
        first: a list of them for one image, a list of such lists for a list of images (run as one batch)."""
        labels = self.labels
        if not labels:
            raise RequestError(f"model {self.id} has no classifier (a ViTModel checkpoint); use embed_image")
        if type(top_k) is not int or not 1 <= top_k <= len(labels):
            raise RequestError(f"top_k must be an integer in [1, {len(labels)}], got {reprlib.repr(top_k)}")
        many = isinstance(images, (list, tuple))
        logits = self.forward(self.pixel_values(images if many else [images]))["logits"]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        best = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
        found = [[(labels[int(i)], float(row[i])) for i in order] for row, order in zip(probs, best)]
        return found if many else found[0]

    def info(self) -> dict:
        cfg = self.loaded.config
        return {**super().info(), "model_type": cfg.model_type, "activations": self.precision,
                "image_size": list(cfg.image_size), "patch_size": cfg.patch_size, "layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "labels": [self.labels[i] for i in sorted(self.labels)],
                "fusions": dict(self.runner.fusions)}
