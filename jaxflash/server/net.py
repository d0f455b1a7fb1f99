"""uvicorn settings for a server exposed to careless clients.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) but not a request whose headers trickle in,
so a client could hold connections open forever by sending a byte now and then. The protocol below closes a
connection whose next request's headers have not all arrived within `header_timeout` seconds of the
connection opening or of the previous response ending. (Slow bodies are timed by the app: see api.py.)
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def _protocol(header_timeout: float) -> type:
    class HeaderDeadline(AutoHTTPProtocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            busy = self.cycle is not None and not self.cycle.response_complete  # its headers have arrived
            if not busy and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000, header_timeout: float = 10.0, **kwargs):
    """A uvicorn.Config for `app` with the header deadline; other keyword arguments go to uvicorn.Config."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=_protocol(header_timeout), **kwargs)
