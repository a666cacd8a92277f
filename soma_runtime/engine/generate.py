"""The generation loop: prefill the prompt, then decode token by token over the paged KV cache.

`Engine.forward` runs one batch: any number of sequences, each with its new tokens, as rows of one
graph run (a prompt, a decode step, or a continuous batch of both). Every sequence's context sits in
its own segment of the attention inputs, `BUCKET`-aligned; each row reads the span of it that it
sees (causal, within a sliding window), never the other rows', so a sequence gets the same numbers
alone or batched. Plans are cached per (rows, logit rows); the
context length is a free dim. A `Stream` is one request's decoding state: sampler, stop strings,
incremental detokenizer; text stops are held back until they can no longer match.
"""
from __future__ import annotations

import functools
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.decoder import Weights, build_decoder, check_shapes, fuse_projections, sample_width, spans_name
from soma_runtime.backends import load_backend
from soma_runtime.engine.kv import KVPool, Sequence
from soma_runtime.engine.sampling import Sampler, SamplingParams, greedy_rows, log_softmax
from soma_runtime.engine.stops import StopMatcher, check_stops
from soma_runtime.errors import PromptTooLong, RequestError
from soma_runtime.ir.passes import plan_memory
from soma_runtime.ir.plan import Plan
from soma_runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

BUCKET = 128
DEFAULT_CONTEXT = 4096    # tokens, or the model's own context where shorter
GRAPH_ROWS = 32            # steps of up to this many rows replay as one device graph where the backend has them
GRAPH_CONTEXT = 512        # ... with the context padded to a multiple of this (one graph per size)
MAX_LOGPROBS = 20          # alternatives reported per token, as OpenAI allows
ACTIVATION_SHARE = 0.5     # of free device memory, what one step's activations may take ...
ACTIVATION_SLACK = 2       # ... each row counted at twice its planned peak (the caching allocator's rounding)
KV_TOKENS = 32768          # default pool size: room for many sequences (pages are mapped as they fill)


@dataclass
class Metrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens whose K/V came from the prefix cache
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
    """One step of a stream: the token id, the text it completes (may be empty), and the end if any.
    With logprobs asked for: the token's log-probability and the most likely alternatives."""
    id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None        # alternatives to report per token (0: only the chosen one)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Stream:
    """One request's decoding state. `pending` holds the tokens not yet in the cache: the prompt's
    uncached tail, then each sampled token until the next step runs it."""

    def __init__(self, engine: Engine, req: GenerationRequest):
        engine.check(req)
        self.engine, self.req, self.seq = engine, req, Sequence()
        self.sampler = Sampler(req.sampling)
        self.detok = IncrementalDetokenizer(engine.tokenizer, req.prompt_ids[-4:])
        self.stops = StopMatcher(req.stop)
        self.history, self.generated = list(req.prompt_ids), []
        self.metrics = Metrics(prompt_tokens=len(req.prompt_ids))
        self.pending: list[int] | None = None          # set by start()
        self.finish_reason: str | None = None

    def start(self) -> None:
        """Take what the prefix cache holds of the prompt. Done just before the first prompt chunk runs,
        so a prompt admitted beside another with the same prefix finds it cached one step later."""
        self.metrics.cached_tokens = self.engine.pool.attach_prefix(self.seq, self.req.prompt_ids)
        self.pending = list(self.req.prompt_ids[self.metrics.cached_tokens:])

    @property
    def prefilling(self) -> bool:
        return not self.generated

    @property
    def budget_pages(self) -> int:
        """The pages this stream may still take before it ends."""
        total = min(len(self.req.prompt_ids) + self.req.max_tokens, self.engine.n_ctx)
        return max(0, self.engine.pool.pages_for(total) - len(self.seq.pages))

    def take(self, limit: int) -> list[int]:
        """The next tokens to run (at most `limit`)."""
        tokens, self.pending = self.pending[:limit], self.pending[limit:]
        return tokens

    @property
    def has_next_step(self) -> bool:
        """Whether a step may follow the one in flight, should its token not end the stream."""
        return len(self.generated) + 1 < self.req.max_tokens and len(self.history) + 1 < self.engine.n_ctx

    @property
    def on_model(self) -> bool:
        """Whether the graph's `sample` op makes this stream's choices (no logits needed on the host)."""
        return self.sampler.params.fits(sample_width(self.engine.cfg)) and self.req.logprobs is None

    def draws(self) -> np.ndarray | None:
        """The `sampling` rows of this stream's next step (one row), where the model samples for it."""
        return self.sampler.draw()[None] if self.on_model else None

    def accept(self, choice: np.ndarray) -> Token:
        """Sample the next token from `choice`, the logits after the last pending token, or take it as
        the token itself (0-d: chosen where the model runs, from `draws()`); say if the stream ends."""
        if self.prefilling:
            self.engine.pool.publish(self.seq, self.req.prompt_ids)
        token = int(choice) if np.ndim(choice) == 0 else self.sampler(choice, self.history, self.generated)
        self.history.append(token)
        self.generated.append(token)
        self.metrics.generated_tokens += 1
        out = Token(token, "")
        if self.req.logprobs is not None:
            logp = log_softmax(choice)
            top = np.argsort(-logp, kind="stable")[: self.req.logprobs]
            out.logprob, out.top_logprobs = float(logp[token]), [(int(i), float(logp[i])) for i in top]
        if token in self.engine.stop_ids:
            out.text, out.finish_reason = self.stops.flush(), "stop"
        else:
            out.text, stopped = self.stops.push(self.detok.push(token))
            if stopped:
                out.finish_reason = "stop"
            elif len(self.generated) >= self.req.max_tokens or len(self.history) >= self.engine.n_ctx:
                out.text, out.finish_reason = out.text + self.stops.flush(), "length"
            else:
                self.pending = [token]
        self.finish_reason = self.metrics.finish_reason = out.finish_reason
        return out


