"""The engine thread: one thread owns the generator and runs continuous batching; HTTP handlers talk to it
through thread-safe calls and receive their tokens on asyncio queues.

Every loop round applies the submissions and cancellations that arrived, then runs one generator step
(admissions + one decode step for all running requests). A cancelled request is therefore stopped, and its
slot and KV pages freed, before the next step. If the loop itself fails, the worker is marked dead (/health
answers 503) and every open request ends with an error.
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

    def deliver(self, ev: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)


class EngineWorker:
    def __init__(self, generator, *, max_waiting: int = 256, metrics=None):
        self.gen, self.max_waiting, self.metrics = generator, max_waiting, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._tickets: dict[int, Ticket] = {}
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="jaxflash-engine", daemon=True)
        self._thread.start()

    # ----- called from the HTTP side --------------------------------------------------------------------------
    def submit(self, req: Request) -> Ticket:
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting")
        ticket = Ticket(req, asyncio.get_running_loop())
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        if ticket.request.finish is None:
            self._inbox.put(("cancel", ticket))

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return len(self.gen.running)

    @property
    def waiting(self) -> int:
        """Requests not admitted yet: commands the engine thread has not taken in (submissions, and the odd
        cancellation: an approximation on the safe side) plus its pending queue."""
        return self._inbox.qsize() + len(self.gen.pending)

    # ----- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = self.gen.idle
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
                        self._deliver_all(self.gen.cancel(ticket.request))
                if not self.gen.idle:
                    self._deliver_all(self.gen.step())
                    self._update_gauges()
        except BaseException as e:  # noqa: BLE001 -- the engine is gone: tell everyone, then /health says so
            self.dead = f"{type(e).__name__}: {e}"
            log.exception("engine loop failed")
            for t in list(self._tickets.values()):
                t.request.finish, t.request.error = "error", self.dead
                t.deliver(Event(t.request, None))

    def _submit(self, ticket: Ticket) -> None:
        req = ticket.request
        try:
            self.gen.submit(req)
        except ValueError as e:
            req.finish, req.error = "error", str(e)
            ticket.deliver(Event(req, None))
            return
        self._tickets[id(req)] = ticket

    def _deliver_all(self, events) -> None:
        now = time.perf_counter()
        for ev in events:
            t = self._tickets.get(id(ev.request))
            if t is None:
                continue
            if ev.token is not None and self.metrics is not None:
                if t.first_token is None:
                    self.metrics.ttft.observe(now - t.submitted)
                elif t.last_token is not None:
                    self.metrics.itl.observe(now - t.last_token)
                self.metrics.generation_tokens.inc()
            if ev.token is not None:
                t.first_token = t.first_token or now
                t.last_token = now
            if ev.token is None:
                del self._tickets[id(ev.request)]
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(ev.request.prompt))
                    self.metrics.finished.labels(ev.request.finish or "unknown").inc()
            t.deliver(ev)

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.running.set(len(self.gen.running))
        self.metrics.waiting.set(self.waiting)
        hr = self.gen.stats.hit_rate
        if hr is not None:
            self.metrics.hit_rate.set(hr)
