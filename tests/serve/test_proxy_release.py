"""The proxy strands no prefill blocks: it refuses what a node would refuse before the prefill leg,
and when the decode leg fails after it, the prefill node frees the blocks at once, not at the end
of their lease. Black-box: prefill node, decode node and proxy processes on loopback, plain HTTP;
and, for the failures that are hard to cause in real nodes (a 5xx, a silent decode node, a client
that hangs up mid-stream), the proxy over in-process fake nodes, with the releases recorded.

The decode node serves a shorter context than the prefill node (a misconfiguration the proxy
cannot see), so a long prompt is accepted by the prefill node and refused by the decode node.
The lease (60 s) is far longer than the deadline the tests poll with, so freed blocks can only
come from the proxy's release.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import tempfile
import threading
import time

import pytest
from serve_fakes import FakeEngineCore
from test_proxy import _cluster, _run

import kvbridge.serve.proxy as proxy_mod
import kvbridge.serve.proxy_release as release_mod
from kvbridge.transfer import nixl_build
from kvbridge.serve.launcher import http_json, start_node, start_proxy, wait_healthy, wait_proxy_routes_to_all

needs_nixl = pytest.mark.skipif(not nixl_build.is_available(), reason="needs NIXL")

LEASE_S = 60.0
COMMON = ["--num-threads", "1", "--num-blocks", "64", "--kv-connector-extra", json.dumps({"lease_s": LEASE_S})]
# Leases may hold the whole cache (no lease quota refusal): what is tested is that refused requests hold none.
PREFILL_ARGS = [*COMMON, "--max-model-len", "512", "--max-leased-fraction", "1"]
DECODE_ARGS = [*COMMON, "--max-model-len", "128"]
SHORT = {"prompt": "Blocks are held only for a reader that will come. " * 2, "max_tokens": 4, "temperature": 0}
LONG = {**SHORT, "prompt": "x" * 300}  # 18 full blocks on the prefill node; too long for the decode node
RELEASE_DEADLINE_S = 20.0  # a hang detector, far below the lease


# ------------------------------------------------------------------ in-process: every way a decode leg fails


@pytest.fixture
def releases(monkeypatch) -> list[dict]:
    """The params of every release the proxy sends (nothing is sent: the fake prefill holds nothing)."""
    sent: list[dict] = []
    lock = threading.Lock()

    def record(kv_transfer_params, secret):
        with lock:
            sent.append(kv_transfer_params)
        return True

    monkeypatch.setattr(release_mod, "_release", record)
    return sent


async def _wait_for(releases: list, n: int) -> None:
    for _ in range(500):  # a hang detector: the release is sent right after the failure
        if len(releases) >= n:
            return
        await asyncio.sleep(0.01)


def _one_release_of_the_prefill(releases: list[dict]) -> None:
    assert len(releases) == 1, releases
    assert releases[0]["remote_engine_id"] == "p" and releases[0]["remote_block_ids"], releases


def test_no_release_after_a_decode_leg_that_succeeded(releases):
    async def main():
        async with _cluster([FakeEngineCore("p"), FakeEngineCore("d")], [0], [1]) as (client, _):
            for stream in (False, True):
                resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": stream})
                assert resp.status == 200 and (await resp.read())
            await asyncio.sleep(0.2)

    _run(main())
    assert releases == []


def test_a_decode_5xx_releases(releases, monkeypatch):
    monkeypatch.setattr(proxy_mod, "decode_body", lambda body, kv: {**body, "kv_transfer_params": {"fake_error": "boom"}})

    async def main():
        async with _cluster([FakeEngineCore("p"), FakeEngineCore("d")], [0], [1]) as (client, _):
            resp = await client.post("/v1/completions", json={"prompt": "a"})
            await _wait_for(releases, 1)
            return resp.status

    assert _run(main()) == 502
    _one_release_of_the_prefill(releases)


def test_a_silent_decode_node_releases(releases):
    async def main():
        slow = FakeEngineCore("d", step_delay_s=1.0)
        async with _cluster([FakeEngineCore("p"), slow], [0], [1], timeout_s=0.3) as (client, _):
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            await _wait_for(releases, 1)
            return resp.status

    assert _run(main()) == 504
    _one_release_of_the_prefill(releases)


def test_a_client_that_hangs_up_mid_stream_releases(releases):
    async def main():
        decode = FakeEngineCore("d", step_delay_s=0.002)
        async with _cluster([FakeEngineCore("p"), decode], [0], [1]) as (client, _):
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100_000, "stream": True})
            await resp.content.readline()
            resp.close()
            await _wait_for(releases, 1)

    _run(main())
    _one_release_of_the_prefill(releases)


# ------------------------------------------------------------------ real nodes


@pytest.fixture(scope="module")
def cluster():
    with tempfile.TemporaryDirectory() as log_dir:
        procs = []
        try:
            prefill = start_node("prefill", "prefill", log_dir, extra_args=PREFILL_ARGS)
            decode = start_node("decode", "decode", log_dir, extra_args=DECODE_ARGS)
            procs = [prefill, decode]
            proxy = start_proxy([prefill.url], [decode.url], log_dir, timeout_s=60)
            procs.append(proxy)
            wait_healthy(procs, timeout_s=180)
            wait_proxy_routes_to_all(proxy, timeout_s=60)  # a prefill leg must reach the prefill node
            yield prefill, decode, proxy
        finally:
            for proc in procs:
                proc.signal_stop()
            for proc in procs:
                proc.stop()


def _stats(node) -> dict:
    status, state = http_json(f"{node.url}/v1/kvbridge/state", timeout_s=30)
    assert status == 200 and state["integrity"]["ok"], state
    return state["stats"]


def _wait_no_held_blocks(node) -> dict:
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while (stats := _stats(node))["num_used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 17}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"stream": "yes"}, "stream"),
    ],
)
@pytest.mark.nixl
@needs_nixl
def test_requests_a_node_would_refuse_get_a_400_from_the_proxy_before_any_leg(cluster, change, param):
    prefill, _, proxy = cluster
    admissions = _stats(prefill)["num_admissions"]
    for _ in range(4):  # four of these once filled a 64-block prefill node for a whole lease
        status, body = http_json(f"{proxy.url}/v1/completions", {**SHORT, **change})
        assert status == 400 and body["error"]["param"] == param, body
        assert body["error"]["type"] == "invalid_request_error"
    stats = _stats(prefill)
    assert stats["num_admissions"] == admissions and stats["num_used_blocks"] == 0, stats


@pytest.mark.nixl
@needs_nixl
def test_a_body_that_is_no_object_is_a_400_too(cluster):
    prefill, _, proxy = cluster
    admissions = _stats(prefill)["num_admissions"]
    for body in ([SHORT], "prompt", 7):
        status, answer = http_json(f"{proxy.url}/v1/completions", body)
        assert status == 400 and "JSON object" in answer["error"]["message"], answer
    assert _stats(prefill)["num_admissions"] == admissions


@pytest.mark.nixl
@needs_nixl
def test_a_decode_node_that_refuses_the_request_releases_the_prefill_blocks(cluster):
    prefill, _, proxy = cluster
    status, ok = http_json(f"{proxy.url}/v1/completions", SHORT)  # the cluster works
    assert status == 200 and len(ok["choices"][0]["token_ids"]) == SHORT["max_tokens"], ok
    admissions = _stats(prefill)["num_admissions"]
    for _ in range(3):  # 3 x 18 blocks would not fit in 64 if any stayed held
        status, body = http_json(f"{proxy.url}/v1/completions", LONG)
        assert status == 400 and body["error"]["param"] == "prompt", body  # the decode node's answer
    stats = _wait_no_held_blocks(prefill)
    assert stats["num_admissions"] == admissions + 3  # the prefill leg ran each time
    assert stats["num_used_blocks"] == 0, f"the prefill node still holds blocks of refused requests: {stats}"
    _, health = http_json(f"{proxy.url}/health")
    assert health["num_kv_releases"] >= 3 and health["num_kv_release_failures"] == 0, health


@pytest.mark.nixl
@needs_nixl
def test_an_unreachable_decode_node_releases_the_prefill_blocks(cluster):
    prefill, decode, proxy = cluster
    decode.stop()  # last: the module's other tests ran with it
    for _ in range(3):  # 502 while the proxy still takes it for healthy, then 503 without a prefill leg
        status, body = http_json(f"{proxy.url}/v1/completions", SHORT)
        assert status in (502, 503) and "decode node" in body["error"]["message"], body
    stats = _wait_no_held_blocks(prefill)
    assert stats["num_used_blocks"] == 0, f"the prefill node still holds blocks for a dead decode node: {stats}"
