"""The encode task: EncoderModel, an encoder (BERT family) for embeddings and classification (zero-shot
through an NLI model's hypotheses)."""
from __future__ import annotations

import reprlib

import numpy as np

from soma_runtime import loaders
from soma_runtime.engine.encode import Encoder
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.tasks.base import Model
from soma_runtime.text.tokenizer import check_text


class EncoderModel(Model):
    """An encoder (BERT family): embeddings, and classification with the model's own or given labels."""

    task = "encode"

    def __init__(self, model_id: str, loaded: loaders.LoadedModel, backend: Backend, encoder: Encoder):
        super().__init__(model_id, loaded, backend)
        self.encoder, self.tokenizer = encoder, loaded.tokenizer

    @classmethod
    def open(cls, model_id: str, loaded: loaders.LoadedModel, backend: Backend, precision: Precision, n_ctx: int | None,
             bar, autotune: bool) -> EncoderModel:
        return cls(model_id, loaded, backend, Encoder(loaded.config, loaded.weights, loaded.tokenizer, loaded.pooling,
                                                      loaded.max_tokens, backend, precision.activations))

    @property
    def normalizes(self) -> bool:
        """Whether the model's embeddings are L2-normalized (a cut to fewer dimensions is renormalized)."""
        return self.loaded.pooling.normalize

    def embed(self, texts: str | list[str], batch_size: int = 32, truncate: bool = True) -> np.ndarray:
        """One vector per text ([D] for a single string, [N, D] for a list), pooled and normalized as
        the model's sentence-transformers config says. Over-long texts are cut with a warning, or
        rejected when `truncate=False`."""
        if isinstance(texts, str):
            return self.encoder.embed([texts], batch_size, truncate)[0]
        return self.encoder.embed(list(texts) if isinstance(texts, tuple) else texts, batch_size, truncate)

    def classify(self, text: str, labels: list[str] | None = None, template: str = "This example is {}.",
                 truncate: bool = True) -> list[tuple[str, float]]:
        """(label, probability) pairs, most likely first. Without `labels`: the model's own classes.
        With `labels`: zero-shot through an NLI model, each label's hypothesis scored by its
        entailment logit, softmax across labels (as transformers' zero-shot pipeline)."""
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}")
        own = self.loaded.config.labels
        if labels is None:
            logits = self.encoder.classify([text], truncate=truncate)[0]
            names = [own.get(i, f"LABEL_{i}") for i in range(len(logits))]
        else:
            if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(label, str) for label in labels):
                raise RequestError("labels must be a non-empty list of strings")
            hypotheses = hypotheses_of(template, labels)
            entail = next((i for i, name in own.items() if name.lower().startswith("entail")), None)
            if entail is None:
                raise RequestError(f"model {self.id} is not an NLI model (no 'entailment' label); classify without labels")
            logits = self.encoder.classify([text] * len(labels), hypotheses, truncate=truncate)[:, entail]
            names = list(labels)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        return sorted(zip(names, probs.tolist()), key=lambda pair: -pair[1])

    def classify_tokens(self, text: str) -> list[tuple[str, str]]:
        """(token, label) for every token, for token-classification models (NER)."""
        logits, encoding = self.encoder.token_logits(text)
        own = self.loaded.config.labels
        return [(tok, own.get(int(i), f"LABEL_{int(i)}")) for tok, i in zip(encoding.tokens, logits.argmax(-1))]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.hf.encode(check_text(text), add_special_tokens=True).ids

    def weight_bytes(self) -> int:
        return sum(int(w.nbytes) for w in self.encoder.weights.tensors.values())     # as run: bf16 copies

    def info(self) -> dict:
        cfg = self.loaded.config
        return {**super().info(), "model_type": cfg.model_type, "activations": self.encoder.precision,
                "parameters": sum(int(np.prod(w.shape)) for w in self.loaded.weights.tensors.values()),
                "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
                "max_tokens": self.encoder.max_tokens, "pooling": self.loaded.pooling.mode, "normalize": self.normalizes,
                "labels": [cfg.labels[i] for i in sorted(cfg.labels)], "fusions": dict(self.encoder.fusions)}


def hypotheses_of(template: str, labels: list[str]) -> list[str]:
    """Zero-shot hypotheses: `template` with each label in its "{}", as transformers' pipeline checks it."""
    try:
        hypotheses = [template.format(label) for label in labels] if isinstance(template, str) else None
    except (IndexError, KeyError, ValueError):
        hypotheses = None
    if hypotheses is None or hypotheses[0] == template:
        raise RequestError(f'template must be text with a "{{}}" where the label goes, got {reprlib.repr(template)}')
    return hypotheses
