"""A node's admin endpoints, and who may call them.

    GET  /v1/kvbridge/state                            engine stats, check_integrity(), in-flight counts
    POST /v1/kvbridge/reset_prefix_cache?timeout_s=30  drop the local prefix cache once the transfers
                                                       in flight when it was asked have ended

With an admin token (`kvbridge serve --admin-token-file PATH`, else KVBRIDGE_ADMIN_TOKEN) both need
`Authorization: Bearer <token>`; anything else is a 401. Without one they are open like the rest of
the API: nodes bind loopback by default, and `kvbridge serve` warns when a node binds another
address with no token. The token is compared in constant time and never logged.

The reset never holds the engine thread: it asks the engine, between two steps, to reset if nothing
it waits on is in flight (`EngineCore.try_reset_prefix_cache`), and otherwise sleeps on the event
loop and asks again, so other requests keep being served, until the last of those transfers ends
(or its lease expires) or `timeout_s` passes: then a 409 JSON error names what is still in flight.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvbridge.errors import ConfigError, InvalidRequestError
from kvbridge.serve import protocol
from kvbridge.serve.async_engine import AsyncEngine, EngineDeadError

RESET_TIMEOUT_S = 30.0  # default wait of reset_prefix_cache for the transfers in flight
MAX_RESET_TIMEOUT_S = 300.0
RESET_POLL_S = 0.01  # between two asks; the engine runs its steps in between
MAX_NAMED_REQUESTS = 20  # request ids a timeout error lists

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, err_type: str, param: str | None = None, **headers: str) -> web.Response:
    return web.json_response(protocol.error_body(message, err_type, status, param), status=status, headers=headers)


# ------------------------------------------------------------------ who may call them


def read_admin_token(path: str | None, env_token: str | None) -> str | None:
    """The admin token: the file's content (stripped) when a path is given, else `env_token`.
    Raises ConfigError for a file that cannot be read or is empty."""
    if path is None:
        return env_token
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--admin-token-file {path}: cannot read it ({type(exc).__name__})") from None
    if not token:
        raise ConfigError(f"--admin-token-file {path} is empty; write the token into it")
    return token


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, "localhost")."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def open_admin_warning(host: str, port: int, token: str | None) -> str | None:
    """What `kvbridge serve` warns at start-up when anyone beyond this machine may call the admin
    endpoints (a non-loopback bind without a token), else None."""
    if token is not None or is_loopback(host):
        return None
    return (
        f"the admin endpoints (/v1/kvbridge/state, /v1/kvbridge/reset_prefix_cache) are open to anyone who "
        f"reaches {host}:{port}; protect them with --admin-token-file PATH or KVBRIDGE_ADMIN_TOKEN"
    )


class AdminAuth:
    """Checks the bearer token of admin requests; open when there is no token."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def is_open(self) -> bool:
        return self._token is None

    def is_authorized(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    def guard(self, handler: Handler) -> Handler:
        """`handler`, answering 401 to a request without the token."""

        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not self.is_authorized(request):
                message = "this admin endpoint needs the node's admin token: send 'Authorization: Bearer <token>'"
                return _error(401, message, "authentication_error", **{"WWW-Authenticate": "Bearer"})
            return await handler(request)

        return guarded

    def __repr__(self) -> str:
        return f"AdminAuth(open={self.is_open})"  # never the token


# ------------------------------------------------------------------ the endpoints


def _state(core: Any) -> dict[str, Any]:
    """Runs on the engine thread: a consistent snapshot of the engine's bookkeeping."""
    try:
        core.check_integrity()
        integrity = {"ok": True, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a diagnostics endpoint
        integrity = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "stats": core.get_stats(),
        "integrity": integrity,
        "has_unfinished_requests": core.has_unfinished_requests(),
        "has_pending_transfers": core.has_pending_transfers(),
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)  # stats may hold non-JSON leaves (enums, tuples): say them as text


def parse_timeout(request: web.Request) -> float:
    """`?timeout_s=`: seconds in [0, MAX_RESET_TIMEOUT_S], default RESET_TIMEOUT_S."""
    raw = request.query.get("timeout_s")
    if raw is None:
        return RESET_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_RESET_TIMEOUT_S:  # NaN fails too
        expected = f"a number of seconds in [0, {MAX_RESET_TIMEOUT_S:g}]"
        raise InvalidRequestError(f"'timeout_s' must be {expected}, got {raw!r}", "timeout_s")
    return value


class AdminAPI:
    """The admin handlers of one node."""

    def __init__(self, engine: AsyncEngine, role: str) -> None:
        self.engine = engine
        self.role = role

    def _not_ready(self) -> web.Response | None:
        if self.engine.is_ready:
            return None
        return _error(503, "the engine is not ready; poll GET /health", "service_unavailable")

    async def state(self, request: web.Request) -> web.Response:
        if (not_ready := self._not_ready()) is not None:
            return not_ready
        try:
            state = await self.engine.call(_state)
        except EngineDeadError as exc:
            return _error(503, str(exc), "service_unavailable")
        return web.json_response({**state, "role": self.role, "num_running": self.engine.num_running}, dumps=_dumps)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if (not_ready := self._not_ready()) is not None:
            return not_ready
        try:
            timeout_s = parse_timeout(request)
        except InvalidRequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waiting_on: frozenset[str] | None = None  # first ask: whatever is in flight now
        while True:
            try:
                pending = await self.engine.call(lambda core, w=waiting_on: core.try_reset_prefix_cache(w))
            except EngineDeadError as exc:
                return _error(503, str(exc), "service_unavailable")
            if not pending:
                return web.json_response({"reset": True})
            waiting_on = pending
            if loop.time() >= deadline:
                return _error(409, _still_in_flight(pending, timeout_s), "transfers_in_flight")
            await asyncio.sleep(RESET_POLL_S)


def _still_in_flight(pending: frozenset[str], timeout_s: float) -> str:
    names = sorted(pending)
    listed = ", ".join(names[:MAX_NAMED_REQUESTS])
    if len(names) > MAX_NAMED_REQUESTS:
        listed += f" and {len(names) - MAX_NAMED_REQUESTS} more"
    return (
        f"reset_prefix_cache: after {timeout_s:g} s, KV transfers of {len(names)} request(s) are still in flight "
        f"({listed}); the prefix cache was left as it was. Retry later, or give a longer ?timeout_s= "
        f"(at most {MAX_RESET_TIMEOUT_S:g})"
    )
