"""Whisper's runner: the encoder over 30 s windows of features, each window's cross-attention K/V written
once into the cross pool, and decoder steps over any number of hypotheses (beams of many windows) as
rows of one graph run, each row's self-attention over its own paged K/V and its cross-attention over its
window's; a step of few rows is replayed where the backend captures steps (CUDA graphs), its context
padded as the decoder's is. Knows graphs and caches, nothing of search or timestamps.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from soma_runtime.architectures.contract import CrossStep, DecoderStep
from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig, build_cross, build_encoder, build_step, caches_of
from soma_runtime.engine.graph import GraphRunner
from soma_runtime.engine.kv import KVPool, Sequence
from soma_runtime.errors import RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.program import Program

MAX_BATCH = 8                 # windows decoding at once (one per recording in a batch)
SELF_TOKENS = 448 * 48        # self-attention K/V: 5 beams of whisper's longest text in each of MAX_BATCH windows,
                              # or 32 beams in one (pages map as they fill)
CROSS_WINDOWS = 16            # windows whose cross K/V can be held at once


@dataclass
class Window:
    """One encoded 30 s window: its cross K/V's place in the cross pool."""
    seq: Sequence
    frames: int


@dataclass
class Hypothesis:
    """A decoding row: its self-attention cache and the window it reads."""
    seq: Sequence
    window: Window


class WhisperRunner:
    def __init__(self, cfg: WhisperConfig, weights: Weights, backend: Backend, activations: str = "f32"):
        """`activations` "q8": the decoder's projections take q8_0 weights and quantized inputs (CTranslate2's
        int8 runs so); the encoder stays f32, where 1500-row products run faster on BLAS than on q8 kernels."""
        if activations not in ("f32", "q8"):
            raise RequestError(f"whisper runs with f32 or q8 activations, got {activations!r}")
        self.cfg, self.backend, self.activations = cfg, backend, activations
        self.io = caches_of(cfg)
        self.encoder = GraphRunner(build_encoder(cfg, weights), backend)
        self.cross_program = Program(build_cross(cfg, weights, self.io, activations), backend)
        self.step_program = Program(build_step(cfg, weights, self.io, activations), backend, free=("T",))
        self.pool = KVPool(self.io.cache, SELF_TOKENS, lambda _: backend)
        self.cross = KVPool(self.io.cross, cfg.max_source_positions * CROSS_WINDOWS, lambda _: backend)
        self.lock = threading.Lock()

    def pool_sizes(self) -> dict[str, int]:
        """The sizes the pools bind in both graphs: pages of self and of cross K/V, tokens a page."""
        k = self.pool.k[0]
        return {"P": k.shape[0], "CP": self.cross.k[0].shape[0], "BLK": k.shape[1]}

    def encode(self, features: np.ndarray) -> np.ndarray:
        """[B, mels, 3000] features -> [B, 1500, D] encoder states."""
        return self.encoder.run({"features": np.ascontiguousarray(features, np.float32)})[self.encoder.graph.outputs[0]]

    def open_windows(self, encoded: np.ndarray) -> list[Window]:
        """Each window's cross-attention K/V, written once into the cross pool."""
        frames = encoded.shape[1]
        windows = []
        with self.lock:
            for row in encoded:
                seq = Sequence()
                self.cross.reserve(seq, frames)
                seq.length = frames
                slots = self.cross.slots(seq, 0, frames)
                pages = self.cross_program.run({**self.pool_sizes(), "F": frames},
                                               self.io.feed_cross(np.ascontiguousarray(row), slots, self.cross.pages))
                self.cross.keep(pages)
                windows.append(Window(seq, frames))
        return windows

    def close(self, windows: list[Window], hypotheses: list[Hypothesis] = ()) -> None:
        for h in hypotheses:
            self.pool.release(h.seq)
        for w in windows:
            self.cross.release(w.seq)

    def fork(self, h: Hypothesis) -> Hypothesis:
        return Hypothesis(self.pool.fork(h.seq), h.window)

    def release(self, h: Hypothesis) -> None:
        self.pool.release(h.seq)

    def forward(self, batch: list[tuple[Hypothesis, list[int]]], wanted: list[int] | None = None) -> np.ndarray:
        """Run each hypothesis's new tokens, appending their K/V; the logits [rows, vocab] of each one's
        last token, or of the rows `wanted` (indices into the step's rows)."""
        for h, tokens in batch:
            self.pool.reserve(h.seq, h.seq.length + len(tokens))
        ends = np.cumsum([len(tokens) for _, tokens in batch])
        rows = int(ends[-1])
        attention = self.pool.attention([(h.seq, len(tokens)) for h, tokens in batch], [0],
                                        lambda slots: self.step_program.captures.context(rows, slots))
        logit_rows = np.asarray(wanted if wanted is not None else ends - 1, np.int64)
        windows = list({id(h.window): h.window for h, _ in batch}.values())
        segment = {id(w): i * w.frames for i, w in enumerate(windows)}
        cross_slots = np.concatenate([self.cross.slots(w.seq, 0, w.frames) for w in windows])
        cross_spans = np.concatenate([np.tile([segment[id(h.window)], segment[id(h.window)] + h.window.frames], (len(tokens), 1))
                                      for h, tokens in batch]).astype(np.int64)
        ids = np.asarray([t for _, tokens in batch for t in tokens], np.int64)
        step = CrossStep(DecoderStep(ids, attention, logit_rows, None, self.pool.pages), cross_slots, cross_spans,
                         self.cross.pages)
        with self.lock:
            bindings = {**self.pool_sizes(), "S": rows, "R": len(logit_rows), "C": len(cross_slots)}
            logits, *pages = self.step_program.step(bindings, self.io.feed(step), self.io.shared(), rows,
                                                    len(attention.ctx_slots))
            self.pool.keep(pages)
        for h, tokens in batch:
            h.seq.length += len(tokens)
        return np.asarray(self.backend.fetch(logits), np.float32)
