"""The engine thread: one thread owns the scheduler and runs continuous batching; HTTP handlers talk to it
through thread-safe calls and receive their tokens on asyncio queues.

Every loop round applies the submissions and cancellations that arrived, then runs one scheduler step. A
cancelled request (running or still queued) is therefore stopped, and its slot and KV pages freed, before the
next step. If the loop itself fails, the worker is marked dead (/health answers 503) and every open request ends
with an error.

This module is the only place that calls the scheduler (`submit`, `cancel`, `step`, `running`, `pending`,
`idle`, `stats`); tokens may arrive in a later step() than the one that ran them, so nothing here assumes when
they come, only that each request ends with one event whose token is None.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.scheduler import Event, Request

log = logging.getLogger("jaxflash.server")


class QueueFull(RuntimeError):
    """More requests are waiting than the server accepts."""


@dataclass(eq=False)
class Ticket:
    """One request's channel between the engine thread and its HTTP handler."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    ended: bool = False  # the handler has seen the end event (set on the event loop)
    reason: str | None = None  # why the server cancelled it, when that is not "cancelled" (a stop string: "stop")

    def deliver(self, ev: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)


class EngineWorker:
    def __init__(self, scheduler, *, max_waiting: int = 256, metrics=None):
        self.engine, self.max_waiting, self.metrics = scheduler, max_waiting, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._tickets: dict[int, Ticket] = {}
        self.dead: str | None = None
        # The counts behind the gauges and the queue limit. The engine thread republishes them after each call
        # that changes them; submissions not yet taken in are counted under the same lock, so a scrape or an
        # admission decision never sees a request twice or not at all.
        self._lock = threading.Lock()
        self._unsent = 0
        self._running = 0
        self._pending = 0
        if metrics is not None:
            metrics.running.set_function(lambda: self.running)
            metrics.waiting.set_function(lambda: self.waiting)
        self._thread = threading.Thread(target=self._run, name="jaxflash-engine", daemon=True)
        self._thread.start()

    # ----- called from the HTTP side --------------------------------------------------------------------------
    def submit(self, req: Request) -> Ticket:
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        with self._lock:
            waiting = self._unsent + self._pending
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting")
            self._unsent += 1
        ticket = Ticket(req, asyncio.get_running_loop())
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket, reason: str | None = None) -> None:
        """Stop a request before the next step; `reason` is what the metrics count it as (default "cancelled")."""
        if not ticket.ended:
            if reason and ticket.reason is None:
                ticket.reason = reason
            self._inbox.put(("cancel", ticket))

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        """Requests not admitted yet: submissions the engine thread has not taken in, plus its pending queue."""
        with self._lock:
            return self._unsent + self._pending

    # ----- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = self.engine.idle
                while True:
                    try:
                        cmd, ticket = self._inbox.get(block=block, timeout=None)
                    except queue.Empty:
                        break
                    block = False
                    if cmd == "stop":
                        return
                    if cmd == "submit":
                        self._submit(ticket)
                    elif cmd == "cancel" and ticket.request.finish is None:
                        self._deliver_all(self.engine.cancel(ticket.request))
                        self._publish()
                if not self.engine.idle:
                    events = self.engine.step()
                    self._publish()
                    self._deliver_all(events)
                    self._update_hit_rate()
        except BaseException as e:  # noqa: BLE001 -- the engine is gone: tell everyone, then /health says so
            self.dead = f"{type(e).__name__}: {e}"
            log.exception("engine loop failed")
            with self._lock:
                self._unsent = self._running = self._pending = 0
            for t in list(self._tickets.values()):
                t.request.finish, t.request.error = "error", self.dead
                t.deliver(Event(t.request, None))

    def _publish(self, taken: int = 0) -> None:
        with self._lock:
            self._unsent -= taken
            self._running = len(self.engine.running)
            self._pending = len(self.engine.pending)

    def _submit(self, ticket: Ticket) -> None:
        req = ticket.request
        try:
            self.engine.submit(req)
        except ValueError as e:
            self._publish(taken=1)
            req.finish, req.error = "error", str(e)
            self._count_end(ticket)
            ticket.deliver(Event(req, None))
            return
        self._tickets[id(req)] = ticket
        self._publish(taken=1)

    def _deliver_all(self, events) -> None:
        now = time.perf_counter()
        for ev in events:
            t = self._tickets.get(id(ev.request))
            if t is None:
                continue
            if ev.token is not None:
                if self.metrics is not None:
                    if t.first_token is None:
                        self.metrics.ttft.observe(now - t.submitted)
                    elif t.last_token is not None:
                        self.metrics.itl.observe(now - t.last_token)
                    self.metrics.generation_tokens.inc()
                t.first_token = t.first_token or now
                t.last_token = now
            else:
                del self._tickets[id(ev.request)]
                self._count_end(t)
            t.deliver(ev)

    def _count_end(self, ticket: Ticket) -> None:
        if self.metrics is None:
            return
        req = ticket.request
        reason = req.finish or "unknown"
        if reason == "cancelled" and ticket.reason:
            reason = ticket.reason
        elif reason == "stop" and getattr(req.constraint, "failed", None):
            reason = "error"  # the grammar dead-ended: the engine stopped it, but it is no normal end
        if ticket.first_token is not None or req.finish in ("stop", "length"):  # it was prefilled
            self.metrics.prompt_tokens.inc(len(req.prompt))
        self.metrics.finished.labels(reason).inc()

    def _update_hit_rate(self) -> None:
        if self.metrics is None:
            return
        hr = self.engine.stats.hit_rate
        if hr is not None:
            self.metrics.hit_rate.set(hr)
