"""`kvbridge proxy`: the P/D router. Each completion goes to a prefill node, then to a decode node.

    kvbridge proxy --port 8000 --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 http://10.0.0.3:8200

Per request (docs/pd-disaggregation.md):
0. Validate the body as a node would (`parse_completion_request`): a request the decode node would
   refuse gets its 400 here, before a prefill node computes and holds anything for it.
1. POST the body to the next prefill node (round-robin) with `max_tokens=1`, `stream=false` and
   `kv_transfer_params={"do_remote_decode": true}`; its response carries `kv_transfer_params`
   naming the blocks it holds for us.
2. POST the original body to the next decode node with those params plus `do_remote_prefill:
   true`, and return its response (streamed through byte for byte when `stream` is set).
A node that is unreachable or answers 5xx gives a 502 that names it and its reason, a node that
does not answer within `--timeout` a 504; a 4xx from a node (the client's mistake) is passed
through unchanged. A client that hangs up closes the upstream connection, which aborts the
request on that node. When the decode leg fails for any of these reasons after the prefill leg
succeeded, the prefill node is told to free the blocks it holds for it (proxy_release.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvbridge import env
from kvbridge.errors import InvalidRequestError
from kvbridge.serve.protocol import decode_body as protocol_decode_body
from kvbridge.serve.protocol import error_body, parse_completion_request
from kvbridge.serve.proxy_release import LeaseReleaser

PREFILL_PARAMS = {"do_remote_decode": True}
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class RoundRobin:
    """Cycles over node base URLs; `next()` is called on the event loop thread only."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("give at least one node URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._cycle = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._cycle)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill node gets: compute the prompt, keep its KV for a decode node."""
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS)}
    leg.pop("stream_options", None)  # only valid with stream=true: vLLM refuses the leg with a 400
    return leg


def decode_body(body: dict[str, Any], prefill_kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The request a decode node gets: the client's body plus where to pull the prompt's KV from.
    Without params (a prefill node that runs no connector) the decode node computes the prompt."""
    kv = {**prefill_kv_params, "do_remote_prefill": True} if prefill_kv_params else None
    return {**body, "kv_transfer_params": kv}


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, status, param), status=status)


class NodeFailure(Exception):
    """An upstream node failed; `response` is what the client gets."""

    def __init__(self, response) -> None:
        super().__init__(response.text)
        self.response = response


