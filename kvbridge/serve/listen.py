"""What a node and the proxy share as HTTP servers: binding, the access log, running until a signal.

`bind(host, port)` takes the address before anything slow starts (a node's engine, the proxy's
health checks), so a busy port is reported at once as a `PortInUseError`. `serving(app, sock)`
runs the app on that socket with one access-log line per request (logger `kvbridge.access`, INFO)
and cleans up on exit; `stop_signal()` resolves to the name of the first SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from kvbridge.errors import PortInUseError

access_logger = logging.getLogger("kvbridge.access")

REQUEST_ID_HEADER = "X-Request-Id"
ROUTINE_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes


class AccessLogger(AbstractAccessLogger):
    """`POST /v1/completions 200 167.3 ms`, plus the client's X-Request-Id when it sent one.

    Only the method, the path (without its query string), the status and the duration are logged:
    never a header's value but the request id, never a body, so neither a token nor prompt text
    reaches the logs. `/health` and `/metrics` are logged at DEBUG: the proxy checks each node every few
    seconds (4 times a second while it starts), and monitoring scrapes, so at INFO they would drown
    the rest; a change of health is logged by the node and the proxy themselves.
    """

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        self.logger.log(
            logging.DEBUG if request.path in ROUTINE_PATHS else logging.INFO,
            "%s %s %d %.1f ms%s", request.method, request.path, response.status, time * 1e3,
            f" request_id={request_id!r}" if request_id else "",
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)  # DEBUG enabled implies INFO


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port). Raises PortInUseError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: restart at once
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use; stop what holds it or pick another --port") from None
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host and --port") from None
    return sock


@contextlib.asynccontextmanager
async def serving(app: web.Application, sock: socket.socket) -> AsyncIterator[None]:
    """Serve `app` on `sock` (from `bind`) inside the block; clean up (the app's on_cleanup) after."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log_class=AccessLogger, access_log=access_logger, shutdown_timeout=10.0
    )
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        yield
    finally:
        await runner.cleanup()


def stop_signal() -> asyncio.Future[str]:
    """A future of the running loop that SIGINT or SIGTERM resolves with the signal's name."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[str] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not stopped.done():
            stopped.set_result(sig.name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return stopped
