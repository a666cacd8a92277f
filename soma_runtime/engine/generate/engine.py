"""Generation's runner: a decoder over its paged KV cache, and each request's decoding state.

`Engine.forward` runs one batch: any number of sequences, each with its new tokens, as rows of one
graph run (a prompt, a decode step, or a continuous batch of both), their attention inputs laid out
by the KV pool. Plans are cached per (rows, logit rows); the context length is a free dim. A `Stream`
is one request's decoding state: sampler, stop strings, incremental detokenizer (text stops are held
back until they can no longer match). The scheduling loop (batching.py) drives both, for the library
and the server alike.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.contract import DecoderStep, PagedKV
from soma_runtime.architectures.decoder import cache_of, sample_width
from soma_runtime.architectures.weights import Weights
from soma_runtime.engine.generate import calibration
from soma_runtime.engine.generate.lora import LoraTable, adapted_modules
from soma_runtime.engine.generate.sampling import Sampler, SamplingParams, greedy_rows
from soma_runtime.engine.generate.speculate import DraftLength
from soma_runtime.engine.generate.stages import Stage, fusions, split, stage_bytes
from soma_runtime.engine.generate.stops import StopMatcher, check_stops
from soma_runtime.engine.grammar import Constraint, Grammars
from soma_runtime.engine.kv import BASE, BLOCK, ROLLBACK, KVPool, Sequence, Variant, pool_slots
from soma_runtime.errors import ParallelError, PromptTooLong, RequestError
from soma_runtime.ir import collective
from soma_runtime.ir.backend import Backend, Precision
from soma_runtime.ir.passes import plan_memory
from soma_runtime.ir.plan import Plan
from soma_runtime.ir.sampling import log_softmax
from soma_runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

BUCKET = 128
DEFAULT_CONTEXT = 4096    # tokens, or the model's own context where shorter
MAX_LOGPROBS = 20          # alternatives reported per token, as OpenAI allows
ACTIVATION_SHARE = 0.5     # of free device memory, what one step's activations may take ...
ACTIVATION_SLACK = 2       # ... each row counted at twice its planned peak (the caching allocator's rounding)
KV_TOKENS = 32768          # default pool size: room for many sequences (pages are mapped as they fill)
WARM_ROWS = 40             # the prompt `warm` runs: past the few-row products' 32 rows, into the prefill's kernels
WARM_SAMPLING = np.array([[0.8, 40, 0.95, 0.05, 0.5]], np.float32)   # a sampled row (temperature, top-k/p, min-p, u)


@dataclass
class Metrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens whose K/V came from the prefix cache
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    peak_rss_mb: float = 0.0
    finish_reason: str | None = None
    mask_ms_mean: float = 0.0      # a grammar's token mask, per constrained token
    mask_ms_p99: float = 0.0
    target_steps: int = 0          # target forwards that gave this stream tokens after its first
    drafted_tokens: int = 0        # speculative decoding: tokens proposed ...
    accepted_tokens: int = 0       # ... and kept by the target

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1      # the first token comes from the prefill
        return steps / (self.decode_ms / 1e3) if self.decode_ms and steps > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each target forward gave after the first (1 without speculation)."""
        return (self.generated_tokens - 1) / self.target_steps if self.target_steps else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step}


@dataclass
class Token:
    """One step of a stream: the token id, the text it completes (may be empty), and the end if any.
    With logprobs asked for: the token's log-probability and the most likely alternatives. In a tool
    loop, a reply's calls come after it as tokens of their own (id -1, no text)."""
    id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    tool_call: object | None = None       # in a tool loop: the call a reply made (tools.formats.ToolCall)

    def is_tool_call(self) -> bool:
        return self.tool_call is not None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None        # alternatives to report per token (0: only the chosen one)
    ignore_eos: bool = False           # run to max_tokens past end-of-sequence tokens (benchmarks)
    constraint: Constraint | None = None   # what the generated text must match
    lora: str | None = None            # the adapter it runs under (a loaded one's name) ...
    lora_scale: float = 1.0            # ... at this strength (times the adapter's alpha)


