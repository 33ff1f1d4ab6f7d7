"""The proxy's node pool (serve/node_pool.py): ejection on a failure, a failed check or a run of
silent ones, re-admission by a health check, in-flight counts, and a checker that sleeps between
checks."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvbridge.errors import ConfigError
from kvbridge.serve.node_pool import NodePool, NodeState


class HealthServer:
    """A node that only answers GET /health, with `status` (a 503 says "failed", or "starting"
    with `is_starting`); counts the checks it got. The next `num_silent` checks get no answer for
    `silent_s` (a node too busy to answer)."""

    def __init__(self) -> None:
        self.status = 200
        self.is_starting = False
        self.num_checks = 0
        self.num_answered = 0
        self.num_silent, self.silent_s = 0, 0.0
        app = web.Application()
        app.router.add_get("/health", self._health)
        self.server = TestServer(app)

    async def _health(self, request: web.Request) -> web.Response:
        self.num_checks += 1
        if self.num_silent > 0:
            self.num_silent -= 1
            await asyncio.sleep(self.silent_s)
        self.num_answered += 1
        status = "ok" if self.status == 200 else "starting" if self.is_starting else "failed"
        return web.json_response({"status": status}, status=self.status)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def _until(predicate, what: str) -> None:
    for _ in range(1000):  # a hang detector: checks come every 50-250 ms here
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@contextlib.asynccontextmanager
async def _checking(nodes: list[HealthServer], *other_urls: str, role: str = "decode", **options):
    """A pool over `nodes` (started here) and then `other_urls`, checking them while the block
    runs; the pool and the nodes are closed after it (its `snapshot()` still answers)."""
    for node in nodes:
        await node.server.start_server()
    try:
        pool = NodePool(role, [node.url for node in nodes] + list(other_urls), **options)
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                yield pool
            finally:
                await pool.close()
    finally:
        for node in nodes:
            await node.server.close()


def test_a_failure_ejects_at_once_and_a_health_check_readmits():
    async def main():
        node = HealthServer()
        async with _checking([node], "http://127.0.0.1:9", check_interval_s=0.05, max_backoff_s=0.5) as pool:
            (dead,) = [s for s in pool.snapshot() if s.url.endswith(":9")]
            assert dead.state is NodeState.EJECTED and dead.last_error.startswith("health check: unreachable"), dead
            assert [c.url for c in pool.candidates()] == [node.url]  # ejected nodes are never offered

            with pool.attempt(node.url):
                assert pool.candidates()[0].num_in_flight == 1
                pool.report_failure(node.url, "decode node reset the connection")
                assert not pool.has_healthy() and pool.candidates() == []
            await _until(lambda: pool.has_healthy(), "re-admission by a health check")
            (stats,) = [s for s in pool.snapshot() if s.url == node.url]
            assert (stats.num_requests, stats.num_in_flight, stats.num_failures) == (1, 0, 1)
            assert (stats.num_ejections, stats.num_readmissions) == (1, 1)
            assert stats.last_error == "decode node reset the connection"

            node.status = 503  # e.g. restarting: a failed check ejects it too, without a request
            await _until(lambda: not pool.has_healthy(), "ejection by a failed check")
            node.status = 200
            await _until(lambda: pool.has_healthy(), "re-admission")
            (stats,) = [s for s in pool.snapshot() if s.url == node.url]
            assert (stats.num_ejections, stats.num_readmissions, stats.num_failures) == (2, 2, 1)
            pool.check_integrity()

    _run(main())


def test_a_busy_node_is_ejected_only_when_it_is_silent_for_several_checks_in_a_row():
    """A check not answered in time may only mean the node is busy serving: two in a row keep it in
    rotation, an answer forgives them, and the third in a row ejects it. A refused check still
    ejects at once (first test)."""

    async def main():
        node = HealthServer()
        node.silent_s = 1.0
        async with _checking([node], check_interval_s=0.02, check_timeout_s=0.1, silent_checks=3) as pool:
            node.num_silent = 2
            answered = node.num_answered
            await _until(lambda: node.num_silent == 0 and node.num_answered > answered, "an answer after two silent checks")
            await asyncio.sleep(0.1)  # room for the answer to be recorded
            (stats,) = pool.snapshot()
            assert stats.state is NodeState.HEALTHY and stats.num_ejections == 0, stats

            node.num_silent = 2  # two more: only the count in a row matters
            answered = node.num_answered
            await _until(lambda: node.num_silent == 0 and node.num_answered > answered, "an answer again")
            await asyncio.sleep(0.1)
            assert pool.snapshot()[0].num_ejections == 0, pool.snapshot()

            node.num_silent = 3
            await _until(lambda: not pool.has_healthy(), "ejection after three silent checks in a row")
            (stats,) = pool.snapshot()
            assert stats.last_error == "health check: /health did not answer within 0.1s", stats
            await _until(pool.has_healthy, "re-admission once it answers")
            assert pool.snapshot()[0].num_readmissions == 1
            pool.check_integrity()

    _run(main())


def test_a_suspect_node_gets_requests_only_when_no_other_node_answers():
    """Between its first silent check and its ejection a node may be frozen, not busy: while another
    node answers, routing skips it (a request sent there would wait out the proxy's timeout)."""

    async def main():
        busy, other = HealthServer(), HealthServer()
        busy.silent_s = 1.0
        async with _checking([busy, other], check_interval_s=0.02, check_timeout_s=0.1, silent_checks=100) as pool:
            assert [c.url for c in pool.candidates()] == [busy.url, other.url]
            busy.num_silent = 10**6
            await _until(lambda: [c.url for c in pool.candidates()] == [other.url], "the suspect left out")
            assert pool.has_healthy() and pool.snapshot()[0].state is NodeState.HEALTHY
            assert [c.url for c in pool.candidates(exclude=[other.url])] == [busy.url]  # the only one left
            with pool.attempt(other.url):
                pool.report_failure(other.url, "decode node reset the connection")
            assert [c.url for c in pool.candidates()] == [busy.url]
            busy.num_silent = 0
            await _until(lambda: len(pool.candidates()) == 2, "both back: the suspect answered, the other readmitted")
            pool.check_integrity()

    _run(main())


@pytest.mark.parametrize("is_starting", [False, True])
def test_an_ejected_node_is_checked_with_backoff_not_in_a_loop(is_starting):
    async def main():
        node = HealthServer()
        node.status, node.is_starting = 503, is_starting
        async with _checking([node], role="prefill", check_interval_s=0.01, max_backoff_s=0.5) as pool:
            await asyncio.sleep(1.5)
        return node.num_checks, pool.snapshot()[0]

    num_checks, stats = _run(main())
    # 0.25 s doubling to 0.5 s (a starting node: every 0.25 s): 4 to 7 checks in 1.5 s; a checker
    # that spins would make thousands
    assert 2 <= num_checks <= 20, num_checks
    assert stats.last_error.endswith("(starting)") == is_starting, stats
    assert stats.state is NodeState.EJECTED and stats.num_ejections == 1 and "503" in stats.last_error


def test_a_node_never_seen_healthy_is_checked_as_if_starting():
    """A node launched beside the proxy may not listen yet at the proxy's first check. Until it has
    answered 200 once, it is checked every min_backoff_s (no doubling), so it joins the rotation
    within that of coming up instead of a max_backoff_s later (while requests skip it)."""

    async def main():
        node = HealthServer()
        node.status = 503  # down, not saying "starting": a node that once served would back off
        async with _checking([node], role="prefill", check_interval_s=10.0, max_backoff_s=5.0) as pool:
            await asyncio.sleep(2.5)
            num_down_checks = node.num_checks
            node.status = 200
            await _until(pool.has_healthy, "admission of the node once it answers")
        return num_down_checks

    # Every 0.25 s: about 11 checks in 2.5 s. Doubling would give 4 (at 0, 0.25, 0.75 and 1.75 s),
    # and the node would then wait until 3.75 s to be admitted.
    assert _run(main()) >= 7


def test_bad_pools_are_config_errors():
    with pytest.raises(ConfigError, match="at least one decode node"):
        NodePool("decode", [])
    with pytest.raises(ConfigError, match="distinct"):
        NodePool("decode", ["http://a/", "http://a"])
    with pytest.raises(ConfigError):
        NodePool("decode", ["http://a"], max_backoff_s=0.1)
    with pytest.raises(ConfigError, match="silent_checks"):
        NodePool("decode", ["http://a"], silent_checks=0)
