"""OpenAI-shaped JSON errors for a node's and the proxy's HTTP routes.

`error_response` builds one; `openai_errors(served)` is the aiohttp middleware that turns aiohttp's
own 4xx (no such route, a wrong method, a body too large) into them, naming what is `served`, and
(with `catch_handler_errors`) answers a handler's bug with a 500 in the same shape.
"""

from __future__ import annotations

import logging

from aiohttp import web

from kvbridge.serve.protocol import error_body

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, status, param), status=status)


def openai_errors(served: str, catch_handler_errors: bool = False):
    """The middleware; `served` ends a 404's message, e.g. "this node serves POST /v1/completions, ..."."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{request.method} {request.path}: {exc.reason}"
            if isinstance(exc, web.HTTPNotFound):
                message += f"; {served}"
            response = error_response(exc.status, message, "invalid_request_error")
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Exception as exc:
            if not catch_handler_errors:
                raise
            logger.exception("%s %s raised", request.method, request.path)  # a bug answers JSON too
            return error_response(500, f"{request.method} {request.path} failed: {type(exc).__name__}: {exc}",
                                  "internal_error")  # fmt: skip

    return middleware
