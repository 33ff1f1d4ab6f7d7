"""The proxy's view of its nodes of one role: which are healthy, how busy each is, what failed.

Each node is HEALTHY (in rotation) or EJECTED (skipped by routing). Two things move it:

    HEALTHY --a real request fails (unreachable, reset, 5xx, silent), a health check fails,---> EJECTED
              or `silent_checks` health checks in a row get no answer within `check_timeout_s`
    EJECTED --GET /health answers 200, from a check started after the ejection-------------> HEALTHY

A check that is refused or answered with an error is proof enough: the node is down or says it is
unwell. A check that is not answered in time is not: a node whose cores are busy computing (a CPU
node beside others on a small machine, a loaded API server) can leave /health waiting for seconds
while it serves what it has. Ejecting it on one such check turned every request away with a 503
although the node was serving; so silence ejects only when it lasts `silent_checks` checks in a
row (about `silent_checks` x (`check_timeout_s` + `check_interval_s`)), and a real request that fails
on the node ejects it at once as before. Meanwhile the node is *suspect*: routing skips it while
another node of its role answers (a frozen node then gets no new request that would wait out the
proxy's timeout), and uses it when it is the only one left.

`start()` checks every node once before the proxy serves, so routing starts from what the nodes
say. Then one asyncio task per node checks it: every `check_interval_s` while it is healthy; when
ejected, after `min_backoff_s`, doubling up to `max_backoff_s` while it stays down, except while it
answers that it is starting or has never answered 200 since the proxy started (a node loading its
engine, or launched beside the proxy, will serve soon: it is checked every `min_backoff_s`, so it
joins the rotation within that of its first healthy answer). The tasks sleep between checks; an ejection wakes the node's task so that its
first check is not a whole healthy interval away. A check that started before an ejection cannot
undo it: its answer may predate the failure.

The proxy asks the pool, never its nodes' fields: `candidates()` for routing, `attempt(url)` around
every use of a node (counts requests and requests in flight), `report_failure()`, and `snapshot()`
for /health and /metrics. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import aiohttp

from kvbridge.errors import ConfigError
from kvbridge.serve.routing import NodeLoad

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0  # between checks of a healthy node
MIN_BACKOFF_S = 0.25  # first check of an ejected node; doubles while it stays down
MAX_BACKOFF_S = 5.0
CHECK_TIMEOUT_S = 5.0  # a check not answered within this is "silent"
SILENT_CHECKS = 3  # silent checks in a row that eject a healthy node


def node_url(role: str, url: str) -> str:
    """`url` (`--prefill`/`--decode` of `kvbridge proxy`) without a trailing slash, once it names a
    node: http or https, a host, a port that is one, and nothing after it. Anything else is a
    ConfigError naming the flag, at start-up: a URL the proxy cannot reach would eject the node on
    every request."""
    parts = urlsplit(url if isinstance(url, str) else "")
    problem = None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problem = f"it needs a scheme, e.g. http://{url}" if "://" not in str(url) else "the scheme must be http or https"
    elif not parts.hostname:
        problem = "it names no host"
    elif parts.path.rstrip("/") or parts.query or parts.fragment:
        problem = "give the node's base URL, without a path (the proxy adds /v1/...)"
    else:
        try:
            parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        except ValueError as exc:
            problem = str(exc)
    if problem:
        raise ConfigError(f"--{role} {url!r} is not a node URL: {problem}")
    return url.rstrip("/")


class NodeState(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"


class NodeStats(NamedTuple):
    """One node as /health and /metrics report it."""

    role: str
    url: str
    state: NodeState
    last_error: str | None  # why it was last ejected; None while it never failed
    num_in_flight: int
    num_requests: int
    num_failures: int  # real requests that failed on it (health checks not counted)
    num_ejections: int
    num_readmissions: int
    num_silent_checks: int = 0  # health checks in a row it left unanswered while healthy: suspect if > 0


@dataclass
class _Node:
    url: str
    state: NodeState = NodeState.HEALTHY
    last_error: str | None = None
    ejected_at: float = float("-inf")
    backoff_s: float = MIN_BACKOFF_S
    next_check_at: float = 0.0
    num_in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0
    num_ejections: int = 0
    num_readmissions: int = 0
    has_been_healthy: bool = False  # answered 200 to a check since the proxy started
    num_silent_checks: int = 0  # checks in a row not answered in time while healthy
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class NodePool:
    """The nodes of one role (`prefill` or `decode`), in the order they were given."""

    def __init__(
        self, role: str, urls: Sequence[str], *, check_interval_s: float = CHECK_INTERVAL_S,
        min_backoff_s: float = MIN_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S, silent_checks: int = SILENT_CHECKS,
        check_timeout_s: float = CHECK_TIMEOUT_S,
    ) -> None:  # fmt: skip
        if not urls:
            raise ConfigError(f"give at least one {role} node URL")
        if not 0 < min_backoff_s <= max_backoff_s or check_interval_s <= 0:
            raise ConfigError(f"need check_interval_s > 0 and 0 < min_backoff_s <= max_backoff_s, got {check_interval_s}, "
                              f"{min_backoff_s}, {max_backoff_s}")
        if silent_checks < 1 or check_timeout_s <= 0:
            raise ConfigError(f"need silent_checks >= 1 and check_timeout_s > 0, got {silent_checks}, {check_timeout_s}")
        self.role = role
        urls = [node_url(role, url) for url in urls]
        self._nodes = {url: _Node(url, backoff_s=min_backoff_s) for url in urls}
        if len(self._nodes) != len(urls):
            raise ConfigError(f"{role} node URLs must be distinct, got {list(urls)}")
        self._check_interval_s, self._min_backoff_s, self._max_backoff_s = check_interval_s, min_backoff_s, max_backoff_s
        self._silent_checks, self._check_timeout_s = silent_checks, check_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def urls(self) -> list[str]:
        return list(self._nodes)

    # ------------------------------------------------------------------ what routing asks

    def candidates(self, exclude: Sequence[str] = ()) -> list[NodeLoad]:
        """The healthy nodes not in `exclude`, with their load, in the order given; suspects (their
        last health check went unanswered) only when no other healthy node is left."""
        healthy = [n for n in self._nodes.values() if n.state is NodeState.HEALTHY and n.url not in exclude]
        answering = [n for n in healthy if not n.num_silent_checks]
        return [NodeLoad(n.url, n.num_in_flight) for n in answering or healthy]

    def num_ejections(self, url: str) -> int:
        """Times `url` left the rotation: what the proxy learned from it before may be another process's."""
        return self._nodes[url].num_ejections

    def has_healthy(self) -> bool:
        return any(n.state is NodeState.HEALTHY for n in self._nodes.values())

    @contextlib.contextmanager
    def attempt(self, url: str) -> Iterator[None]:
        """Around one request to `url`: counts it, and counts it in flight until the block ends."""
        node = self._nodes[url]
        node.num_requests += 1
        node.num_in_flight += 1
        try:
            yield
        finally:
            node.num_in_flight -= 1

    def report_failure(self, url: str, reason: str) -> None:
        """A real request failed on `url` in a way that says the node is unwell: eject it now."""
        node = self._nodes[url]
        node.num_failures += 1
        self._eject(node, reason)

    def snapshot(self) -> list[NodeStats]:
        return [
            NodeStats(self.role, n.url, n.state, n.last_error, n.num_in_flight, n.num_requests, n.num_failures,
                      n.num_ejections, n.num_readmissions, n.num_silent_checks)
            for n in self._nodes.values()
        ]  # fmt: skip

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is broken: a count below zero or above what
        it counts within, an ejected node without a reason."""
        for n in self._nodes.values():
            assert 0 <= n.num_in_flight <= n.num_requests, f"{n.url}: {n.num_in_flight} in flight of {n.num_requests}"
            assert 0 <= n.num_failures <= n.num_requests, f"{n.url}: {n.num_failures} failures of {n.num_requests}"
            assert n.num_readmissions <= n.num_ejections, f"{n.url}: readmitted more often than ejected"
            assert n.state is NodeState.HEALTHY or n.last_error, f"{n.url} is ejected without a reason"

    # ------------------------------------------------------------------ state changes

    def _eject(self, node: _Node, reason: str) -> None:
        node.last_error = reason
        node.num_silent_checks = 0
        if node.state is NodeState.EJECTED:
            return
        loop = asyncio.get_running_loop()
        node.state = NodeState.EJECTED
        node.ejected_at = loop.time()
        node.num_ejections += 1
        node.backoff_s = self._min_backoff_s
        node.next_check_at = node.ejected_at + node.backoff_s
        node.wake.set()
        logger.warning("%s node %s ejected: %s", self.role, node.url, reason)

    def _record_check(self, node: _Node, started_at: float, check: Check) -> None:
        now = asyncio.get_running_loop().time()
        if check.error is not None:
            if node.state is NodeState.HEALTHY:
                node.num_silent_checks = node.num_silent_checks + 1 if check.is_silent else 0
                if 0 < node.num_silent_checks < self._silent_checks:
                    logger.info("%s node %s: %s (%d of %d silent checks before it is ejected)", self.role, node.url,
                                check.error, node.num_silent_checks, self._silent_checks)
                    node.next_check_at = now + self._check_interval_s
                    return
                self._eject(node, f"health check: {check.error}")
                return
            node.last_error = f"health check: {check.error}"
            # A node that says it is starting, or was never up yet, will serve soon: no backoff meanwhile.
            is_starting = check.is_starting or not node.has_been_healthy
            node.backoff_s = self._min_backoff_s if is_starting else min(2 * node.backoff_s, self._max_backoff_s)
            node.next_check_at = now + node.backoff_s
            return
        node.has_been_healthy = True
        node.num_silent_checks = 0
        if node.state is NodeState.EJECTED and started_at >= node.ejected_at:
            node.state = NodeState.HEALTHY
            node.num_readmissions += 1
            logger.warning("%s node %s is healthy again: back in rotation", self.role, node.url)
        if node.state is NodeState.HEALTHY:
            node.next_check_at = now + self._check_interval_s
        else:  # the answer predates the ejection: check again soon
            node.next_check_at = now + node.backoff_s

    # ------------------------------------------------------------------ the checker

    async def _check(self, node: _Node) -> None:
        started_at = asyncio.get_running_loop().time()
        self._record_check(node, started_at, await probe(self._session, node.url, self._check_timeout_s))

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every node once, concurrently, then keep checking them, with `session`, one task per node."""
        self._session = session
        await asyncio.gather(*(self._check(node) for node in self._nodes.values()))
        self._tasks = [asyncio.create_task(self._watch(node), name=f"check {node.url}") for node in self._nodes.values()]

    async def _watch(self, node: _Node) -> None:
        loop = asyncio.get_running_loop()
        while True:
            delay = node.next_check_at - loop.time()
            if delay > 0:
                node.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(node.wake.wait(), delay)
                continue  # woken by an ejection, or due: look at the schedule again
            await self._check(node)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []


class Check(NamedTuple):
    """What one health check found."""

    error: str | None  # None: the node answered 200
    is_starting: bool = False  # it answered 503 {"status": "starting"}: a node still loading its engine
    is_silent: bool = False  # no answer within the check's timeout: a node down or only busy


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float = CHECK_TIMEOUT_S) -> Check:
    """GET `url`/health, waiting at most `timeout_s`. Never raises."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 200:
                return Check(None)
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = None
            is_starting = isinstance(body, dict) and body.get("status") == "starting"
            return Check(f"/health answered HTTP {resp.status}{' (starting)' if is_starting else ''}", is_starting)
    except TimeoutError:
        return Check(f"/health did not answer within {timeout_s:g}s", is_silent=True)
    except aiohttp.ClientError as exc:
        return Check(f"unreachable: {type(exc).__name__}: {exc}")
