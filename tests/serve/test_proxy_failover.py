"""The proxy survives node failures: real prefill, decode and proxy processes on loopback, killed
with SIGKILL mid-flight, restarted at the same address; a plain HTTP client sees only successes
with the colocated engine's completions (greedy), or a clear error when no decode node is left.

One cluster for the module (2 prefill, 2 decode, a proxy that checks often); the tests run in
order and each leaves fewer nodes alive. Prefill leases last 60 s, longer than the leak check
polls, so a block the leak check finds freed was freed by a reader or a release, not by expiry.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cluster import _reference

from kvbridge.serve.launcher import (
    ManagedProcess,
    http_json,
    start_node,
    start_proxy,
    wait_healthy,
    wait_proxy_routes_to_all,
)

pytestmark = pytest.mark.nixl

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "256", "--max-model-len", "512"]
PREFILL_ARGS = [*NODE_ARGS, "--kv-connector-extra", json.dumps({"lease_s": 60.0})]
# A decode node gives up on a dead prefill node within seconds and computes the prompt itself.
DECODE_ARGS = [*NODE_ARGS, "--kv-connector-extra", '{"handshake_timeout_s": 1.0, "handshake_retries": 0, "transfer_timeout_s": 5.0}']
PROXY_ARGS = ["--health-interval", "0.5", "--max-probe-backoff", "1.0"]
MAX_TOKENS = 6
LONG_MAX_TOKENS = 320  # a decode node busy for a second or more: the 0.1 s polls see it before it answers
# Enough prefill work that the 0.1 s polls of the proxy's metrics see the victim busy before it is done.
PROMPTS = [f"In-flight request {i} while a prefill node dies: " + "kv " * (8 + 5 * (i % 16)) for i in range(48)]
RESTARTED_PROMPTS = [f"{i}: after the restart, spread over both prefill nodes. " + "z" * (20 * i) for i in range(4)]
LONG_PROMPTS = [f"Decode node {i} will be killed before it answers. " * 2 for i in range(2)]
RECOMPUTED_PROMPTS = [f"No prefill node is left for request {i}. " * 3 for i in range(3)]
WAIT_S = 60.0  # hang detector of every poll below


class Cluster:
    def __init__(self, log_dir: str) -> None:
        self.prefill = [start_node(f"prefill{i}", "prefill", log_dir, extra_args=PREFILL_ARGS) for i in range(2)]
        self.decode = [start_node(f"decode{i}", "decode", log_dir, extra_args=DECODE_ARGS) for i in range(2)]
        self.proxy = start_proxy([p.url for p in self.prefill], [d.url for d in self.decode], log_dir, 60.0, PROXY_ARGS)
        self.expected: dict[tuple[str, int], list[int]] = {}

    @property
    def processes(self) -> list[ManagedProcess]:
        return [*self.prefill, *self.decode, self.proxy]


@pytest.fixture(scope="module")
def cluster():
    with tempfile.TemporaryDirectory(prefix="kvbridge-failover-") as log_dir:
        c = Cluster(log_dir)
        try:
            short = [*PROMPTS, *RESTARTED_PROMPTS, *RECOMPUTED_PROMPTS]
            c.expected = {(p, MAX_TOKENS): ids for p, ids in zip(short, _reference(short, MAX_TOKENS))}
            c.expected |= {(p, LONG_MAX_TOKENS): ids for p, ids in zip(LONG_PROMPTS, _reference(LONG_PROMPTS, LONG_MAX_TOKENS))}
            wait_healthy(c.processes, timeout_s=180)
            wait_proxy_routes_to_all(c.proxy, timeout_s=60)
            yield c
        finally:
            for proc in c.processes:
                proc.signal_stop()
            for proc in c.processes:
                proc.stop()


# ------------------------------------------------------------------ helpers


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}"
        time.sleep(0.1)


def _metrics(c: Cluster) -> dict[tuple[str, tuple], float]:
    status, text = http_json(f"{c.proxy.url}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def _node_metric(metrics: dict, name: str, role: str, url: str) -> float:
    return metrics[(f"kvbridge_proxy_node_{name}", (("node", url), ("role", role)))]


def _total(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in metrics.items() if n == name and all(dict(lbl).get(k) == w for k, w in labels.items()))


def _body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


async def _send_all(c: Cluster, bodies: list[dict], while_in_flight=None) -> list[tuple[int, dict]]:
    """POST every body to the proxy at once; `while_in_flight(metrics)` runs (in a thread) once
    some are in flight, with the proxy's metrics, and may kill nodes."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:

        async def one(body: dict) -> tuple[int, dict]:
            async with session.post(f"{c.proxy.url}/v1/completions", json=body) as resp:
                return resp.status, await resp.json()

        tasks = [asyncio.create_task(one(body)) for body in bodies]
        if while_in_flight is not None:
            await asyncio.to_thread(while_in_flight)
        return await asyncio.gather(*tasks)


def _assert_colocated(c: Cluster, bodies: list[dict], results: list[tuple[int, dict]]) -> None:
    failed = [body for status, body in results if status != 200]
    assert not failed, failed[:3]
    for body, (_, answer) in zip(bodies, results):
        assert answer["choices"][0]["token_ids"] == c.expected[(body["prompt"], body["max_tokens"])], answer


def _assert_no_block_held(nodes: list[ManagedProcess]) -> None:
    """Every node ends with no block used or held for a reader; fails when one stays held."""
    deadline = time.monotonic() + 20.0  # far below the prefill's 60 s lease: expiry cannot hide a leak
    for node in nodes:
        while True:
            status, state = http_json(f"{node.url}/v1/kvbridge/state")
            assert status == 200 and state["integrity"]["ok"], state
            stats = state["stats"]
            if stats["num_used_blocks"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], (node.name, stats)
        assert not state["has_unfinished_requests"] and not state["has_pending_transfers"], (node.name, state)


