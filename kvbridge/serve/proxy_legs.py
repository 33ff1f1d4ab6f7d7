"""The proxy's side towards its nodes: one attempt at one node, and a leg's attempts over its nodes.

A leg (prefill or decode) tries the healthy nodes its routing policy picks, each at most once, until
one answers: at most 1 + `max_retries` attempts. An attempt ends in one of three ways:

    an answer ---------------------------------------------> the leg is done (the policy remembers the node)
    NodeFailed (unreachable, reset, 5xx, silent, malformed) -> the node is ejected; the next node is tried
    Reply (the node's 4xx: the client's mistake) ------------> passed to the client as it is, never retried

A decode attempt may fail only until the client has been sent a byte: from then on a failure ends
the stream with an error event. A request's Deadline bounds every attempt until its answer starts.
Each decode attempt asks for its body (`DecodeBody`) when its node is known: a request sent at once
(serve/proxy_dispatch.py) names its hand-off key to the node whose inbox the prefill offers to, and
the prefill's params to any other. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from kvbridge.serve.node_pool import NodePool
from kvbridge.serve.proxy_metrics import ProxyMetrics
from kvbridge.repeated_log import RepeatedWarnings
from kvbridge.serve.routing import PromptKey, RoutingPolicy

logger = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True}
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)


# Dropped from a prefill leg: `stream_options` is only valid with stream=true (vLLM refuses the leg
# with a 400), chat's `max_completion_tokens` would override the leg's one token, and the one token
# the leg samples is thrown away, so its logprobs are not worth computing.
NOT_FOR_PREFILL = ("stream_options", "max_completion_tokens", "logprobs", "top_logprobs")


def prefill_body(body: dict[str, Any], handoff: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request a prefill node gets: compute the prompt, keep its KV for a decode node, and with a
    `handoff` ({"key", "inbox"}) offer it to that decode's inbox. One token, so no min_tokens beyond
    it (a client's min_tokens is the decode leg's to honour)."""
    leg = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    params = {**PREFILL_PARAMS, **({"handoff": handoff} if handoff else {})}
    return {**leg, "max_tokens": 1, "min_tokens": 0, "stream": False, "kv_transfer_params": params}