class Stream:
    """One request's decoding state. `pending` holds the tokens not yet in the cache: the prompt's
    uncached tail, then each sampled token until the next step runs it."""

    def __init__(self, engine: Engine, req: GenerationRequest):
        engine.check(req)
        self.engine, self.req, self.seq = engine, req, Sequence(variant=engine.variant(req.lora, req.lora_scale))
        self.sampler = Sampler(req.sampling)
        self.detok = IncrementalDetokenizer(engine.tokenizer, req.prompt_ids[-4:])
        self.stops = StopMatcher(req.stop)
        self.guide = engine.grammars.guide(req.constraint) if req.constraint is not None else None
        self.history, self.generated = list(req.prompt_ids), []
        self.metrics = Metrics(prompt_tokens=len(req.prompt_ids))
        self.pending: list[int] | None = None          # set by start()
        self.finish_reason: str | None = None
        self.draft_length: DraftLength | None = None    # where the scheduler speculates for this stream
        self.drafts: list[int] = []                     # this step's draft tokens, after the pending one

    def start(self) -> None:
        """Take what the prefix cache holds of the prompt. Done just before the first prompt chunk runs,
        so a prompt admitted beside another with the same prefix finds it cached one step later."""
        self.metrics.cached_tokens = self.engine.pool.attach_prefix(self.seq, self.req.prompt_ids)
        self.pending = list(self.req.prompt_ids[self.metrics.cached_tokens:])
        self.started = time.perf_counter()

    @property
    def prefilling(self) -> bool:
        return not self.generated

    @property
    def budget_pages(self) -> int:
        """The pages this stream may still take before it ends."""
        total = self.engine.held_tokens(len(self.req.prompt_ids) + self.req.max_tokens)
        return max(0, self.engine.pool.pages_for(total) - len(self.seq.pages))

    def take(self, limit: int) -> list[int]:
        """The next tokens to run (at most `limit`)."""
        tokens, self.pending = self.pending[:limit], self.pending[limit:]
        return tokens

    @property
    def has_next_step(self) -> bool:
        """Whether a step may follow the one in flight, should its token not end the stream."""
        return len(self.generated) + 1 < self.req.max_tokens and len(self.history) + 1 < self.engine.max_length

    @property
    def on_model(self) -> bool:
        """Whether the graph's `sample` op makes this stream's choices (no logits needed on the host): drafts
        are checked there too where the choice is greedy (sampled drafts need the target's probabilities)."""
        return (self.sampler.params.fits(sample_width(self.engine.cfg)) and self.req.logprobs is None and self.guide is None
                and (not self.drafts or self.sampler.params.temperature == 0))

    @property
    def speculates(self) -> bool:
        """Whether drafts may be proposed for this stream (a grammar's stream is checked a token at a time)."""
        return self.draft_length is not None and self.guide is None

    def draft_room(self) -> int:
        """Draft tokens this step may take: what the draft length allows, within max_tokens and the context."""
        room = min(self.req.max_tokens - len(self.generated), self.engine.max_length - len(self.history)) - 1
        return max(0, min(self.draft_length.next(), room)) if self.speculates and not self.prefilling else 0

    def draws(self) -> np.ndarray | None:
        """The `sampling` rows of this stream's next step (one, or a greedy one per row a draft adds), where
        the model samples for it."""
        return np.repeat(self.sampler.draw()[None], 1 + len(self.drafts), axis=0) if self.on_model else None

    def clock(self) -> None:
        """The first token ends the prefill's time; each later one adds to the decode's."""
        m, now = self.metrics, time.perf_counter()
        m.generated_tokens += 1
        if m.generated_tokens == 1:
            m.prefill_ms, self.first_at = (now - self.started) * 1e3, now
        else:
            m.decode_ms = (now - self.first_at) * 1e3

    def advance(self, rows: list) -> list[Token]:
        """The tokens a step gives this stream from its wanted rows (logits, or tokens chosen on the model)."""
        if not self.prefilling:
            self.metrics.target_steps += 1
        return self.verify(rows) if self.drafts else [self.accept(rows[-1])]

    def verify(self, rows: list[np.ndarray]) -> list[Token]:
        """The tokens of a speculative step: `rows`, the logits after the pending token and after each draft,
        accepted in turn while the target keeps the drafts (Sampler.verify); the K/V of the rejected drafts
        are dropped (their slots are written again by the next step)."""
        out, drafts = [], self.drafts
        for i, row in enumerate(rows):
            out.append(self.accept(row, drafts[i] if i < len(drafts) else None))
            if out[-1].finish_reason or i == len(drafts) or out[-1].id != drafts[i]:
                break
        self.seq.length -= len(rows) - len(out)
        accepted = next((i for i, (t, d) in enumerate(zip(out, drafts)) if t.id != d), min(len(out), len(drafts)))
        self.metrics.drafted_tokens += len(drafts)
        self.metrics.accepted_tokens += accepted
        self.draft_length.update(len(drafts), accepted)
        self.drafts = []
        return out

    def accept(self, choice: np.ndarray, draft: int | None = None) -> Token:
        """Sample the next token from `choice`, the logits after the last pending token, or take it as
        the token itself (0-d: chosen where the model runs, from `draws()`); say if the stream ends.
        With a `draft`, the choice is the target's verdict on that drafted token (Sampler.verify)."""
        if self.prefilling:
            self.engine.pool.publish(self.seq, self.req.prompt_ids)
        allowed = self.guide.allowed() if self.guide is not None else None
        dead = allowed is not None and not len(allowed)        # a grammar with no way on: the text so far is all
        if dead:
            token = min(self.engine.stop_ids, default=int(np.argmax(choice)))
        elif np.ndim(choice) == 0:
            token = int(choice)
        elif draft is not None:
            token = self.sampler.verify(choice, draft, self.history, self.generated)
        else:
            token = self.sampler(choice, self.history, self.generated, allowed)
        self.history.append(token)
        self.generated.append(token)
        self.clock()
        out = Token(token, "")
        if self.req.logprobs is not None:
            logp = log_softmax(choice)
            top = np.argsort(-logp, kind="stable")[: self.req.logprobs]
            out.logprob, out.top_logprobs = float(logp[token]), [(int(i), float(logp[i])) for i in top]
        if self.guide is not None and not dead:          # the token's text matters only while a marker is awaited
            self.guide.advance(token, "" if self.guide.active else self.engine.tokenizer.decode([token], skip_special=False))
        if token in self.engine.stop_ids and not self.req.ignore_eos:
            out.text, out.finish_reason = self.stops.flush(), "stop"
        else:
            out.text, stopped = self.stops.push(self.detok.push(token))
            if stopped or dead or (self.guide is not None and self.guide.done):
                out.text += self.stops.flush() if not stopped else ""
                out.finish_reason = "stop"
            elif len(self.generated) >= self.req.max_tokens or len(self.history) >= self.engine.max_length:
                out.text, out.finish_reason = out.text + self.stops.flush(), "length"
            else:
                self.pending = [token]
        self.finish_reason = self.metrics.finish_reason = out.finish_reason
        if out.finish_reason and self.guide is not None and self.guide.mask_seconds:
            ms = np.asarray(self.guide.mask_seconds) * 1e3
            self.metrics.mask_ms_mean, self.metrics.mask_ms_p99 = float(ms.mean()), float(np.percentile(ms, 99))
        return out