# ------------------------------------------------------------------ the failures, in order


def test_a_prefill_node_killed_with_requests_in_flight_costs_no_request_and_comes_back(cluster):
    c = cluster
    victim = c.prefill[0]
    bodies = [_body(p) for p in PROMPTS]
    sent_before = _node_metric(_metrics(c), "requests_total", "prefill", victim.url)

    def victim_got_work() -> bool:
        # busy now, or sent work since the burst began: on a loaded machine its legs can all end between
        # two polls of the gauge (a clean CI run waited out 60 s that way)
        metrics = _metrics(c)
        return (_node_metric(metrics, "in_flight", "prefill", victim.url) > 0
                or _node_metric(metrics, "requests_total", "prefill", victim.url) > sent_before)  # fmt: skip

    def kill_the_victim_while_it_works() -> None:
        _until(victim_got_work, "work on the victim")
        victim.kill()

    results = asyncio.run(_send_all(c, bodies, kill_the_victim_while_it_works))
    _assert_colocated(c, bodies, results)
    # ejected by a request that failed on it, or (when its work had ended first) by the health checks
    _until(lambda: _node_metric(_metrics(c), "healthy", "prefill", victim.url) == 0, "the victim's ejection")
    metrics = _metrics(c)
    assert _node_metric(metrics, "ejections_total", "prefill", victim.url) >= 1
    assert _total(metrics, "kvbridge_proxy_requests_total", outcome="ok") >= len(bodies)

    victim.restart()  # same ports: the proxy finds it again by its health checks
    wait_healthy([victim], timeout_s=120)
    _until(lambda: _node_metric(_metrics(c), "healthy", "prefill", victim.url) == 1, "re-admission")
    assert _node_metric(_metrics(c), "readmissions_total", "prefill", victim.url) >= 1
    bodies = [_body(p) for p in RESTARTED_PROMPTS]
    answers = [http_json(f"{c.proxy.url}/v1/completions", body) for body in bodies]
    _assert_colocated(c, bodies, answers)
    assert victim.url in {answer["kvbridge"]["proxy"]["prefill_url"] for _, answer in answers}  # it gets work again
    _assert_no_block_held([*c.prefill, *c.decode])


def test_a_client_error_is_passed_through_and_never_retried(cluster):
    c = cluster
    before = _metrics(c)
    status, body = http_json(f"{c.proxy.url}/v1/completions", _body("t" * 2000))  # longer than max-model-len
    after = _metrics(c)
    assert status == 400 and body["error"]["param"] == "prompt", body
    requests = "kvbridge_proxy_node_requests_total"
    assert _total(after, requests, role="prefill") - _total(before, requests, role="prefill") == 1
    assert _total(after, requests, role="decode") == _total(before, requests, role="decode")
    assert _total(after, "kvbridge_proxy_retries_total") == _total(before, "kvbridge_proxy_retries_total")


def test_a_decode_node_killed_before_it_answers_is_retried_on_the_other(cluster):
    c = cluster
    bodies = [_body(p, LONG_MAX_TOKENS) for p in LONG_PROMPTS]
    killed: list[ManagedProcess] = []

    def kill_a_busy_decode_node() -> None:
        def busy() -> list[ManagedProcess]:
            metrics = _metrics(c)
            return [d for d in c.decode if _node_metric(metrics, "in_flight", "decode", d.url) > 0]

        _until(lambda: busy(), "work on a decode node")
        killed.append(busy()[0])
        killed[0].kill()

    retries_before = _total(_metrics(c), "kvbridge_proxy_retries_total", leg="decode")
    results = asyncio.run(_send_all(c, bodies, kill_a_busy_decode_node))
    _assert_colocated(c, bodies, results)
    assert max(answer["kvbridge"]["proxy"]["decode_attempts"] for _, answer in results) == 2
    metrics = _metrics(c)
    assert _total(metrics, "kvbridge_proxy_retries_total", leg="decode") > retries_before
    assert _node_metric(metrics, "ejections_total", "decode", killed[0].url) >= 1
    _assert_no_block_held([*c.prefill, *[d for d in c.decode if d is not killed[0]]])


def test_with_every_prefill_node_dead_the_decode_node_computes_the_prompts(cluster):
    c = cluster
    for node in c.prefill:
        node.kill()
    bodies = [_body(p) for p in RECOMPUTED_PROMPTS]
    answers = [http_json(f"{c.proxy.url}/v1/completions", body) for body in bodies]
    _assert_colocated(c, bodies, answers)
    assert all(answer["kvbridge"]["proxy"]["recomputed"] for _, answer in answers)
    assert _total(_metrics(c), "kvbridge_proxy_recompute_fallbacks_total") >= len(bodies)
    status, health = http_json(f"{c.proxy.url}/health")
    assert status == 200 and health["status"] == "degraded", health  # it still answers completions
    _assert_no_block_held([d for d in c.decode if d.is_running()])


def test_with_every_decode_node_dead_a_request_gets_a_clear_error(cluster):
    c = cluster
    for node in c.decode:
        node.kill()
    status, body = http_json(f"{c.proxy.url}/v1/completions", _body(PROMPTS[0]), timeout_s=60)  # 60 s: a hang detector
    assert status in (502, 503) and "decode node" in body["error"]["message"], body
    status, health = http_json(f"{c.proxy.url}/health")
    assert status == 503 and health["status"] == "unavailable", health
