"""Run an app under uvicorn with a drain step before uvicorn's own shutdown.

uvicorn runs the lifespan shutdown only after every connection has closed, so a long stream
would hold shutdown forever (or be cancelled without a final event). ``SpecServer`` therefore
drains first: new requests get 503, in-flight ones may finish within ``--shutdown-timeout``,
the rest are aborted with a final error event (503); then uvicorn closes sockets as usual.

Slow clients: uvicorn bounds idle keep-alive connections but not a request whose headers
trickle in, so ``GuardedH11Protocol`` closes a connection (after a 408) whose request headers
are not complete ``header_timeout`` seconds after its first byte (or after the connection
opened), and answers requests h11 cannot parse with a JSON 400 instead of uvicorn's plain
text. Bodies are bounded by ``read_json``'s timeout. ``--limit-concurrency`` is enforced by
``ConcurrencyLimitMiddleware`` (JSON 503s, in-flight requests only), not by uvicorn's
``limit_concurrency``: that one counts idle connections too, answers in plain text, and
refuses requests rather than connections, so it bounds nothing the timeouts do not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.app import ServerState
from server.errors import error_body

log = logging.getLogger("specserve.server")


class SpecServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0

    def request_exit(self, code: int) -> None:
        """Stop serving (from the event loop), exiting the process with ``code``."""
        self.exit_code = max(self.exit_code, code)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # SIGTERM is the normal way to stop us (Docker, Kubernetes): drain and exit with our
        # own code. uvicorn would re-raise it after shutdown, ending the process "killed by
        # SIGTERM" (status 143) instead. Ctrl-C keeps uvicorn's behaviour.
        if sig == signal.SIGTERM:
            log.info("SIGTERM received: draining (shutdown timeout %.1fs)",
                     self.state.config.shutdown_timeout)
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await self.state.drain(self.state.config.shutdown_timeout)
        except Exception:
            log.exception("draining failed")
        await super().shutdown(sockets)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request's headers."""

    header_timeout = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of an unfinished request head have arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer(partial=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:  # the first bytes of a new request's head
                self._arm_header_timer(partial=True)
            self._partial = True  # (a fresh connection keeps its deadline from connecting)
        else:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_header_timer()  # an idle connection is the keep-alive timer's business

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line, header or framing): uvicorn answers
        400 in plain text; answer it in the OpenAI error shape like every other refusal."""
        body = json.dumps(error_body(f"Invalid HTTP request: {msg}", 400)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_header_timer(self, partial: bool) -> None:
        self._cancel_header_timer()
        self._partial = partial
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._partial:  # never sent a byte: just close (nobody waits for an answer)
            self.transport.close()
            return
        body = json.dumps(error_body(
            f"The request headers were not received within {self.header_timeout:g} seconds",
            408)).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)
        self.transport.close()


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                access_log: bool = True) -> SpecServer:
    state: ServerState = app.state.specserve
    cfg = state.config
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout": cfg.header_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=protocol, timeout_keep_alive=cfg.timeout_keep_alive,
                            access_log=access_log)
    return SpecServer(config, state)
