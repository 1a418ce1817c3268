"""The engine behind the HTTP server: one thread steps it; request handlers talk to it through queues.

The engine is single-threaded by design (one forward at a time, STYLE.md P10). The service owns the
thread: handlers `submit` requests (validated first, so errors reach the client before streaming
starts), receive their events on an asyncio queue, and `cancel` them when the client goes away. The
queue of waiting requests is bounded: past `max_queue`, `submit` raises `QueueFull` (HTTP 429).
Stopping drains: no new requests, running ones finish (up to a timeout), then the thread ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.request import Request, StreamEvent
from .metrics import Metrics


class QueueFull(RuntimeError):
    """More requests are waiting than the server accepts."""


class ShuttingDown(RuntimeError):
    """The server is draining and accepts no new requests."""


@dataclass
class Subscription:
    """One request's events, delivered on the handler's event loop."""

    request: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    rid: int | None = None
    """The engine's id, once the engine thread has taken the request."""
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None


class EngineService:
    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int = 64, idle_wait_s: float = 0.05):
        self.engine, self.metrics = engine, metrics
        self.max_queue, self.idle_wait_s = max_queue, idle_wait_s
        self._inbox: deque[Subscription] = deque()
        self._subs: dict[int, Subscription] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
        self.failure: BaseException | None = None

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> "EngineService":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Accept nothing more, let running requests finish (at most `timeout_s`), end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def open_requests(self) -> int:
        return len(self._subs) + len(self._inbox)

    # ---------------------------------------------------------------------------------- requests
    def submit(self, request: Request) -> Subscription:
        """Queue a request (from the event loop; validate it first); → its subscription. Raises
        QueueFull or ShuttingDown."""
        sub = Subscription(request, asyncio.Queue(), asyncio.get_running_loop())
        with self._wake:
            if self._stopping or not self.alive:
                raise ShuttingDown("the server is shutting down")
            if self.engine.queue_depth + len(self._inbox) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting; retry later")
            self._inbox.append(sub)
            self._wake.notify()
        return sub

    def cancel(self, sub: Subscription) -> None:
        """End a request early (the client went away); harmless for a finished one."""
        with self._wake:
            sub.cancelled = True
            self._wake.notify()

    # ---------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while not self._idle_or_done():
                events = self._take_inbox()
                gone = [sub for sub in self._subs.values() if sub.cancelled]
                events += [e for sub in gone for e in self.engine.cancel(sub.rid)]
                if self.engine.has_work:
                    events += self.engine.step()
                self._deliver(events)
                for sub in gone:
                    self._subs.pop(sub.rid, None)
                self._gauges()
        except BaseException as e:                 # a failed step fails every open request, loudly
            self.failure = e
            for sub in list(self._subs.values()) + list(self._inbox):
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, e)

    def _idle_or_done(self) -> bool:
        """Wait while there is nothing to do; True when stopping with nothing left."""
        with self._wake:
            while not (self._inbox or self.engine.has_work or any(s.cancelled for s in self._subs.values())):
                if self._stopping:
                    return True
                self._wake.wait(self.idle_wait_s)
        return False

    def _take_inbox(self) -> list[StreamEvent]:
        with self._wake:
            taken, self._inbox = list(self._inbox), deque()
        events = []
        for sub in taken:
            try:
                sub.rid = self.engine.submit(sub.request)
            except ValueError as e:                # validated before, so this is a bug or a race
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, e)
                continue
            self._subs[sub.rid] = sub
            self.metrics.requests_started.inc()
            if sub.cancelled:
                events += self.engine.cancel(sub.rid)
        return events

    def _deliver(self, events: list[StreamEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            sub = self._subs.get(event.request)
            if sub is None:
                continue
            if event.token_id is not None:
                self._token_metrics(sub, now)
            if event.completion is not None:
                self._subs.pop(event.request, None)
                self.metrics.finished(event.completion)
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)

    def _token_metrics(self, sub: Subscription, now: float) -> None:
        if sub.last_token_at is None:
            self.metrics.ttft.observe(now - sub.submitted)
        else:
            self.metrics.inter_token.observe(now - sub.last_token_at)
        sub.last_token_at = now
        self.metrics.generation_tokens.inc()

    def _gauges(self) -> None:
        engine = self.engine
        self.metrics.requests_waiting.set(engine.queue_depth)
        self.metrics.requests_running.set(len(engine.running))
        self.metrics.slots_in_use.set(engine.config.n_slots - len(engine.free))
        self.metrics.prefix_hits.set(engine.stats.prefix_hits)