@dataclass
class Step:
    """A queued forward: its choices where the model runs (the next step's tokens, for streams sampled
    there) and the wait for its results (as `Engine.forward` returns them)."""
    choices: object
    wait: Callable[[], list[np.ndarray]]


class Engine:
    def __init__(self, cfg: DecoderConfig, weights: Weights, tokenizer: Tokenizer, backend: str = "cpu",
                 n_ctx: int | None = None, kv_dtype: str = "f32", activations: str = "f32", kv_tokens: int | None = None):
        self.cfg, self.tokenizer, self.backend = cfg, tokenizer, backend
        self.n_ctx = min(DEFAULT_CONTEXT if n_ctx is None else n_ctx, cfg.max_position)
        if self.n_ctx < 2:
            raise RequestError(f"a context of {self.n_ctx} tokens leaves no room for a prompt and a token")
        check_shapes(cfg, weights)
        self.weights, self.kv_dtype, self.activations = fuse_projections(cfg, weights), kv_dtype, activations
        self.graph = build_decoder(cfg, self.weights, kv_dtype=kv_dtype, activations=activations)
        module = load_backend(backend)
        self.fetch = getattr(module, "fetch", None)       # logits come back to the host for sampling
        self.fetch_soon = getattr(module, "fetch_soon", None)   # ... or start back, while the next step is queued
        self.graphed = getattr(module, "graphed", None)   # decode steps captured and replayed as one launch
        self.free_bytes = getattr(module, "free_bytes", None)   # device memory a step's activations may take
        self.graphs: dict[tuple[int, int, int], object] = {}
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max(self.n_ctx, kv_tokens or KV_TOKENS),
                           dtype=kv_dtype, zeros=getattr(module, "zeros", None))
        self.plans: dict[tuple[int, int], Plan] = {}
        self.placed: dict[str, object] = {}       # the weights on the device, shared by every plan
        self.row_bytes: int | None = None         # a row's activations, at their peak in a step (measured once)
        self.windows = sorted({cfg.window(i) for i in range(cfg.num_layers)})
        self.stop_ids = set(cfg.eos_token_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
        self.metrics = Metrics()
        self.lock = threading.Lock()          # one forward at a time: plans own their arenas

    def layer_weights(self) -> list:
        """The per-layer weight tensors, which prefill multiplies by every prompt row (the head sees one)."""
        return [w for name, w in self.weights.tensors.items() if name.startswith("blk.")]

    def plan(self, rows: int, logit_rows: int = 1) -> Plan:
        key = (rows, logit_rows)
        if key not in self.plans:
            k = self.pool.k[0]
            self.plans[key] = Plan(self.graph, self.backend, {"S": rows, "R": logit_rows, "P": k.shape[0], "BLK": k.shape[1]},
                                   free=("T",), placed=self.placed)
        return self.plans[key]

    def step_rows(self, wanted: int) -> int:
        """At most `wanted` rows for one step: fewer where the device's free memory cannot hold their
        activations (prompts are then run in chunks), never fewer than one."""
        free = self.free_bytes() if self.free_bytes else None
        if free is None:
            return wanted
        if self.row_bytes is None:
            plan = self.plan(1)
            self.row_bytes = plan_memory(plan.graph, plan.metas).arena_bytes * ACTIVATION_SLACK
        return max(1, min(wanted, int(free * ACTIVATION_SHARE // self.row_bytes)))

    def forward(self, batch: list[tuple[Sequence, list[int], int]], sampling: np.ndarray | None = None) -> list[np.ndarray]:
        """Run each sequence's new tokens, appending them to its cache. Item (seq, tokens, want) asks for
        the logits after its last `want` tokens; the result has one [want, vocab] array per item. With
        `sampling` (a `Sampler.draw()` row per wanted row, in order), each item gets its rows' tokens
        [want] instead, chosen where the model runs: the logits never cross to the host."""
        return self.launch(batch, sampling).wait()

    def launch(self, batch: list[tuple[Sequence, list[int], int]], sampling: np.ndarray | None = None, ids=None) -> Step:
        """`forward`, queued: the step runs on while the caller goes on, until it waits for the results.
        `ids` may give the tokens as a device value (an earlier step's choices, not yet read back); the
        batch's token lists then only count them."""
        for seq, tokens, _ in batch:
            self.pool.reserve(seq, seq.length + len(tokens))
        rows = sum(len(tokens) for _, tokens, _ in batch)
        buckets = [-(-(seq.length + len(tokens)) // BUCKET) * BUCKET for seq, tokens, _ in batch]
        graph = self.graphed is not None and rows <= GRAPH_ROWS
        context = -(-sum(buckets) // GRAPH_CONTEXT) * GRAPH_CONTEXT if graph else sum(buckets)
        ctx = np.zeros(context, np.int64)                     # padding points at scratch page 0
        spans = {w: np.zeros((rows, 2), np.int64) for w in self.windows}
        positions, new_slots, logit_rows, row, offset = [], [], [], 0, 0
        for (seq, tokens, want), bucket in zip(batch, buckets):
            start, stop = seq.length, seq.length + len(tokens)
            slots = self.pool.slots(seq, 0, stop)             # the context read, ending in the slots written
            ctx[offset: offset + stop] = slots
            new_slots.append(slots[start:])
            query = np.arange(start, stop)
            for w, span in spans.items():                    # keys up to the query's own, the last w of them
                span[row: row + len(tokens), 0] = offset + (np.maximum(query - w + 1, 0) if w else 0)
                span[row: row + len(tokens), 1] = offset + query + 1
            positions.append(query)
            logit_rows.extend(range(row + len(tokens) - want, row + len(tokens)))
            row, offset = row + len(tokens), offset + bucket
        positions = np.concatenate(positions).astype(np.int64)
        if ids is None:
            ids = np.asarray([t for _, tokens, _ in batch for t in tokens], np.int64)
        inputs = {"ids": ids, "positions": positions,
                  "slots": np.concatenate(new_slots),
                  "ctx_slots": ctx, "logit_rows": np.asarray(logit_rows, np.int64),
                  "sampling": greedy_rows(len(logit_rows)) if sampling is None else np.asarray(sampling, np.float32),
                  **{spans_name(w): span for w, span in spans.items()}}
        cache = {f"{kv}_pages.{i}": getattr(self.pool, kv)[i] for i in range(self.cfg.num_layers) for kv in "kv"}
        inputs.update(cache)
        plan = self.plan(rows, len(logit_rows))
        with self.lock:
            if graph:
                key = (rows, len(logit_rows), context)
                if key not in self.graphs:
                    self.graphs[key] = self.graphed(plan, inputs, set(cache))    # the cache is updated in place
                plan = self.graphs[key]
            logits, choices, *pages = plan.run(inputs)
            for i in range(self.cfg.num_layers):             # backends that update out of place return new pages
                self.pool.k[i], self.pool.v[i] = pages[2 * i], pages[2 * i + 1]
        for seq, tokens, _ in batch:
            seq.length += len(tokens)
        result = logits if sampling is None else choices
        read = self.fetch_soon(result) if self.fetch_soon else functools.partial(self.fetch or np.asarray, result)
        return Step(choices, lambda: np.split(read(), np.cumsum([want for _, _, want in batch])[:-1]))

    def prefill_all_but_last_step(self, stream: Stream) -> None:
        """Run a prompt too long for one step's activations in chunks, up to what its last step takes."""
        rows = self.step_rows(len(stream.pending))
        while rows < len(stream.pending):
            self.launch([(stream.seq, stream.take(rows), 0)]).wait()
            rows = self.step_rows(len(stream.pending))

    def launch_next(self, streams: list[Stream], step: Step) -> Step:
        """The step after `step` for `streams` (all sampled on the model), queued before `step`'s tokens
        are read: each stream's row runs the token `step` chooses for it, fed on the device."""
        return self.launch([(s.seq, [0], 1) for s in streams], np.concatenate([s.draws() for s in streams]), ids=step.choices)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits at every position of `tokens` ([len, vocab]), as one prefill."""
        self.check_prompt(tokens)
        seq = Sequence()
        try:
            return self.forward([(seq, tokens, len(tokens))])[0]
        finally:
            self.pool.release(seq)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int = 1) -> None:
        """RequestError for a prompt that is empty, not token ids of this vocabulary, or over the context."""
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise RequestError("the prompt must be a non-empty list of token ids")
        if not all(type(t) is int for t in prompt_ids):
            bad = next(t for t in prompt_ids if type(t) is not int)
            raise RequestError(f"prompt token ids must be integers, got {type(bad).__name__} {bad!r}")
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < self.cfg.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) >= self.n_ctx:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.n_ctx}")
        if type(max_tokens) is not int or max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")

    def check(self, req: GenerationRequest) -> None:
        """RequestError naming the first field of `req` this engine cannot run."""
        self.check_prompt(req.prompt_ids, req.max_tokens)
        check_stops(req.stop)
        if req.logprobs is not None and (type(req.logprobs) is not int or not 0 <= req.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
        req.sampling.validate()

    def generate(self, req: GenerationRequest) -> Iterator[Token]:
        """One request on its own: the whole uncached prompt in one step, then a step per token. Where
        results come back asynchronously, a stream sampled there queues each step before reading the last
        one's token (fed to it on the device), so the host's work overlaps the model's."""
        stream = Stream(self, req)
        self.metrics = m = stream.metrics
        stream.start()
        try:
            t = time.perf_counter()
            self.prefill_all_but_last_step(stream)
            step = self.launch([(stream.seq, stream.take(len(stream.pending)), 1)], stream.draws())
            while True:
                prefill = stream.prefilling
                ahead = None
                if self.fetch_soon and stream.on_model and stream.has_next_step:
                    ahead = self.launch_next([stream], step)
                token = stream.accept(step.wait()[0][-1])
                if prefill:
                    m.prefill_ms, t = (time.perf_counter() - t) * 1e3, time.perf_counter()
                else:
                    m.decode_ms = (time.perf_counter() - t) * 1e3
                yield token
                if token.finish_reason:
                    return
                step = ahead or self.launch([(stream.seq, stream.pending, 1)], stream.draws())
                stream.take(1)
        finally:
            self.pool.release(stream.seq)
            m.peak_rss_mb = peak_rss_mb()