class PDProxy:
    """The proxy's handlers and its one client session (created in `on_startup`)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0) -> None:
        self.prefill = RoundRobin(prefill_urls)
        self.decode = RoundRobin(decode_urls)
        self.timeout_s = timeout_s
        self.session = None
        self.num_requests = 0
        self.num_node_failures = 0
        self.releaser = LeaseReleaser(env.side_channel_secret())

    async def on_startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=self.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024))

    async def on_cleanup(self, app: web.Application) -> None:
        await self.releaser.drain()
        if self.session is not None:
            await self.session.close()

    async def _post(self, role: str, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST to a node; returns the open response, or raises NodeFailure with the client's answer."""
        try:
            resp = await self.session.post(f"{url}/v1/completions", json=body)
        except asyncio.TimeoutError:
            raise self._failure(504, f"{role} node {url} did not answer within {self.timeout_s:.0f}s") from None
        except aiohttp.ClientError as exc:
            raise self._failure(502, f"{role} node {url} is unreachable: {exc}") from None
        if resp.status < 400:
            return resp
        try:
            text = await resp.text()
        finally:
            resp.release()
        if resp.status < 500:  # the client's mistake: pass the node's answer through
            raise NodeFailure(web.Response(status=resp.status, text=text, content_type="application/json"))
        raise self._failure(502, f"{role} node {url} failed with HTTP {resp.status}: {_error_message(text)}")

    def _failure(self, status: int, message: str) -> NodeFailure:
        self.num_node_failures += 1
        return NodeFailure(error_response(status, message, "upstream_error"))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:  # the client's kv_transfer_params are replaced on both legs: not theirs to get wrong
            body = protocol_decode_body(await request.read())
            parse_completion_request({**body, "kv_transfer_params": None} if isinstance(body, dict) else body)
        except InvalidRequestError as exc:
            return error_response(400, str(exc), "invalid_request_error", exc.param)
        self.num_requests += 1
        prefill_url, decode_url = self.prefill.next(), self.decode.next()
        t0 = time.monotonic()
        try:
            resp = await self._post("prefill", prefill_url, prefill_body(body))
            try:
                prefill = await resp.json()
                if not isinstance(prefill, dict):
                    raise ValueError(f"a JSON {type(prefill).__name__}, not an object")
            except (*UPSTREAM_ERRORS, ValueError) as exc:
                raise self._failure(502, f"prefill node {prefill_url} sent a malformed response: {exc}") from None
            finally:
                resp.release()
        except NodeFailure as failure:
            return failure.response
        kv_params = prefill.get("kv_transfer_params")
        t1, decode_ok = time.monotonic(), False
        try:
            resp = await self._post("decode", decode_url, decode_body(body, kv_params))
            try:
                if body.get("stream"):
                    response, decode_ok = await _stream_through(request, resp)
                    return response
                result = await resp.json()
                decode_ok = True
            except (*UPSTREAM_ERRORS, ValueError) as exc:
                resp.close()
                return error_response(502, f"decode node {decode_url} failed mid-response: {exc}", "upstream_error")
            except BaseException:
                resp.close()  # the client hung up: drop the upstream connection so the decode node aborts
                raise
            finally:
                resp.release()
        except NodeFailure as failure:
            return failure.response
        finally:
            if not decode_ok:  # nobody will read what the prefill node holds for this request
                self.releaser.release_soon(kv_params)
        proxy_stats = {"prefill_url": prefill_url, "decode_url": decode_url, "prefill_s": round(t1 - t0, 6)}
        proxy_stats.update(decode_s=round(time.monotonic() - t1, 6), prefill_kvbridge=prefill.get("kvbridge"))
        if isinstance(result.get("kvbridge"), dict):
            result["kvbridge"]["proxy"] = proxy_stats
        return web.json_response(result)

    async def health(self, request: web.Request) -> web.Response:
        async def probe(url: str) -> str:
            try:
                async with self.session.get(f"{url}/health", timeout=PROBE_TIMEOUT) as resp:
                    return "ok" if resp.status == 200 else f"HTTP {resp.status}"
            except Exception as exc:  # noqa: BLE001 - a probe reports, it does not raise
                return f"unreachable: {type(exc).__name__}"

        prefill = await asyncio.gather(*(probe(u) for u in self.prefill.urls))
        decode = await asyncio.gather(*(probe(u) for u in self.decode.urls))
        ok = "ok" in prefill and "ok" in decode
        status = {
            "status": "ok" if ok else "degraded",
            "prefill": dict(zip(self.prefill.urls, prefill)),
            "decode": dict(zip(self.decode.urls, decode)),
            "num_requests": self.num_requests,
            "num_node_failures": self.num_node_failures,
            "num_kv_releases": self.releaser.num_released,
            "num_kv_release_failures": self.releaser.num_failed,
        }
        return web.json_response(status, status=200 if ok else 503)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


async def _stream_through(
    request: web.Request, upstream: aiohttp.ClientResponse
) -> tuple[web.StreamResponse, bool]:
    """Copy the decode node's SSE stream to the client as it arrives. Returns the response and
    whether the upstream stream ended normally."""
    response = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    complete = True
    try:
        async for data in upstream.content.iter_any():
            await response.write(data)
    except UPSTREAM_ERRORS as exc:
        complete = False
        message = json.dumps({"error": {"message": f"decode node failed mid-stream: {exc}", "code": 502}})
        await response.write(f"data: {message}\n\ndata: [DONE]\n\n".encode())
    await response.write_eof()
    return response, complete


PROXY_KEY = web.AppKey("proxy", PDProxy)


def create_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0) -> web.Application:
    """The proxy's aiohttp app; `app[PROXY_KEY]` is the PDProxy. Run it with handler_cancellation=True."""
    proxy = PDProxy(prefill_urls, decode_urls, timeout_s)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL", help="prefill nodes")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL", help="decode nodes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a node may stay silent")


def run(args: argparse.Namespace) -> int:
    app = create_proxy_app(args.prefill, args.decode, args.timeout)
    print(f"kvbridge proxy: ready on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None)
    except OSError as exc:
        print(f"kvbridge proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
