"""Continuous batching: an iteration-level scheduler over one Engine (vLLM-style), the one scheduling
loop of generation: a server runs it on a thread of its own, the library's generate steps it on the
caller's thread (`run`), so both batch, chunk prompts and run ahead alike.

Requests join and leave the running batch between steps. Each step runs, as one forward, a decode
row for every running stream plus chunks of the prompts being prefilled, up to `step_tokens` rows,
so a long prompt never stalls the streams already running; prompts that start like one being
prefilled in the same step wait a step and reuse its cached pages. A request is admitted when the KV pool
can hold its whole prompt and `max_tokens`; a cancelled one (a client gone) frees its pages at the
next step. Tokens go back through each job's callback, from the scheduler's thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.engine.generate.engine import Engine, GenerationRequest, Stream, Token
from soma_runtime.engine.generate.sampling import greedy_rows
from soma_runtime.engine.generate.speculate import Drafter, DraftLength
from soma_runtime.engine.kv import prefix_hashes
from soma_runtime.errors import RequestError
from soma_runtime.memory import peak_rss_mb

log = logging.getLogger("soma_runtime.batching")


@dataclass(eq=False)
class Job:
    """A submitted request. `emit` receives each Token, then None at the end (or an Exception). Jobs
    are told apart by identity (comparing their fields took a seventh of a 32-stream step's host time,
    in the batch's membership tests)."""
    req: GenerationRequest
    emit: Callable[[Token | Exception | None], None]
    stream: Stream | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    done: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(frozen=True)
class PageCounts:
    """The KV pool's pages: held by sequences, kept for prefix reuse by nobody, in all."""
    in_use: int
    cached: int
    total: int


@dataclass
class SchedulerStats:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    last_batch: int = 0            # sequences in the latest step
    max_batch: int = 0             # most sequences one step has run
    ran_ahead: int = 0             # steps launched before the tokens of the one before them were read
    drafted_tokens: int = 0        # speculative decoding: draft tokens proposed ...
    accepted_tokens: int = 0       # ... and kept by the target


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 16, step_tokens: int = 256, run_ahead: bool | None = None,
                 thread: bool = True, drafter: Drafter | None = None):
        """`run_ahead` (default: where the engine's results come back asynchronously, as on a GPU): a
        decode step whose streams all go on is followed by the next one, launched before its tokens are
        read (they feed it on the device), so the host's work between steps overlaps the model's.
        `thread`: the loop runs on a thread of its own; else `run` steps it on the caller's. With a
        `drafter`, decoding streams speculate: their drafts run as rows after their token, checked at once."""
        self.engine, self.max_batch, self.step_tokens, self.drafter = engine, max_batch, step_tokens, drafter
        self.run_ahead = engine.asynchronous if run_ahead is None else run_ahead
        self.ahead: tuple[list[Job], object] | None = None      # the step launched ahead: its jobs, its Step
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.stats = SchedulerStats()
        self.wake = threading.Condition()
        self.closing = False
        self.driving = threading.Lock()           # one caller steps the loop at a time (without a thread)
        self.thread = threading.Thread(target=self._loop, name="soma-scheduler", daemon=True) if thread else None
        if self.thread is not None:
            self.thread.start()

    def submit(self, req: GenerationRequest, emit: Callable) -> Job:
        """Queue a request; raises RequestError at once for one that can never run."""
        self.engine.check(req)
        need = self.engine.pool.pages_for(self.engine.held_tokens(len(req.prompt_ids) + req.max_tokens))
        if need > self.engine.pool.num_pages - 1:
            raise RequestError(f"request needs {need} KV pages, the pool has {self.engine.pool.num_pages - 1}")
        job = Job(req, emit)
        with self.wake:
            if self.closing:
                raise RequestError("the server is shutting down")
            self.waiting.append(job)
            self.stats.requests += 1
            self.wake.notify()
        return job

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def pages(self) -> PageCounts:
        pool = self.engine.pool
        return PageCounts(pool.in_use, len(pool.idle), pool.num_pages - 1)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish the queued and running ones (drain) or cancel them."""
        with self.wake:
            self.closing = True
            if not drain:
                for job in [*self.waiting, *self.running]:
                    job.cancel()
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def run(self, req: GenerationRequest) -> Iterator[Token]:
        """One request's tokens as they come, from the loop's thread, or by stepping the loop here where it
        has none. A caller that stops early cancels the request, whose pages go back at once."""
        if self.thread is not None:
            received: queue.SimpleQueue = queue.SimpleQueue()
            job = self.submit(req, received.put)
            try:
                yield from tokens(received.get)
            finally:
                job.cancel()
            return
        received = deque()
        job = self.submit(req, received.append)
        try:
            while not job.done:
                with self.driving:
                    self._step_safely()
                yield from tokens(received.popleft, lambda: bool(received))
            yield from tokens(received.popleft, lambda: bool(received))
        finally:
            job.cancel()
            with self.driving:
                while not job.done:
                    self._step_safely()

    def _loop(self) -> None:
        self.engine.backend.enter_thread()
        while True:
            with self.wake:
                while not (self.waiting or self.running or self.closing):
                    self.wake.wait()
                if self.closing and not (self.waiting or self.running):
                    return
            self._step_safely()

    def _step_safely(self) -> None:
        try:
            self.step()
        except Exception as exc:      # a failing step ends the requests it held, never the loop
            log.exception("scheduler step failed; ending the %d requests it held", len(self.running))
            self.ahead = None
            with self.wake:
                for job in list(self.running):
                    self._finish(job, exc)

    def _admit(self) -> None:
        pool = self.engine.pool
        outstanding = sum(job.stream.budget_pages for job in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled:
                self.waiting.popleft()
                self._finish(job, None)
                continue
            try:
                stream = Stream(self.engine, job.req)
            except Exception as exc:             # this request alone cannot start: it gets the error
                if not isinstance(exc, RequestError):
                    log.exception("a request could not start")
                self.waiting.popleft()
                self._finish(job, exc)
                continue
            if stream.budget_pages > pool.available - outstanding and self.running:
                return                            # wait for running streams to give pages back
            self.waiting.popleft()
            job.stream = stream
            if self.drafter is not None:
                stream.draft_length = DraftLength()
            outstanding += stream.budget_pages
            self.stats.prompt_tokens += len(job.req.prompt_ids)
            self.running.append(job)

    def step(self) -> None:
        with self.wake:
            for job in [j for j in self.running if j.cancelled]:
                self._finish(job, None)
            self._admit()
        start = time.perf_counter()
        if self.ahead is not None:                  # launched last step: its rows are its jobs' pending tokens
            jobs, step = self.ahead
            self.ahead = None
            for job in jobs:                        # a resting speculator's plain step counts down its rest
                if job.stream.speculates:
                    job.stream.draft_length.next()
            batch = [(job.stream.seq, job.stream.take(1) if job in self.running else [], 1) for job in jobs]
        else:
            batch, jobs = self._batch()
            if not batch:
                return
            for job, (_, _, want) in zip(jobs, batch):      # grammar masks: computed while the forward runs
                if want and job.stream.guide is not None:
                    job.stream.guide.prepare()
            sampling, host = self._sampling(jobs, batch)
            step = self.engine.launch(batch, sampling, host=host)
        if self._goes_on(jobs, batch):
            self.ahead = jobs, self.engine.launch_next([job.stream for job in jobs], step)
            self.stats.ran_ahead += 1
        rows_of = step.wait()
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - start
        self.stats.last_batch = len(batch)
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        for job, rows in zip(jobs, rows_of):
            if len(rows) and job in self.running:   # a job finished since its row was launched gets nothing
                try:
                    tokens = job.stream.advance(rows)
                except RequestError as exc:         # its own constraint broke: this request alone ends, with the error
                    self._finish(job, exc)
                    continue
                for token in tokens:
                    if job in self.running:
                        self._deliver(job, token)

    def _batch(self) -> tuple[list, list[Job]]:
        """This step's rows: a token for every decoding stream, prompt chunks up to the step's budget."""
        decode = [job for job in self.running if not job.stream.prefilling]
        self._draft([job.stream for job in decode])
        rows = self.engine.step_rows(self.step_tokens) if len(decode) < len(self.running) else self.step_tokens
        budget = max(0, rows - sum(1 + len(job.stream.drafts) for job in decode))   # prompt chunks fill what is left
        batch, jobs, leading = [], [], set()
        for job in self.running:
            stream = job.stream
            if stream.prefilling:
                if budget <= 0:
                    continue
                if stream.pending is None:
                    block = self.engine.pool.block
                    first = prefix_hashes(job.req.prompt_ids[:block + 1], block, stream.seq.variant.key)[:1]
                    if first and first[0] in leading and first[0] not in self.engine.pool.by_hash:
                        continue            # a prompt in this step shares its start: wait one step, then reuse its pages
                    leading.update(first)
                    stream.start()
                    self.stats.cached_tokens += stream.metrics.cached_tokens
                tokens = stream.take(min(budget, self.engine.n_ctx))    # a sliding prompt past the context: in chunks
                budget -= len(tokens)
                want = 0 if stream.pending else 1       # the logits after a prompt's last chunk
            else:
                tokens = stream.take(1) + stream.drafts
                want = len(tokens)                      # the token's, then each draft's
            batch.append((stream.seq, tokens, want))
            jobs.append(job)
        return batch, jobs

    def _draft(self, streams: list[Stream]) -> None:
        """Each speculating stream's drafts for this step (as many as its draft length and room allow)."""
        streams = [s for s in streams if s.speculates]
        counts = [s.draft_room() for s in streams]
        if not any(counts):
            return
        proposed = self.drafter.propose([s.history for s in streams], counts, [id(s) for s in streams],
                                        [s.seq.variant for s in streams])
        for stream, count, drafts in zip(streams, counts, proposed):
            stream.drafts = drafts[:count]
            if count and not stream.drafts:
                stream.draft_length.nothing_found()

    def _goes_on(self, jobs: list[Job], batch: list) -> bool:
        """Whether the step after this one can be launched now: it would run the same streams, all still
        here and none waiting to join, each for the token this step samples on the model, and may follow
        (a speculating stream only while it rests: the step takes no drafts)."""
        return (self.run_ahead and not self.waiting and len(jobs) == len(self.running) and all(want for _, _, want in batch)
                and all(job in self.running and not job.cancelled and job.stream.on_model and job.stream.has_next_step
                        and (not job.stream.speculates or job.stream.draft_length.resting) for job in jobs))

    @staticmethod
    def _sampling(jobs: list[Job], batch: list) -> tuple[np.ndarray | None, list[int]]:
        """The step's sampling rows and the wanted rows sampled on the host (whose logits come back): None
        and all where no stream samples on the model; else a row per wanted row, greedy for host-sampled ones
        (a speculating stream's rows are all on the host)."""
        rows, host, count = [], [], 0
        for job, (_, _, want) in zip(jobs, batch):
            if want and job.stream.on_model:
                rows.append(job.stream.draws())
            elif want:
                host += range(count, count + want)
                rows.append(greedy_rows(want))
            count += want
        if len(host) == count and rows:
            return None, host
        return (np.concatenate(rows) if rows else greedy_rows(0)), host

    def _deliver(self, job: Job, token: Token) -> None:
        self.stats.generated_tokens += 1
        if job.first_token_s is None:
            job.first_token_s = time.perf_counter() - job.submitted
        if not self._emit(job, token):
            job.cancel()
        if token.finish_reason or job.cancelled:
            self._finish(job, None)

    def _finish(self, job: Job, error: Exception | None) -> None:
        if job in self.running:
            self.running.remove(job)
        if job in self.waiting:
            self.waiting.remove(job)
        if job.stream is not None:
            self.engine.release(job.stream.seq)
            if self.drafter is not None:
                self.drafter.release(id(job.stream))
                self.stats.drafted_tokens += job.stream.metrics.drafted_tokens
                self.stats.accepted_tokens += job.stream.metrics.accepted_tokens
            job.stream.metrics.peak_rss_mb = peak_rss_mb()
            self.engine.metrics = job.stream.metrics          # the model's latest request, as `metrics()` reports
        job.done = True
        if job.cancelled:
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1
        self._emit(job, error)

    @staticmethod
    def _emit(job: Job, item) -> bool:
        """Hand `item` to the job's receiver; False where the receiver failed (its event loop closed)."""
        try:
            job.emit(item)
            return True
        except Exception:
            log.warning("a request's receiver failed; the request ends", exc_info=True)
            return False


def tokens(take, more=lambda: True) -> Iterator[Token]:
    """A job's items as `take` hands them over, while `more` says there are some: tokens, until the end
    (None) or an error (raised)."""
    while more():
        item = take()
        if item is None:
            return
        if isinstance(item, Exception):
            raise item
        yield item
