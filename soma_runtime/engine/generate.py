"""The generation loop: prefill the prompt, then decode token by token over the paged KV cache.

Plans are cached per (new tokens, context bucket): a decode plan is reused for `BUCKET` tokens of
growing context, the padded context slots masked out. Text streams through an incremental
detokenizer; stop strings are held back until they can no longer match.
"""
from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.decoder import Weights, build_decoder, check_shapes, fuse_projections, mask_name
from soma_runtime.engine.kv import KVPool, Sequence
from soma_runtime.engine.sampling import Sampler, SamplingParams
from soma_runtime.errors import RequestError
from soma_runtime.ir.plan import Plan
from soma_runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

BUCKET = 128


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    peak_rss_mb: float = 0.0
    finish_reason: str | None = None

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1      # the first token comes from the prefill
        return steps / (self.decode_ms / 1e3) if self.decode_ms and steps > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass
class Token:
    """One step of a stream: the token id, the text it completes (may be empty), and the end if any."""
    id: int
    text: str
    finish_reason: str | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Engine:
    def __init__(self, cfg: DecoderConfig, weights: Weights, tokenizer: Tokenizer, backend: str = "cpu",
                 n_ctx: int | None = None, kv_dtype: str = "f32", activations: str = "f32"):
        self.cfg, self.tokenizer, self.backend = cfg, tokenizer, backend
        self.n_ctx = min(n_ctx or 4096, cfg.max_position)
        check_shapes(cfg, weights)
        self.weights, self.kv_dtype, self.activations = fuse_projections(cfg, weights), kv_dtype, activations
        self.graph = build_decoder(cfg, self.weights, kv_dtype=kv_dtype, activations=activations)
        self.full_graph = None                # all positions' logits, built when first asked for
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.n_ctx, dtype=kv_dtype)
        self.plans: dict[tuple[int, int], Plan] = {}
        self.windows = sorted({cfg.window(i) for i in range(cfg.num_layers)})
        self.stop_ids = set(cfg.eos_token_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
        self.metrics = Metrics()

    def layer_weights(self) -> list:
        """The per-layer weight tensors, which prefill multiplies by every prompt row (the head sees one)."""
        return [w for name, w in self.weights.tensors.items() if name.startswith("blk.")]

    def plan(self, new: int, context: int, all_positions: bool = False) -> Plan:
        key = (new, context, all_positions)
        if key not in self.plans:
            if all_positions and self.full_graph is None:
                self.full_graph = build_decoder(self.cfg, self.weights, last_only=False, kv_dtype=self.kv_dtype,
                                                activations=self.activations)
            k = self.pool.k[0]
            self.plans[key] = Plan(self.full_graph if all_positions else self.graph, self.backend,
                                   {"S": new, "T": context, "P": k.shape[0], "BLK": k.shape[1]})
        return self.plans[key]

    def forward(self, seq: Sequence, tokens: list[int], all_positions: bool = False) -> np.ndarray:
        """Append tokens to the sequence's cache; return the logits after the last one (or after each)."""
        start, stop = seq.length, seq.length + len(tokens)
        self.pool.reserve(seq, stop)
        bucket = -(-stop // BUCKET) * BUCKET
        ctx = np.zeros(bucket, np.int64)                     # padding points at scratch page 0
        ctx[:stop] = self.pool.slots(seq, 0, stop)
        inputs = {"ids": np.asarray(tokens, np.int64), "positions": np.arange(start, stop, dtype=np.int64),
                  "slots": self.pool.slots(seq, start, stop), "ctx_slots": ctx}
        query = np.arange(start, stop)[:, None]
        key = np.arange(bucket)[None, :]
        for w in self.windows:
            visible = (key <= query) & ((query - key < w) if w else True)
            inputs[mask_name(w)] = np.where(visible, np.float32(0), np.float32(-np.inf))[None, None]
        for i in range(self.cfg.num_layers):
            inputs[f"k_pages.{i}"], inputs[f"v_pages.{i}"] = self.pool.k[i], self.pool.v[i]
        logits, *pages = self.plan(len(tokens), bucket, all_positions).run(inputs)
        for i in range(self.cfg.num_layers):                 # backends that update out of place return new pages
            self.pool.k[i], self.pool.v[i] = pages[2 * i], pages[2 * i + 1]
        seq.length = stop
        return logits if all_positions else logits[-1]

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits at every position of `tokens` ([len, vocab]), as one prefill."""
        self.check_prompt(tokens, 1)
        seq = Sequence()
        try:
            return self.forward(seq, tokens, all_positions=True)
        finally:
            self.pool.release(seq)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.n_ctx:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.n_ctx}")
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")

    def generate(self, req: GenerationRequest) -> Iterator[Token]:
        self.check_prompt(req.prompt_ids, req.max_tokens)
        sampler = Sampler(req.sampling)
        seq = Sequence()
        m = self.metrics = Metrics(prompt_tokens=len(req.prompt_ids))
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids[-4:])
        stops = StopMatcher(req.stop)
        history = list(req.prompt_ids)
        try:
            t = time.perf_counter()
            logits = self.forward(seq, req.prompt_ids)
            m.prefill_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            while True:
                token = sampler(logits, history)
                history.append(token)
                m.generated_tokens += 1
                if token in self.stop_ids:
                    m.finish_reason = "stop"
                    yield Token(token, stops.flush(), "stop")
                    return
                text, stopped = stops.push(detok.push(token))
                if stopped:
                    m.finish_reason = "stop"
                    yield Token(token, text, "stop")
                    return
                if m.generated_tokens >= req.max_tokens or seq.length + 1 >= self.n_ctx:
                    m.finish_reason = "length"
                    yield Token(token, text + stops.flush(), "length")
                    return
                yield Token(token, text)
                logits = self.forward(seq, [token])
                m.decode_ms = (time.perf_counter() - t) * 1e3
        finally:
            self.pool.release(seq)
            m.peak_rss_mb = peak_rss_mb()


class StopMatcher:
    """Holds back text that could be the start of a stop string; cuts at the first full match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        for s in self.stops:
            at = self.pending.find(s)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