def decode_body(body: dict[str, Any], prefill_kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The request a decode node gets: the client's body plus where to pull the prompt's KV from.
    Without params (no prefill node answered, or it runs no connector) the decode node computes the prompt."""
    kv = {**prefill_kv_params, "do_remote_prefill": True} if prefill_kv_params else None
    return {**body, "kv_transfer_params": kv}


class Reply(Exception):
    """The client's answer, now: a node's 4xx, passed through and never retried."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


class NodeFailed(Exception):
    """A node failed before it answered; the node is ejected and another may be tried.
    `status` is what the client gets if no other node answers: 502, or 504 for a silent node."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LegFailed(Exception):
    """No node of a leg answered: `failure` is the last attempt's, None when no node could be tried."""

    def __init__(self, role: str, failure: NodeFailed | None, num_attempts: int) -> None:
        super().__init__(f"{role}: {failure or 'no healthy node'} ({num_attempts} attempt(s))")
        self.role, self.failure, self.num_attempts = role, failure, num_attempts

    @property
    def is_busy(self) -> bool:
        """Whether the last node tried refused the request for now (HTTP 429: a prefill node whose
        leases are at their quota), rather than failing."""
        return self.failure is not None and self.failure.status == 429


class Leg(NamedTuple):
    role: str  # "prefill" | "decode"
    pool: NodePool
    policy: RoutingPolicy


# Called with a decode answer (the JSON answer, or a stream's chunk) that carries a `kvbridge` object,
# the decode node's URL and the attempt number: adds the proxy's own entry to that object. Applied to
# the JSON answer by the caller, to a stream's events as they pass.
Annotate = Callable[[dict[str, Any], str, int], None]
# The decode node's request, asked for once its node is chosen (the node's URL); it may wait for the
# prefill leg, before the attempt's deadline starts to count.
DecodeBody = Callable[[str], Awaitable[dict[str, Any]]]


class Answer(NamedTuple):
    url: str  # the node that answered
    value: Any
    num_attempts: int


class Deadline:
    """A request's deadline on the event loop's clock; `None` seconds: none."""

    def __init__(self, seconds: float | None) -> None:
        self.when = None if seconds is None else asyncio.get_running_loop().time() + seconds

    def timeout(self) -> asyncio.Timeout:
        """Raises TimeoutError out of the block once the deadline passes (at once when it has)."""
        return asyncio.timeout_at(self.when)


class Upstream:
    """The proxy's client to its nodes: one session (`start`), the two legs and their attempts."""

    def __init__(self, prefill: Leg, decode: Leg, timeout_s: float, max_retries: int, metrics: ProxyMetrics) -> None:
        self.prefill_leg, self.decode_leg = prefill, decode
        self.timeout_s, self.max_retries, self.metrics = timeout_s, max_retries, metrics
        self.session: aiohttp.ClientSession | None = None
        self._warnings = RepeatedWarnings(logger)  # one dead prefill node: one line, not one per request

    async def start(self) -> None:
        """Open the session and start checking the nodes (each is checked once before this returns)."""
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=self.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024))
        await asyncio.gather(self.prefill_leg.pool.start(self.session), self.decode_leg.pool.start(self.session))

    async def close(self) -> None:
        for leg in (self.prefill_leg, self.decode_leg):
            await leg.pool.close()
        if self.session is not None:
            await self.session.close()

    def _node_failed(self, leg: Leg, url: str, status: int, message: str) -> NodeFailed:
        leg.pool.report_failure(url, message)
        return NodeFailed(status, message)

    async def _open(self, leg: Leg, url: str, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST to a node's `path`; returns the open response of a 2xx/3xx. Raises NodeFailed or Reply (a 4xx)."""
        try:
            resp = await self.session.post(f"{url}{path}", json=body)
        except TimeoutError:
            raise self._node_failed(leg, url, 504, f"{leg.role} node {url} did not answer within {self.timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise self._node_failed(leg, url, 502, f"{leg.role} node {url} is unreachable: {exc}") from None
        if resp.status < 400:
            return resp
        try:
            text = await resp.text()
        except UPSTREAM_ERRORS as exc:
            text = f"(its answer broke off: {type(exc).__name__})"
        finally:
            resp.release()
        if resp.status == 429:  # the node is busy (a prefill full of leases): another node, without ejecting it
            raise NodeFailed(429, f"{leg.role} node {url} refused the request for now (HTTP 429): {_error_message(text)}")
        if resp.status < 500:  # the client's mistake: pass the node's answer through
            raise Reply(web.Response(status=resp.status, text=text, content_type="application/json"))
        raise self._node_failed(leg, url, 502, f"{leg.role} node {url} failed with HTTP {resp.status}: {_error_message(text)}")

    async def _read_json(self, leg: Leg, url: str, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        try:
            result = await resp.json()
            if not isinstance(result, dict):
                raise ValueError(f"a JSON {type(result).__name__}, not an object")
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            raise self._node_failed(leg, url, 502, f"{leg.role} node {url} sent a malformed response: {exc}") from None
        return result

    def choose_decode(self, prompt: PromptKey) -> str | None:
        """The decode node the routing policy picks now (None: no healthy one); pass it to `decode`
        as `first`, so that the policy chooses once."""
        candidates = self.decode_leg.pool.candidates()
        return self.decode_leg.policy.choose(candidates, prompt) if candidates else None

    async def _on_some_node(
        self, leg: Leg, prompt: PromptKey, attempt: Callable[[str], Awaitable[Any]], first: str | None = None
    ) -> Answer:
        """`attempt(url)` on the leg's healthy nodes in routing order (`first` first, while it is a
        candidate), each at most once, until one does not raise NodeFailed: at most 1 + max_retries
        attempts. Raises LegFailed."""
        tried: list[str] = []
        failure = None
        while len(tried) <= self.max_retries and (candidates := leg.pool.candidates(exclude=tried)):
            chosen = not tried and any(c.url == first for c in candidates)
            url = first if chosen else leg.policy.choose(candidates, prompt)
            if tried:
                self.metrics.retries.labels(leg=leg.role).inc()
            tried.append(url)
            try:
                with leg.pool.attempt(url):
                    value = await attempt(url)
            except NodeFailed as exc:
                failure = exc
                continue
            leg.policy.remember(url, prompt)
            return Answer(url, value, len(tried))
        raise LegFailed(leg.role, failure, len(tried))

    # ------------------------------------------------------------------ the two legs

    async def _prefill_on(
        self, url: str, path: str, body: dict[str, Any], deadline: Deadline, handoff: dict[str, Any] | None
    ) -> dict[str, Any]:
        async with deadline.timeout():
            resp = await self._open(self.prefill_leg, url, path, prefill_body(body, handoff))
            try:
                return await self._read_json(self.prefill_leg, url, resp)
            finally:
                resp.release()

    async def prefill(
        self, path: str, body: dict[str, Any], prompt: PromptKey, deadline: Deadline, handoff: dict[str, Any] | None = None
    ) -> Answer | LegFailed:
        """The prefill node's answer to `body` at `path` (a completions route), or the LegFailed that
        says why no prefill node gave one (the decode node then computes the prompt). Every attempt asks
        for the same `handoff`, if any (one key: the decode's inbox takes the first offer under it)."""
        try:
            attempt = functools.partial(self._prefill_on, path=path, body=body, deadline=deadline, handoff=handoff)
            return await self._on_some_node(self.prefill_leg, prompt, attempt)
        except LegFailed as exc:
            self.metrics.recompute_fallbacks.inc()
            self._warnings.warning("no_prefill_node", "no prefill node answered (%s): the decode node computes the prompt", exc)
            return exc

    async def decode(
        self, request: web.Request, path: str, body: DecodeBody, prompt: PromptKey, deadline: Deadline,
        annotate: Annotate, first: str | None = None,
    ) -> Answer:  # fmt: skip
        """The decode leg at `path`, `body(url)` the request of each attempt (KV params included), on
        `first` first when it is given and healthy. The answer's value: (the JSON answer, or the stream
        already relayed to the client, its events passed through `annotate`; whether it arrived whole).
        Raises LegFailed, Reply, or TimeoutError at the deadline."""
        attempt = functools.partial(self._decode_on, request=request, path=path, body_for=body, deadline=deadline,
                                    annotate=annotate, attempts=itertools.count(1))  # fmt: skip
        return await self._on_some_node(self.decode_leg, prompt, attempt, first)

    async def models(self) -> web.Response:
        """A healthy decode node's /v1/models. Raises LegFailed."""

        async def fetch(url: str) -> web.Response:
            try:
                async with self.session.get(f"{url}/v1/models") as resp:
                    raw = await resp.read()
            except UPSTREAM_ERRORS as exc:
                raise self._node_failed(self.decode_leg, url, 502, f"decode node {url} is unreachable: {exc}") from None
            if resp.status >= 500:
                raise self._node_failed(self.decode_leg, url, 502, f"decode node {url} failed with HTTP {resp.status}")
            return web.Response(status=resp.status, body=raw, content_type="application/json")

        return (await self._on_some_node(self.decode_leg, (), fetch)).value

    async def _decode_on(
        self, url: str, request: web.Request, path: str, body_for: DecodeBody, deadline: Deadline,
        annotate: Annotate, attempts: itertools.count,
    ) -> tuple[dict[str, Any] | web.StreamResponse, bool]:  # fmt: skip
        """The decode node's answer (a JSON object, or the stream relayed to the client) and whether
        it arrived whole. NodeFailed only until the client has been sent a byte."""
        attempt_no = next(attempts)
        body = await body_for(url)
        resp = None
        try:
            async with deadline.timeout():
                resp = await self._open(self.decode_leg, url, path, body)
                if not body.get("stream"):
                    return await self._read_json(self.decode_leg, url, resp), True
                try:
                    first = await resp.content.readany()
                except UPSTREAM_ERRORS as exc:
                    raise self._node_failed(self.decode_leg, url, 502, f"decode node {url} failed before it answered: {exc}") from None
                if not first:
                    raise self._node_failed(self.decode_leg, url, 502, f"decode node {url} ended its stream before it answered")
            events = _AnnotatedEvents(lambda chunk: annotate(chunk, url, attempt_no))
            return await self._relay(request, resp, first, url, events)
        except BaseException:
            if resp is not None:
                resp.close()  # a failure or a client that hung up: drop the connection so the node aborts
            raise
        finally:
            if resp is not None:
                resp.release()

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, first: bytes, url: str, events: _AnnotatedEvents
    ) -> tuple[web.StreamResponse, bool]:
        """Copy the decode node's SSE stream to the client event by event as it arrives, `first`
        bytes first, the `kvbridge` objects annotated."""
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        data = first
        while data:
            if whole := events.feed(data):
                await response.write(whole)  # a client that hung up raises here: not the node's failure
            try:
                data = await upstream.content.readany()
            except UPSTREAM_ERRORS as exc:
                # aiohttp's own words (TransferEncodingError, "Not enough data to satisfy ...") go to the
                # log; the client learns which node failed and that its answer is incomplete.
                logger.warning("decode node %s failed mid-stream: %s: %s", url, type(exc).__name__, exc)
                failure = (
                    f"decode node {url} failed mid-stream: its connection broke before the answer ended (the node "
                    "stopped or crashed); the text above is incomplete, retry the request"
                )
                self.decode_leg.pool.report_failure(url, failure)
                await response.write(sse_error(failure, "upstream_error", 502) + b"data: [DONE]\n\n")
                await response.write_eof()
                return response, False
        try:
            if tail := events.rest():
                await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client hung up after the last event: the answer was whole all the same
        return response, True


class _AnnotatedEvents:
    """Cuts a server-sent event stream into whole events and passes each on byte for byte, except
    the JSON events that carry a `kvbridge` object, which go through `annotate` first."""

    def __init__(self, annotate: Callable[[dict[str, Any]], None]) -> None:
        self._annotate = annotate
        self._partial = b""

    def feed(self, data: bytes) -> bytes:
        """The events that `data` completes (possibly none)."""
        *whole, self._partial = (self._partial + data).split(b"\n\n")
        return b"".join(self._annotated(event) + b"\n\n" for event in whole)

    def rest(self) -> bytes:
        """Bytes after the last whole event, at the stream's end."""
        rest, self._partial = self._partial, b""
        return rest

    def _annotated(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"kvbridge"' not in event:
            return event
        try:
            chunk = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event
        if not isinstance(chunk, dict) or not isinstance(chunk.get("kvbridge"), dict):
            return event
        self._annotate(chunk)
        return b"data: " + json.dumps(chunk).encode()


def sse_error(message: str, error_type: str, code: int) -> bytes:
    """An OpenAI-shaped error event of a stream."""
    return f"data: {json.dumps({'error': {'message': message, 'type': error_type, 'param': None, 'code': code}})}\n\n".encode()


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]
