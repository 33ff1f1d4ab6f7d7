"""`kvbridge proxy`: the P/D router. Each completion or chat completion goes to a prefill node and
to a decode node: in turn, or both at once once the decode node's hand-off inbox is known.

    kvbridge proxy --port 8000 --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 http://10.0.0.3:8200

Per request to POST /v1/completions or /v1/chat/completions (docs/pd-disaggregation.md, "Failure
model of the proxy"); each leg posts to the same route of its node:
0. Validate the body as a node would (`parse_completion_request`, `parse_chat_request`): a request
   the decode node would refuse gets its 400 here, before a prefill node computes and holds anything
   for it. With no healthy decode node, answer 503 at once. A request for several choices (`n` > 1)
   or several prompts skips step 1: a P/D hand-off moves one engine request's KV, so the decode node
   computes those prompts itself (`kvbridge.proxy.disaggregated` is false in the answer).
1. Prefill leg: POST the body to a healthy prefill node (serve/routing.py picks it) with
   `max_tokens=1`, `stream=false` and `kv_transfer_params={"do_remote_decode": true}`; its answer
   carries `kv_transfer_params` naming the blocks it holds for us. A node that fails before it
   answers is ejected (serve/node_pool.py) and another tried (serve/proxy_legs.py); when none
   answers, the decode node gets the request without KV params and computes the prompt itself.
2. Decode leg: POST the original body to a healthy decode node with those params plus
   `do_remote_prefill: true`, and return its answer (a stream is copied through as it arrives).
   A decode node that fails before the client was sent a byte is ejected and the next one gets the
   same params (a lease is not bound to its reader: see the docs).
At once (serve/proxy_dispatch.py; `--dispatch auto`, the default, when the decode node the routing
picks has named a fresh hand-off inbox in an earlier answer): steps 1 and 2 start together under a
hand-off key, the prefill offers its params straight to the decode's inbox, and the prefill's
answer no longer gates the decode leg.
A node's 4xx (the client's mistake) is passed through unchanged and never retried. No attempt starts
after the request's `--deadline`. When the decode leg ends without a whole answer, the prefill node
is told to free the blocks it holds for the request (proxy_release.py). A client that hangs up
closes the upstream connection, which aborts the request on that node.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from aiohttp import web

from kvbridge.cli_errors import error_line
from kvbridge.errors import ConfigError, InvalidRequestError
from kvbridge.serve.chat_protocol import parse_chat_request
from kvbridge.serve.node_pool import (
    CHECK_INTERVAL_S, CHECK_TIMEOUT_S, MAX_BACKOFF_S, MIN_BACKOFF_S, SILENT_CHECKS, NodePool, NodeState, NodeStats,
)
from kvbridge.serve.protocol import decode_body as protocol_decode_body
from kvbridge.serve.http_errors import error_response, openai_errors
from kvbridge.serve.protocol import parse_completion_request
from kvbridge.serve.proxy_dispatch import DISPATCHES, Dispatcher
from kvbridge.serve.proxy_legs import Deadline, Leg, LegFailed, Reply, Upstream, decode_body
from kvbridge.serve.proxy_metrics import CONTENT_TYPE, ProxyMetrics
from kvbridge.serve.proxy_release import LeaseReleaser
from kvbridge.serve.proxy_report import kv_source, recompute_reason
from kvbridge.serve.routing import ROUTINGS, PromptKey, make_policies, prompt_key
from kvbridge.transfer.host_secret import side_channel_secret

MAX_RETRIES = 2
# Chat's default max_tokens is the node's max_model_len, which the proxy does not know: it validates
# with no bound, and the decode node applies its own.
UNBOUNDED_MAX_TOKENS = sys.maxsize


class Routed(NamedTuple):
    """How the proxy routes a validated request."""

    prompt: PromptKey  # for prefix affinity
    disaggregated: bool  # one prompt, one choice: prefill node then decode node


def _route_completion(body: Any) -> Routed:
    parsed = parse_completion_request(body)
    single = len(parsed.prompts) == 1 and parsed.fields.n == 1
    return Routed(prompt_key(parsed.prompt_text, parsed.prompt_token_ids), single)


def _route_chat(body: Any) -> Routed:
    """The proxy renders no chat template: the messages' roles and text stand in for the prompt, and
    conversations that share their first messages share a prefix key."""
    parsed = parse_chat_request(body, default_max_tokens=UNBOUNDED_MAX_TOKENS)
    text = "".join(f"{m['role']}: {m['content'] or ''}\n" for m in parsed.messages)
    return Routed(prompt_key(text, None), parsed.fields.n == 1)


# The routes the proxy serves, each with its validation; a leg posts to the same route of its node.
ROUTES: dict[str, Callable[[Any], Routed]] = {"/v1/completions": _route_completion, "/v1/chat/completions": _route_chat}

logger = logging.getLogger(__name__)


class PDProxy:
    """The proxy's handlers over its node pools; the upstream session is opened in `on_startup`."""

    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0, *,
        routing: str = "load-prefix", max_retries: int = MAX_RETRIES, deadline_s: float | None = None,
        check_interval_s: float = CHECK_INTERVAL_S, max_backoff_s: float = MAX_BACKOFF_S, silent_checks: int = SILENT_CHECKS,
        insecure_side_channel: bool = False, dispatch: str = "auto",
    ) -> None:  # fmt: skip
        if max_retries < 0 or timeout_s <= 0 or check_interval_s <= 0 or (deadline_s is not None and deadline_s <= 0):
            raise ConfigError("--timeout, --deadline and --health-interval must be positive, --max-retries at least 0")
        if max_backoff_s < MIN_BACKOFF_S:
            raise ConfigError(f"--max-probe-backoff must be at least {MIN_BACKOFF_S:g} s, the first wait of an ejected node")
        if silent_checks < 1:
            raise ConfigError(f"--silent-checks must be at least 1, got {silent_checks}")
        checks = {"check_interval_s": check_interval_s, "max_backoff_s": max_backoff_s, "silent_checks": silent_checks}
        prefill_pool, decode_pool = NodePool("prefill", prefill_urls, **checks), NodePool("decode", decode_urls, **checks)
        prefill_policy, decode_policy = make_policies(routing, prefill_pool.urls, decode_pool.urls)
        self.prefill_pool, self.decode_pool = prefill_pool, decode_pool
        self.routing, self.deadline_s = routing, deadline_s
        self.num_requests = 0
        # releases are signed like the nodes' own requests: the configured secret, else this user's host secret
        secret = side_channel_secret(insecure_side_channel)
        self.releaser = LeaseReleaser(secret)
        self.metrics = ProxyMetrics(self._node_stats, lambda: (self.releaser.num_released, self.releaser.num_failed))
        self.upstream = Upstream(
            Leg("prefill", prefill_pool, prefill_policy), Leg("decode", decode_pool, decode_policy), timeout_s, max_retries,
            self.metrics,
        )  # fmt: skip
        self.dispatcher = Dispatcher(dispatch, self.upstream, decode_pool, self.releaser, secret)

    def _node_stats(self) -> list[NodeStats]:
        return self.prefill_pool.snapshot() + self.decode_pool.snapshot()

    @property
    def num_node_failures(self) -> int:
        return sum(node.num_failures for node in self._node_stats())

    def check_integrity(self) -> None:
        """Both node pools' bookkeeping holds (NodePool.check_integrity)."""
        self.prefill_pool.check_integrity()
        self.decode_pool.check_integrity()

    async def on_startup(self, app: web.Application) -> None:
        await self.upstream.start()

    async def on_cleanup(self, app: web.Application) -> None:
        self.dispatcher.close()
        await self.upstream.close()
        await self.releaser.drain()

    # ------------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions."""
        path = request.path
        try:  # the client's kv_transfer_params are replaced on both legs: not theirs to get wrong
            body = protocol_decode_body(await request.read())
            routed = ROUTES[path]({**body, "kv_transfer_params": None} if isinstance(body, dict) else body)
        except InvalidRequestError as exc:
            self.metrics.requests.labels(outcome="client_error").inc()
            return error_response(400, str(exc), "invalid_request_error", exc.param)
        self.num_requests += 1
        outcome = "aborted"  # until an answer is made: a client that hangs up leaves it so
        try:
            try:
                response = await self._complete(request, path, body, routed)
            except Reply as reply:
                response = reply.response
            except TimeoutError:
                message = f"no node answered within the request's deadline ({self.deadline_s:g}s)"
                response = error_response(504, message, "upstream_error")
            outcome = _outcome(response.status)
            return response
        finally:
            self.metrics.requests.labels(outcome=outcome).inc()

    async def _complete(
        self, request: web.Request, path: str, body: dict[str, Any], routed: Routed
    ) -> web.StreamResponse:
        """Both legs (the decode leg only, for a request that is not disaggregated). Raises Reply (a
        node's 4xx) and TimeoutError (the deadline)."""
        if not self.decode_pool.has_healthy():
            return self._leg_failed(LegFailed("decode", None, 0))
        deadline = Deadline(self.deadline_s)
        first, handoff = self.dispatcher.plan(routed.prompt) if routed.disaggregated else (None, None)
        prefill = None
        if routed.disaggregated:
            self.metrics.dispatches.labels(mode="in_turn" if handoff is None else "at_once").inc()
            handoff_params = handoff.prefill_params() if handoff else None
            task = asyncio.create_task(self.upstream.prefill(path, body, routed.prompt, deadline, handoff_params))
            prefill = self.dispatcher.prefill_leg(task, handoff)
            if handoff is None:
                await task  # in turn: the decode leg starts from its answer
        t1, complete = time.monotonic(), False
        reasons: dict[str, str | None] = {}  # decode URL -> why its answer computed the prompt (None: it read it)

        async def body_for(url: str) -> dict[str, Any]:
            if handoff is not None and url == handoff.decode_url:  # tried once: each node at most once a leg
                return {**body, "kv_transfer_params": handoff.decode_params()}
            return decode_body(body, await prefill.wait_params() if prefill else None)

        def annotate(answer: dict[str, Any], decode_url: str, decode_attempts: int) -> None:
            # What the decode node did, from its own report: never inferred from what the proxy sent.
            kvbridge = answer["kvbridge"]
            self.dispatcher.learn(decode_url, answer.get("kv_transfer_params"))
            reason = prefill.recompute_reason(kvbridge) if prefill else recompute_reason(False, False, None, kvbridge)
            source = kv_source(reason, kvbridge)
            if reason is not None:
                self.metrics.recomputes.labels(reason=reason).inc()
            reasons[decode_url] = reason
            answered = prefill.answer() if prefill else None
            kvbridge["proxy"] = {
                "dispatch": None if prefill is None else "in_turn" if handoff is None else "at_once",
                "prefill_url": answered.url if answered else None,
                "decode_url": decode_url,
                "prefill_attempts": answered.num_attempts if answered else None,
                "decode_attempts": decode_attempts,
                "disaggregated": reason is None and source == "prefill_node",
                "recomputed": reason is not None,
                "recompute_reason": reason,
                "kv_source": source,
                "kv_load_error": kvbridge.get("kv_load_error"),  # the decode node's own words, when a load failed
                "prefill_s": None if prefill is None or prefill.seconds is None else round(prefill.seconds, 6),
                "decode_s": round(time.monotonic() - t1, 6),
                "prefill_kvbridge": answered.value.get("kvbridge") if answered else None,
            }

        decode = None
        try:
            decode = await self.upstream.decode(request, path, body_for, routed.prompt, deadline, annotate, first)
            response, complete = decode.value
            if not isinstance(response, web.StreamResponse) and isinstance(response.get("kvbridge"), dict):
                annotate(response, decode.url, decode.num_attempts)
        except LegFailed as exc:
            return self._leg_failed(exc)
        finally:
            if prefill is not None:
                decode_url = decode.url if complete else None
                self.dispatcher.settle(prefill, decode_url, reasons.get(decode_url))
        if isinstance(response, web.StreamResponse):
            return response
        return web.json_response(response)

    def _leg_failed(self, exc: LegFailed) -> web.Response:
        if exc.failure is None:
            pool = self.prefill_pool if exc.role == "prefill" else self.decode_pool
            down = "; ".join(f"{n.url}: {n.last_error}" for n in pool.snapshot())
            return error_response(503, f"no {exc.role} node is healthy ({down}); retry later", "service_unavailable")
        tried = f" ({exc.num_attempts} {exc.role} node(s) tried)" if exc.num_attempts > 1 else ""
        return error_response(exc.failure.status, f"{exc.failure}{tried}", "upstream_error")

    # ------------------------------------------------------------------ the other routes

    async def models(self, request: web.Request) -> web.Response:
        """A healthy decode node's /v1/models: the model the decode nodes serve."""
        try:
            return await self.upstream.models()
        except LegFailed as exc:
            return self._leg_failed(exc)

    async def health(self, request: web.Request) -> web.Response:
        """200 while a decode node is healthy (the proxy can answer completions), else 503."""
        nodes = self._node_stats()
        can_serve = self.decode_pool.has_healthy()
        all_healthy = all(n.state is NodeState.HEALTHY for n in nodes)
        status = {
            "status": "ok" if all_healthy else "degraded" if can_serve else "unavailable",
            "routing": self.routing,
            "prefill": {n.url: _node_status(n) for n in nodes if n.role == "prefill"},
            "decode": {n.url: _node_status(n) for n in nodes if n.role == "decode"},
            "num_requests": self.num_requests,
            "num_node_failures": self.num_node_failures,
            "num_kv_releases": self.releaser.num_released,
            "num_kv_release_failures": self.releaser.num_failed,
        }
        return web.json_response(status, status=200 if can_serve else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _node_status(node: NodeStats) -> str:
    if node.state is not NodeState.HEALTHY:
        return f"ejected: {node.last_error}"
    if node.num_silent_checks:
        return f"suspect: {node.num_silent_checks} health check(s) in a row unanswered; used only when no other node answers"
    return "ok"


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return {502: "upstream_error", 503: "unavailable", 504: "timeout"}.get(status, "client_error")


PROXY_SERVES = "the proxy serves POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health and /metrics"
PROXY_KEY = web.AppKey("proxy", PDProxy)


def create_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0, **options: Any) -> web.Application:
    """The proxy's aiohttp app; `app[PROXY_KEY]` is the PDProxy (`options`: its keyword arguments).
    Run it with handler_cancellation=True."""
    proxy = PDProxy(prefill_urls, decode_urls, timeout_s, **options)
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[openai_errors(PROXY_SERVES)])
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    for path in ROUTES:
        app.router.add_post(path, proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_text)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL", help="prefill nodes")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL", help="decode nodes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a node may stay silent")
    parser.add_argument(
        "--routing", choices=ROUTINGS, default="load-prefix",
        help="load-prefix: prefill by prompt-prefix affinity within a bounded load, decode to the least loaded; "
        "round-robin: in turn",
    )  # fmt: skip
    parser.add_argument("--max-retries", type=int, default=MAX_RETRIES, help="other nodes tried per leg after a failure")
    parser.add_argument(
        "--dispatch", choices=DISPATCHES, default="auto",
        help="auto: send the prefill and decode legs at once when the chosen decode node named its hand-off inbox "
        "in an answer (NixlConnector option handoff_inbox) and its proof has over 30 s left, else in turn, which "
        "teaches the proxy the inbox; in-turn: always the prefill leg first, the decode leg with its answer's params",
    )  # fmt: skip
    parser.add_argument(
        "--deadline", type=float, default=None, metavar="SECONDS",
        help="per request: no attempt starts after it, and a request without an answer by then gets a 504 (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--health-interval", type=float, default=CHECK_INTERVAL_S, help="seconds between health checks of a healthy node"
    )
    parser.add_argument(
        "--max-probe-backoff", type=float, default=MAX_BACKOFF_S,
        help="longest wait between health checks of an ejected node (they start at 0.25 s and double)",
    )  # fmt: skip
    parser.add_argument(
        "--insecure-side-channel", action="store_true",
        help="release leases on nodes that run --insecure-side-channel: sign nothing when "
        "KVBRIDGE_SIDE_CHANNEL_SECRET is unset (default: this user's host secret, as the nodes use)",
    )  # fmt: skip
    parser.add_argument(
        "--silent-checks", type=int, default=SILENT_CHECKS,
        help=f"health checks in a row that a healthy node may leave unanswered for {CHECK_TIMEOUT_S:g} s before it "
        "is ejected (a refused or failed check ejects it at once)",
    )  # fmt: skip


