"""Run an app under uvicorn with a drain step before uvicorn's own shutdown.

uvicorn runs the lifespan shutdown only after every connection has closed, so a long stream
would hold shutdown forever (or be cancelled without a final event). ``SpecServer`` therefore
drains first: new requests get 503, in-flight ones may finish within ``--shutdown-timeout``,
the rest are aborted with a proper final event; then uvicorn closes sockets as usual.
"""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.app import ServerState

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


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                access_log: bool = True) -> SpecServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_keep_alive=5, access_log=access_log)
    return SpecServer(config, app.state.specserve)