@dataclass
class Launched:
    """A queued forward: its choices where the model runs (the next step's tokens, for streams sampled
    there) and the wait for its results (as `Engine.forward` returns them)."""
    choices: object
    wait: Callable[[], list[np.ndarray]]


class Engine:
    """A decoder's graph, fused once, its plans per step shape, its KV pool: runs batches of rows. With
    `device_layers`, a model on a device runs only its first layers there, the rest on the host (stages.py)."""

    def __init__(self, cfg: DecoderConfig, weights: Weights, tokenizer: Tokenizer, backend: Backend,
                 n_ctx: int | None = None, kv_dtype: str = "f32", activations: str = "f32", kv_tokens: int | None = None,
                 device_layers: int | None = None, key_centers: tuple | None = None, shard=None,
                 lora: LoraTable | None = None):
        self.n_ctx = min(DEFAULT_CONTEXT if n_ctx is None else n_ctx, cfg.max_position)
        self.cfg, self.tokenizer, self.backend = cfg.at_context(self.n_ctx), tokenizer, backend
        self.sliding = False          # sequences may run past the context, within every layer's window (slide)
        if self.n_ctx < 2:
            raise RequestError(f"a context of {self.n_ctx} tokens leaves no room for a prompt and a token")
        self.weights, self.kv_dtype, self.activations, self.kv_tokens = weights, kv_dtype, activations, kv_tokens
        self.shard, self.leading = shard, False     # a tensor-parallel rank's (parallel.py); rank 0 leads the others
        if shard is not None and device_layers is not None:
            raise ParallelError("a model split over tensor-parallel ranks runs whole on each rank's device (no gpu_layers)")
        self.placement = split(self.cfg, backend, device_layers)
        self.key_centers = key_centers
        self.lora = lora                  # adapters at run time, once a first is wanted (enable_lora), or its target's
        self.kv_quality: dict[str, calibration.KindQuality] | None = None    # the ladder's kinds, measured on first need
        self.cache = self.centered(cache_of(self.cfg, kv_dtype))
        self.stages, self.pool = self.build_stages(), self.new_pool()
        self.row_bytes: int | None = None         # a row's activations, at their peak in a step (measured once)
        self.stop_ids = set(cfg.eos_token_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
        self.grammars = Grammars(tokenizer.hf.to_str(), cfg.vocab_size, sorted(self.stop_ids))
        self.metrics = Metrics()
        self.choices = None                   # the last step's tokens chosen on the model (a device value there)
        self.lock = threading.Lock()          # one forward at a time: plans own their arenas

    def recompress(self, kv_dtype: str) -> None:
        """The KV cache re-encoded in another kind (a spec, quant/kv.py), between steps: every sequence's
        pages and the prefix cache's converted, so running requests go on where they were in a cache
        that takes less memory (the first rung of the server's degradation ladder)."""
        self.whole("a KV cache recompressed")
        cache = self.centered(cache_of(self.cfg, kv_dtype))
        with self.lock:
            self.pool.transcode(self.cache, cache)
            self.kv_dtype, self.cache = kv_dtype, cache
            self.stages, self.row_bytes = self.build_stages(), None

    def build_stages(self) -> list[Stage]:
        lora = None if self.lora is None else self.lora.modules
        return [Stage(self.cfg, self.weights, self.cache, layers, backend, self.activations, self.shard, lora)
                for layers, backend in self.placement]

    def enable_lora(self, max_loras: int) -> LoraTable:
        """The model's adapter slots: its graphs rebuilt with an adapter op beside every linear layer, between
        steps, the first time (running sequences go on where they were); the table as it is after."""
        self.whole("LoRA adapters")
        with self.lock:
            if self.lora is None:
                self.lora = LoraTable(adapted_modules(self.cfg, self.weights), max_loras)
                self.stages, self.row_bytes = self.build_stages(), None
        return self.lora

    def adapters(self, name: str) -> LoraTable:
        """The adapter slots, where the adapter `name` is wanted; RequestError where none was ever loaded."""
        if self.lora is None:
            raise RequestError(f"no adapter named {name!r} is loaded (loaded: none)")
        return self.lora

    def variant(self, lora: str | None, scale: float = 1.0) -> Variant:
        """What a sequence runs under: the adapter named `lora` at `scale` (held until `release`), or the base."""
        return BASE if lora is None else self.adapters(lora).use(lora, scale)

    def release(self, seq: Sequence) -> None:
        """A sequence ended: its pages back to the pool, its hold on its adapter let go."""
        self.pool.release(seq)
        if self.lora is not None:
            self.lora.release(seq.variant)

    def centered(self, cache: PagedKV) -> PagedKV:
        """`cache` with this model's key centers where its keys are coded rotated (PagedKV.key_center),
        measured on first need: each layer's mean key over calibration.TEXT, run on the host (nothing placed
        on a device) with a float cache. Not where scores are soft-capped: a shift of every score is no
        longer ignored there."""
        if not cache.wants_centers or self.cfg.attn_softcap:
            return cache
        if self.key_centers is None:
            tokens = self.tokenizer.encode(calibration.TEXT)[:self.n_ctx - 1]
            probe = Engine(self.cfg, self.weights, self.tokenizer, self.backend.fallback or self.backend, self.n_ctx, "f32",
                           self.activations, len(tokens), shard=self.shard)
            seq = Sequence()
            probe.forward([(seq, tokens, 1)])
            self.key_centers = calibration.mean_keys(probe.pool, seq, self.cfg.num_layers)
        return replace(cache, centers=self.key_centers)

    def ladder_kinds(self) -> dict[str, calibration.KindQuality]:
        """The memory ladder's compressed kinds this model can take (calibration.LADDER: its heads fit the
        codecs), each with its quality over calibration.TEXT against a float cache, measured once on the
        host and kept."""
        if self.kv_quality is None:
            tokens = self.tokenizer.encode(calibration.TEXT)[:self.n_ctx - 1]
            host = self.backend.fallback or self.backend
            probe = lambda kind: Engine(self.cfg, self.weights, self.tokenizer, host, self.n_ctx, kind, "f32", len(tokens),
                                        key_centers=self.key_centers, shard=self.shard)
            reference = probe("f32")
            self.key_centers = self.key_centers if self.key_centers is not None else reference.key_centers
            exact, measured = reference.logits(tokens), {}
            for kind in calibration.LADDER:
                try:
                    engine = probe(kind)
                except RequestError:              # heads the codecs cannot hold
                    continue
                self.key_centers = engine.key_centers
                measured[kind] = calibration.KindQuality(kind, *calibration.divergence(exact, engine.logits(tokens)))
            self.kv_quality = measured
        return self.kv_quality

    def smaller_kv_kind(self) -> str | None:
        """The memory ladder's next kind for this cache: the first of calibration.LADDER after the current
        kind that takes fewer bytes a token and passes the quality bar on this model; None where none does."""
        if self.shard is not None or self.cfg.head_dim % 32:
            return None
        current = self.cache.token_bytes()
        for kind, quality in self.ladder_kinds().items():
            if quality.passes and cache_of(self.cfg, kind).token_bytes() < current:
                return kind
        return None

    def new_pool(self) -> KVPool:
        return KVPool(self.cache, self.pool_tokens(), self.backend_of)

    def pool_tokens(self, n_ctx: int | None = None) -> int:
        """The tokens the KV pool holds for a context of `n_ctx` (default: as it runs): `kv_tokens` where
        given, but at least what one sequence may hold (its context, and where layers slide, what their
        windows keep); else room for many sequences of the context."""
        n_ctx = self.n_ctx if n_ctx is None else n_ctx
        one = n_ctx + (self.cache.horizon + ROLLBACK + BLOCK if self.cache.horizon else 0)
        return max(self.kv_tokens, one) if self.kv_tokens else max(n_ctx, KV_TOKENS)

    def limit_context(self, n_ctx: int) -> None:
        """A shorter context for requests admitted from now on; a model that serves none yet also gets the
        smaller KV pool that context needs (the memory ladder's last rung)."""
        self.n_ctx = min(self.n_ctx, n_ctx)
        with self.lock:
            if not self.pool.in_use and self.pool.pages_for(self.pool_tokens()) + 1 < self.pool.num_pages:
                self.stages, self.pool, self.row_bytes = self.build_stages(), self.new_pool(), None

    def backend_of(self, layer: int) -> Backend:
        return next(backend for layers, backend in self.placement if layer in layers)

    @property
    def device_layers(self) -> int:
        """The layers that run on the model's backend (all, unless split)."""
        return len(self.placement[0][0]) if self.placement[0][1] is self.backend else 0

    def offload(self, device_layers: int) -> None:
        """Keep only the first `device_layers` layers on the device, the rest on the host, before any request
        runs (the server's ladder, for a model that does not fit its budget); the device's copies of the
        others go with the old stages."""
        self.whole("layers offloaded")
        with self.lock:
            assert not self.pool.in_use, "layers are offloaded before a model serves"
            self.placement = split(self.cfg, self.backend, device_layers)
            self.stages, self.pool, self.row_bytes = self.build_stages(), self.new_pool(), None

    def memory_bytes(self, device_layers: int | None = None, n_ctx: int | None = None) -> int:
        """What the model holds where its first stage runs (its device): the weights and KV cache of the
        layers there (its KV pool's slots: pool_tokens), with `device_layers` of them on the device and a context of
        `n_ctx` tokens (default: as it runs); and its LoRA slots (host arrays each step reads)."""
        layers = split(self.cfg, self.backend, self.device_layers if device_layers is None else device_layers)[0][0]
        slots = pool_slots(self.pool_tokens(n_ctx))
        adapters = 0 if self.lora is None else self.lora.nbytes
        return stage_bytes(self.cfg, self.weights, self.cache, layers, slots) + self.copy_bytes(layers, slots, n_ctx) + adapters

    def copy_bytes(self, layers: range, slots: int, n_ctx: int | None = None) -> int:
        """The float copies a cache keeps besides its pages, for as many sequences as its pool holds of the
        context: each one's first page (sinks) and the pages its window and a rollback reach."""
        copied = [i for i in layers if self.cache.copies(i)]
        if not copied:
            return 0
        sequences = max(1, slots // (self.n_ctx if n_ctx is None else n_ctx))
        shape, _ = self.cache.copy_page_shape(1, BLOCK)
        per_token = 2 * 2 * shape[2] * shape[3] * len(copied)          # keys and values, f16
        return sequences * (BLOCK + pool_slots(self.cache.layout.window + ROLLBACK)) * per_token

    @property
    def asynchronous(self) -> bool:
        """Whether a step's results come back while later work runs on (a split step waits on the host)."""
        return all(stage.backend.asynchronous for stage in self.stages)

    @property
    def fusions(self) -> Counter:
        return fusions(self.stages)

    def prepare(self, precision: Precision, tune: bool, force: bool = False) -> dict:
        """Each stage's layer weights readied on its backend (Backend.prepare); what was measured."""
        measured = {}
        for stage in self.stages:
            measured.update(stage.backend.prepare(stage.layer_weights(), precision, tune, force))
        return measured

    def warm(self) -> None:
        """Run a prompt's step and decode steps (greedy, sampled, logits to the host) on a sequence of its
        own, then let it go: every kernel a request calls is compiled (or read from numba's disk cache) and
        every decode step captured before a first request is timed, so its speed is the hundredth's. Only
        where every stage's backend compiles its kernels: a stage of atoms or of Triton's interpreter would
        take longer over the warm-up than any compile it saves."""
        if not all(stage.backend.compiles for stage in self.stages):
            return
        decodes = (greedy_rows(1), WARM_SAMPLING, None)
        seq, prompt = Sequence(), [0] * max(1, min(WARM_ROWS, self.n_ctx - len(decodes)))
        try:
            self.forward([(seq, prompt, 1)])
            for sampling in decodes[: self.n_ctx - len(prompt)]:
                self.forward([(seq, [0], 1)], sampling)
        finally:
            self.pool.release(seq)

    def first_layers(self, n: int) -> Engine:
        """An engine of this model's first `n` layers, then its final norm and head: a self-speculative
        draft. It shares the weights (and their copies on the device) and LoRA slots, with a KV pool of its own."""
        self.whole("a self-speculative draft")
        if type(n) is not int or not 1 <= n < self.cfg.num_layers:
            raise RequestError(f"a self-speculative draft takes 1 to {self.cfg.num_layers - 1} layers, got {n!r}")
        cfg = replace(self.cfg, num_layers=n, layer_windows=self.cfg.layer_windows[:n])
        centers = None if self.key_centers is None else self.key_centers[:n]
        draft = Engine(cfg, self.weights, self.tokenizer, self.backend, self.n_ctx, self.kv_dtype, self.activations,
                       self.kv_tokens, self.device_layers, centers, lora=self.lora)
        for mine, theirs in zip(draft.stages, self.stages):
            mine.share_weights(theirs)
        draft.sliding = self.sliding
        return draft

    @property
    def max_length(self) -> int:
        """The most tokens a sequence may reach: the context, or sliding, the model's positions."""
        return self.cfg.max_position if self.sliding else self.n_ctx

    def held_tokens(self, total: int) -> int:
        """The most tokens of a sequence `total` long the cache holds at once: all of them, or where every
        layer attends within a window, that window and a step's rows (at most the context)."""
        if self.cache.horizon:
            return min(total, self.cache.horizon + ROLLBACK + self.n_ctx + self.pool.block)
        return min(total, self.n_ctx)

    def plan(self, rows: int, logit_rows: int = 1) -> Plan:
        """The first stage's plan of a step (each stage's is made as a step first runs it)."""
        first, lora = self.stages[0], None if self.lora is None else self.lora.base_step(rows)
        return first.plan(rows, logit_rows, self.pool.k[first.layers.start], lora)

    def step_rows(self, wanted: int) -> int:
        """At most `wanted` rows for one step: fewer where the device's free memory cannot hold their
        activations (prompts are then run in chunks), never fewer than one."""
        free = self.stages[0].backend.free_bytes()
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

    def launch(self, batch: list[tuple[Sequence, list[int], int]], sampling: np.ndarray | None = None, ids=None,
               host: list[int] = ()) -> Launched:
        """`forward`, queued: the step runs on while the caller goes on, until it waits for the results.
        `ids` may give the tokens as a device value (an earlier step's choices, not yet read back); the
        batch's token lists then only count them. With `sampling`, `host` names the wanted rows (by their
        order) whose logits come back instead of their tokens: streams sampled on the host (a grammar's
        mask) beside streams sampled on the model, each row fetched as its stream needs it."""
        for seq, tokens, _ in batch:
            self.pool.reserve(seq, seq.length + len(tokens))
        rows = sum(len(tokens) for _, tokens, _ in batch)
        attention = self.pool.attention([(seq, len(tokens)) for seq, tokens, _ in batch], self.cache.window_sizes,
                                        lambda slots: self.stages[0].context(rows, slots))
        logit_rows = np.concatenate([np.arange(end - want, end) for end, (_, _, want)
                                     in zip(np.cumsum([len(tokens) for _, tokens, _ in batch]), batch)]).astype(np.int64)
        if ids is None:
            ids = np.asarray([t for _, tokens, _ in batch for t in tokens], np.int64)
        logits_wanted = sampling is None                     # else only the tokens chosen on the model come back
        rows_params = greedy_rows(len(logit_rows)) if logits_wanted else np.asarray(sampling, np.float32)
        if self.leading:                     # the other ranks run the same step on their shards
            collective.shared((None if ids is self.choices else np.asarray(self.stages[0].backend.fetch(ids)), attention,
                               logit_rows, rows_params))
        lora = None if self.lora is None else self.lora.step([seq.variant for seq, _, _ in batch], [len(t) for _, t, _ in batch])
        out, last = self.run_stages(DecoderStep(ids, attention, logit_rows, rows_params, lora=lora))
        for seq, tokens, _ in batch:
            seq.length += len(tokens)
        ends = np.cumsum([want for _, _, want in batch])[:-1]
        if logits_wanted or not host:
            read = last.fetch_soon(out.logits if logits_wanted else out.choices)
            return Launched(out.choices, lambda: np.split(read(), ends))
        read_choices, read_logits = last.fetch_soon(out.choices), last.fetch_soon(out.logits[list(host)])

        def wait() -> list:
            chosen, logits = list(read_choices()), read_logits()
            for j, row in enumerate(host):
                chosen[row] = logits[j]
            return [chosen[a:b] for a, b in zip([0, *ends], [*ends, len(chosen)])]
        return Launched(out.choices, wait)

    def run_stages(self, step: DecoderStep):
        """Run one step's rows through every stage over the pool's pages, keeping the pages each returns;
        the last stage's outputs and backend. Its choices stay on the model (`choices`): a next step may
        run them."""
        with self.lock:                      # the pages, plans and graphs of one cache (recompress swaps them)
            step.pages, step.copies = self.pool.pages, self.pool.copies
            out, last = None, None
            for stage in self.stages:
                if out is not None:          # a split model: the rows its device part gave go on on the host
                    step.hidden = stage.backend.place(last.fetch(out.hidden))
                out, last = stage.run(step, len(step.logit_rows), len(step.attention.ctx_slots)), stage.backend
                self.pool.keep(out.pages, stage.layers, out.copies)
            self.choices = out.choices
        return out, last

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run the steps rank 0 leads, on this rank's shard and pages,
        until it says stop (its results are rank 0's: the logits are summed over the group)."""
        while (shared := collective.shared()) is not None:
            ids, attention, logit_rows, rows_params = shared
            self.run_stages(DecoderStep(self.choices if ids is None else ids, attention, logit_rows, rows_params))

    def whole(self, what: str) -> None:
        """ParallelError where this engine is one tensor-parallel rank's: `what` needs the whole model."""
        if self.shard is not None:
            raise ParallelError(f"{what}: not for a model split over tensor-parallel ranks")

    def launch_next(self, streams: list[Stream], launched: Launched) -> Launched:
        """The step after `launched` for `streams` (all sampled on the model), queued before its tokens are
        read: each stream's row runs the token `launched` chooses for it, fed on the device."""
        return self.launch([(s.seq, [0], 1) for s in streams], np.concatenate([s.draws() for s in streams]), ids=launched.choices)

    def logits(self, tokens: list[int], lora: str | None = None, lora_scale: float = 1.0) -> np.ndarray:
        """Next-token logits at every position of `tokens` ([len, vocab]), as one prefill (under the adapter
        named `lora`, at `lora_scale`, where given)."""
        self.check_prompt(tokens)
        seq = Sequence(variant=self.variant(lora, lora_scale))
        try:
            return self.forward([(seq, tokens, len(tokens))])[0]
        finally:
            self.release(seq)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int = 1) -> None:
        """RequestError for a prompt that is empty, not token ids of this vocabulary, or over the context."""
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise RequestError("the prompt must be a non-empty list of token ids")
        if not all(type(t) is int for t in prompt_ids):
            bad = next(t for t in prompt_ids if type(t) is not int)
            raise RequestError(f"prompt token ids must be integers, got {type(bad).__name__} {bad!r}")
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < self.cfg.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), "
                               f"got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) >= self.max_length:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_length}")
        if type(max_tokens) is not int or max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")

    def check(self, req: GenerationRequest) -> None:
        """RequestError naming the first field of `req` this engine cannot run."""
        self.check_prompt(req.prompt_ids, req.max_tokens)
        check_stops(req.stop)
        if req.logprobs is not None and (type(req.logprobs) is not int or not 0 <= req.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
        req.sampling.validate()
        if req.lora is not None:
            self.adapters(req.lora).check(req.lora, req.lora_scale)
        if req.constraint is not None:
            self.grammars.prototype(req.constraint)        # compiled (and cached) now: a bad one fails the request
