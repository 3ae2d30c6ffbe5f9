"""The scheduler thread: the only code that touches the models. Handlers enqueue and read events.

Loop: admit queued requests into free batch slots (prefill alone, splice in) → drop cancelled rows → pick
the round's γ cap from measured goodput → `BatchDecoder.step` → hand each row's new tokens to its request
(thread-safe, onto the request's asyncio queue) → metrics. A row whose decoding fails is removed with an
error for its request alone; a failure of the whole round fails the rows in it and the loop goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specdec.engine.batch import BatchDecoder
from specdec.engine.options import DecodeOptions
from specdec.errors import SpecdecError
from specdec.runtime.threads import threads_for
from specdec.server.goodput import GoodputGamma
from specdec.server.metrics import Metrics

log = logging.getLogger("specdec.serve")


@dataclass
class Tokens:
    """New tokens of one round (and, when the request asked, their log-probabilities: see RowEvent)."""

    ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled"


@dataclass
class Failed:
    status: int
    message: str


@dataclass
class Request:
    """One generation request, as the scheduler sees it."""

    prompt_ids: list[int]
    options: DecodeOptions  # the request's options (max_new_tokens, temperature, ..., gamma, seed, logprobs)
    loop: asyncio.AbstractEventLoop
    adaptive: bool = True  # may the load-based γ cap lower this row's γ (False keeps seeded draws reproducible)
    id: int = field(default_factory=itertools.count().__next__)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    # Filled by the scheduler as the request runs (read by the handler once finished).
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False  # set by the handler's thread; the scheduler frees the row at the next round

    def push(self, item) -> None:
        """Thread-safe: deliver Tokens, a Finished or a Failed to the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class Scheduler:
    def __init__(self, target, drafter=None, *, max_batch: int = 64, max_gamma: int = 4,
                 metrics: Metrics | None = None, adaptive_gamma: bool = True, compile: bool | str = False,
                 max_len: int | None = None):
        self._models = (target, drafter)
        self.compile, self.max_len = compile, max_len
        self.decoder = BatchDecoder(target, drafter, compile=compile, max_len=max_len)
        self.speculative = drafter is not None
        self.max_batch = max_batch
        self.max_gamma = max_gamma if self.speculative else 0
        # On the fast path every (batch bucket, γ + 1) is a compiled shape: fewer candidates, fewer compiles.
        candidates = sorted({0, self.max_gamma // 2, self.max_gamma}) if compile is True else None
        self.policy = (GoodputGamma(self.max_gamma, candidates=candidates,
                                    pass_tokens=self.decoder.target.pass_tokens) if adaptive_gamma else None)
        self.metrics = metrics or Metrics()
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []
        self.active: dict[int, Request] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.accepting = True
        self.thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        self.rounds = 0
        self.widths: tuple[int, ...] | None = None  # the precompiled input widths (the batched fast path)

    # -- called from handlers (event-loop thread) -----------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request) -> None:
        self.incoming.put(request)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Free this request's row at the next round boundary (client disconnected, stop string seen).

        A flag on the request, not a set of ids on the scheduler: a request cancelled after it finished
        (or before it was seen) leaves nothing behind."""
        request.cancelled = True
        self._wake.set()

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop admitting; let running rows finish for up to drain_s seconds; cancel the rest; join."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while (self.active or self.waiting or not self.incoming.empty()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=30)

    def precompile(self) -> None:
        """On the batched fast path: compile every pass the loop may run (each batch bucket up to max_batch x
        one input per row and γ + 1 for every γ the policy may pick), logging each compile and its time."""
        target = self.decoder.target
        if not target.compile:  # eager passes (no --compile, or the model could not take the fast path)
            return
        gammas = self.policy.candidates if self.policy is not None else [self.max_gamma]
        widths = {g + 1 for g in gammas} | {1}
        nodes = self.decoder.capabilities.max_nodes  # a tree drafter scores its nodes + the root
        if nodes is not None and self.speculative:
            widths.add(nodes + 1)
        widths = sorted(widths)
        self.widths = target.query_buckets = tuple(widths)  # a shorter round (a row near its end) pads up to these
        start = time.perf_counter()
        with threads_for(self._models[0]):  # compiled kernels keep the thread count they were compiled with
            target.precompile(range(1, self.max_batch + 1), widths)
            if self.decoder.drafters is not None:  # a draft model's own batched passes (its path is the target's)
                self.decoder.drafters.precompile(range(1, self.max_batch + 1))
        log.info("batched fast path ready: passes for up to %d rows x %s inputs compiled in %.1f s",
                 self.max_batch, widths, time.perf_counter() - start)

    @property
    def load(self) -> dict:
        return {"running": len(self.active), "waiting": len(self.waiting) + self.incoming.qsize()}

    # -- the scheduler thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._admit()
            self._drop_cancelled()
            self.metrics.running.set(len(self.active))
            self.metrics.waiting.set(len(self.waiting))
            if not self.active:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._round()
        for request in [*self.active.values(), *self.waiting, *self._drain_incoming()]:
            request.push(Failed(503, "the server is shutting down; retry against another instance"))
        self.active.clear()
        self.waiting.clear()

    def _drain_incoming(self) -> list[Request]:
        out = []
        while True:
            try:
                out.append(self.incoming.get_nowait())
            except queue.Empty:
                return out

    def _admit(self) -> None:
        """Move queued requests into free batch slots: validate each, then one batched prefill for all."""
        self.waiting.extend(self._drain_incoming())
        admitted, rows = [], []
        while self.waiting and len(self.active) + len(admitted) < self.max_batch:
            request = self.waiting.pop(0)
            if request.cancelled:
                continue
            try:
                rows.append((request.id, request.prompt_ids, request.options))
                self.decoder.check(*rows[-1])
            except SpecdecError as exc:
                rows.pop()
                request.push(Failed(400, str(exc)))
                continue
            admitted.append(request)
        if not admitted:
            return
        try:
            self.decoder.add_many(rows)
        except Exception as exc:  # noqa: BLE001 (a broken prefill must not stop the loop)
            log.exception("prefill failed")
            for request in admitted:
                request.push(Failed(500, f"prefill failed: {type(exc).__name__}: {exc}"))
            return
        for request in admitted:
            self.active[request.id] = request
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))

    def _drop_cancelled(self) -> None:
        gone = [rid for rid, request in self.active.items() if request.cancelled]
        if gone:
            self.decoder.remove(gone)
            for rid in gone:
                self.active.pop(rid).push(Finished("cancelled"))
        self.waiting = [r for r in self.waiting if not r.cancelled]

    def _round(self) -> None:
        batch = len(self.decoder)
        gamma = self.policy.choose(batch) if self.policy is not None else self.max_gamma
        # On the fast path rows that the load may not cap are still held to --gamma: their passes must be
        # among the shapes compiled at start-up.
        fixed = self.max_gamma if self.compile is True else None
        caps = {row.key: (gamma if self.active[row.key].adaptive else fixed) for row in self.decoder.rows}
        start = time.perf_counter()
        try:
            events = self.decoder.step(gamma_cap=caps)
        except Exception as exc:  # noqa: BLE001 (the round as a whole failed: fail its rows, keep serving)
            log.exception("decoding round failed")
            keys = self.decoder.keys
            self.decoder = BatchDecoder(*self._models, compile=self.compile, max_len=self.max_len)  # start clean
            if self.widths is not None:  # the precompiled input widths
                self.decoder.target.query_buckets = self.widths
            for rid in keys:
                self.active.pop(rid).push(Failed(500, f"decoding failed: {type(exc).__name__}: {exc}"))
            return
        seconds = time.perf_counter() - start
        now = time.perf_counter()
        self.rounds += 1
        m = self.metrics
        m.batch_size.observe(batch)
        m.round_seconds.observe(seconds)
        m.gamma.set(gamma)
        m.gamma_chosen.observe(gamma)
        committed = accepted = rejections = 0
        for event in events:
            request = self.active.get(event.key)
            if request is None:
                continue
            if event.error is not None:
                self.active.pop(event.key)
                request.push(Failed(500, f"decoding failed for this request: {event.error}"))
                continue
            m.record_round(event.drafted, event.accepted)
            accepted += event.accepted
            rejections += int(event.accepted < event.drafted)
            request.drafted += event.drafted
            request.accepted += event.accepted
            committed += len(event.tokens)
            if event.tokens:
                if request.first_token_at is None:
                    request.first_token_at = now
                    m.ttft.observe(now - request.arrived)
                else:
                    gap = (now - request.last_token_at) / len(event.tokens)
                    for _ in event.tokens:
                        m.itl.observe(gap)
                request.last_token_at = now
                request.completion_tokens += len(event.tokens)
                m.generation_tokens.inc(len(event.tokens))
                request.push(Tokens(event.tokens, event.logprobs, event.top_logprobs))
            if event.finished:
                self.active.pop(event.key)
                m.requests.labels(finished_reason=event.finish_reason).inc()
                m.e2e.observe(now - request.arrived)
                request.push(Finished(event.finish_reason))
        if self.policy is not None:
            last = self.decoder.last_round or {}
            self.policy.update(batch, gamma, seconds, committed,
                               pass_tokens=self.decoder.target.pass_tokens(batch, last.get("width", 1)),
                               pass_seconds=last.get("target_s"), accepted=accepted, rejections=rejections)
