"""Batched encoder inference: tokenize, sort by length, pad per batch, run, pool, restore order.

Texts are sorted by token count so each batch pads to its own longest member (rounded up to a
bucket of at most 1/16 of it, so plans are reused; each head's graph a Program keeping the most recent); the key mask
keeps padding out of attention and pooling. A batch of sizes run before is replayed where the backend
captures runs (CUDA graphs): a short text's run is launches more than arithmetic.
Pooling follows the model's (architectures/pooling.py).
"""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from soma_runtime.architectures.encoder import EncoderConfig, build_encoder, encoder_io, matmul_weights_in
from soma_runtime.architectures.pooling import Pooling
from soma_runtime.architectures.weights import Weights
from soma_runtime.errors import ModelLoadError, RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.plan import Plan
from soma_runtime.ir.program import Program
from soma_runtime.text.tokenizer import Tokenizer, check_text

log = logging.getLogger("soma_runtime.encode")
PLANS_KEPT = 16          # per head: each holds an arena sized for its batch


def padded_length(tokens: int) -> int:
    """`tokens` rounded up to a multiple of 4, or of 1/16 of the next power of two past 64: at most
    ~6% padding, and a few dozen distinct plan shapes over all lengths."""
    bucket = max(4, (1 << max(tokens - 1, 1).bit_length()) // 16)
    return -(-tokens // bucket) * bucket


class Encoder:
    def __init__(self, cfg: EncoderConfig, weights: Weights, tokenizer: Tokenizer, pooling: Pooling,
                 max_tokens: int | None, backend: Backend, precision: str = "f32"):
        """`precision` "bf16" stores the projections in bf16 and rounds their inputs to it (f32
        accumulation): the matrix units' format, within 1e-4 cosine of f32 embeddings."""
        self.cfg, self.tokenizer, self.pooling, self.backend, self.precision = cfg, tokenizer, pooling, backend, precision
        self.weights = matmul_weights_in(weights, precision)
        self.max_tokens = min(max_tokens or cfg.max_tokens, cfg.max_tokens)
        self.programs: dict[str | None, Program] = {}
        self._truncating = None

    @property
    def fusions(self) -> Counter:
        """What the fuse pass did to each head's graph."""
        return sum((Counter(p.fusions) for p in self.programs.values()), Counter())

    def plan(self, head: str | None, batch: int, length: int) -> Plan:
        if head not in self.programs:
            try:
                graph = build_encoder(self.cfg, self.weights, head, self.precision)
            except ModelLoadError as e:            # a head's weights missing: a model that cannot do what was asked
                if head is None:
                    raise
                raise RequestError(f"the model has no {head}-classification head ({e})") from None
            self.programs[head] = Program(graph, self.backend, kept=PLANS_KEPT)
        return self.programs[head].plan({"B": batch, "S": length})

    def tokenize(self, texts, pairs=None, truncate: bool = True) -> list:
        """Encodings of the texts (with their special tokens), cut to the model's maximum length."""
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise RequestError("texts must be a list of strings")
        if not isinstance(truncate, bool):
            raise RequestError(f"truncate must be true or false, got {type(truncate).__name__}")
        for i, text in enumerate([*texts, *(pairs or [])]):
            check_text(text, f"text {i}")
        if not texts:
            raise RequestError("no texts given")
        if pairs is not None and len(pairs) != len(texts):
            raise RequestError(f"{len(pairs)} second segments for {len(texts)} texts")
        inputs = list(zip(texts, pairs)) if pairs is not None else list(texts)
        encodings = self.tokenizer.hf.encode_batch(inputs, add_special_tokens=True)
        long = [i for i, e in enumerate(encodings) if len(e.ids) > self.max_tokens]
        if long and not truncate:
            raise RequestError(f"text {long[0]} has {len(encodings[long[0]].ids)} tokens; "
                               f"the model takes at most {self.max_tokens}")
        if long:
            log.warning("%d text(s) longer than %d tokens were truncated", len(long), self.max_tokens)
            cut = self.truncating().encode_batch([inputs[i] for i in long], add_special_tokens=True)
            for i, encoding in zip(long, cut):
                encodings[i] = encoding
        return encodings

    def truncating(self):
        """A copy of the tokenizer that cuts at the model's length and keeps the special tokens, as
        sentence-transformers does (the shared one never truncates)."""
        if self._truncating is None:
            from tokenizers import Tokenizer as HFTokenizer
            self._truncating = HFTokenizer.from_str(self.tokenizer.hf.to_str())
            self._truncating.enable_truncation(self.max_tokens)
        return self._truncating

    def run(self, encodings: list, head: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One padded batch through the graph: (output, mask [B, S])."""
        lengths = [len(e.ids) for e in encodings]
        length = min(padded_length(max(lengths)), max(max(lengths), self.max_tokens))   # never past the positions
        ids = np.full((len(encodings), length), self.cfg.pad_token_id, np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros(ids.shape, np.float32)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = e.ids
            types[row, : len(e.ids)] = e.type_ids
            mask[row, : len(e.ids)] = 1
        keys = mask[:, None, None, :] > 0
        inputs = {"ids": ids, "positions": self.cfg.positions(mask), "types": types,
                  "mask": np.where(keys, np.float32(0), np.float32(-np.inf))}
        self.plan(head, len(encodings), length)
        io = encoder_io(self.cfg, head)
        if io.local_mask:                             # local layers also drop keys farther than the window
            distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
            near = distance <= max(self.cfg.layer_windows)
            # a padding query far from every token still sees itself: no all -inf row, no NaN to spread
            visible = (keys & near[None, None]) | (distance == 0)[None, None]
            inputs["mask_local"] = np.where(visible, np.float32(0), np.float32(-np.inf))
        if io.token_mask:
            inputs["token_mask"] = mask[..., None]
        if io.relative:                               # DeBERTa: the same columns for every row and head
            shape = (len(encodings), self.cfg.num_heads, length, length)
            for term, columns in zip(("c2p", "p2c"), self.cfg.relative_columns(length)):
                if term in io.relative:
                    inputs[f"rel_{term}"] = np.broadcast_to(columns, shape)
        (out,) = self.programs[head].replay({"B": len(encodings), "S": length}, inputs)
        return np.asarray(self.backend.fetch(out), np.float32), mask

    def batches(self, encodings: list, batch_size: int):
        """(indices, encodings) per batch, longest first, so each batch pads to similar lengths."""
        if type(batch_size) is not int or batch_size < 1:
            raise RequestError(f"batch_size must be an integer >= 1, got {batch_size!r:.40}")
        order = sorted(range(len(encodings)), key=lambda i: -len(encodings[i].ids))
        for start in range(0, len(order), batch_size):
            chosen = order[start: start + batch_size]
            yield chosen, [encodings[i] for i in chosen]

    def embed(self, texts: list[str], batch_size: int = 32, truncate: bool = True) -> np.ndarray:
        encodings = self.tokenize(texts, truncate=truncate)
        out = np.empty((len(encodings), self.cfg.hidden_size), np.float32)
        for chosen, batch in self.batches(encodings, batch_size):
            hidden, mask = self.run(batch)
            out[chosen] = self.pooling(hidden, mask)
        return out

    def classify(self, texts: list[str], pairs: list[str] | None = None, batch_size: int = 32,
                 truncate: bool = True) -> np.ndarray:
        """Sequence-classification logits [len(texts), labels] (each text with its pair, if given)."""
        encodings = self.tokenize(texts, pairs, truncate)
        out = None
        for chosen, batch in self.batches(encodings, batch_size):
            logits, _ = self.run(batch, "sequence")
            out = np.empty((len(encodings), logits.shape[1]), np.float32) if out is None else out
            out[chosen] = logits
        return out

    def token_logits(self, text: str, truncate: bool = True) -> tuple[np.ndarray, object]:
        """Token-classification logits [tokens, labels] of one text, and its encoding (tokens, offsets)."""
        (encoding,) = self.tokenize([text], truncate=truncate)
        logits, _ = self.run([encoding], "token")
        return logits[0, : len(encoding.ids)], encoding