async def serve(app: web.Application, sock, url: str) -> None:
    """Serve the proxy app on `sock` until SIGINT/SIGTERM."""
    from kvbridge.serve.listen import serving, stop_signal

    stopped = stop_signal()
    async with serving(app, sock):  # the nodes are checked once before this block starts
        print(f"kvbridge proxy: ready on {url}", file=sys.stderr, flush=True)
        logger.info("%s: stopping", await stopped)


def run(args: argparse.Namespace) -> int:
    from kvbridge.serve.listen import bind

    try:
        app = create_proxy_app(
            args.prefill, args.decode, args.timeout, routing=args.routing, max_retries=args.max_retries,
            deadline_s=args.deadline, check_interval_s=args.health_interval, max_backoff_s=args.max_probe_backoff,
            silent_checks=args.silent_checks, insecure_side_channel=args.insecure_side_channel, dispatch=args.dispatch,
        )  # fmt: skip
        sock = bind(args.host, args.port)
    except ConfigError as exc:
        print(error_line("proxy", exc), file=sys.stderr)
        return 2
    logger.info("starting: %d prefill and %d decode node(s), routing %s, dispatch %s; checking each node once",
                len(args.prefill), len(args.decode), args.routing, args.dispatch)  # fmt: skip
    asyncio.run(serve(app, sock, f"http://{args.host}:{args.port}"))
    logger.info("stopped")
    return 0
