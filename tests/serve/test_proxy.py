"""The P/D proxy over in-process nodes with fake engines: routing, params, streaming, failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest

from aiohttp.test_utils import TestClient, TestServer
from serve_fakes import FakeEngineCore

import kvbridge.serve.proxy as proxy_mod
from kvbridge.serve.api import create_app
from kvbridge.serve.async_engine import AsyncEngine
from kvbridge.serve.proxy import PROXY_KEY, create_proxy_app
from kvbridge.serve.proxy_legs import decode_body, prefill_body


def test_bodies():
    body = {"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"junk": 1}, "min_tokens": 3, "logprobs": 2}  # fmt: skip
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "min_tokens": 0, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    chat = {"messages": [], "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 2}
    assert prefill_body(chat) == {"messages": [], "max_tokens": 1, "min_tokens": 0, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    assert decode_body(body, {"remote_engine_id": "e"})["kv_transfer_params"] == {
        "remote_engine_id": "e",
        "do_remote_prefill": True,
    }
    assert decode_body(body, None)["kv_transfer_params"] is None
    assert body["max_tokens"] == 9  # the client's body is not mutated


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


@contextlib.asynccontextmanager
async def _cluster(
    fakes: list[FakeEngineCore], prefill_idx, decode_idx, extra_prefill=(), extra_decode=(), timeout_s=30.0, **options
):
    """Nodes for `fakes`, and a client of a proxy over them (plus extra, e.g. dead, URLs);
    `options` go to the PDProxy (e.g. `routing="round-robin"`)."""
    engines = [AsyncEngine(lambda f=f: f) for f in fakes]
    servers = []
    try:
        for i, engine in enumerate(engines):
            engine.start()
            await engine.wait_ready(10)
            server = TestServer(create_app(engine, "tiny", "both"), handler_cancellation=True)
            await server.start_server()
            servers.append(server)
        urls = [str(s.make_url("")).rstrip("/") for s in servers]
        app = create_proxy_app(
            [urls[i] for i in prefill_idx] + list(extra_prefill), [urls[i] for i in decode_idx] + list(extra_decode),
            timeout_s, **options,
        )  # fmt: skip
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            yield client, urls
            proxy = app[PROXY_KEY]
            proxy.check_integrity()
            assert all(n.num_in_flight == 0 for n in proxy.prefill_pool.snapshot() + proxy.decode_pool.snapshot())
    finally:
        for server in servers:
            await server.close()
        for engine in engines:
            engine.shutdown()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_proxy_round_robins_and_forwards_kv_params():
    async def main():
        fakes = [FakeEngineCore("n0"), FakeEngineCore("n1")]
        async with _cluster(fakes, [0, 1], [0, 1], routing="round-robin") as (client, urls):
            bodies = []
            for _ in range(4):
                resp = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
                assert resp.status == 200, await resp.text()
                bodies.append(await resp.json())
            return bodies, urls, fakes

    bodies, urls, fakes = _run(main())
    assert [b["kvbridge"]["proxy"]["prefill_url"] for b in bodies] == [urls[0], urls[1], urls[0], urls[1]]
    assert [b["kvbridge"]["proxy"]["decode_url"] for b in bodies] == [urls[0], urls[1], urls[0], urls[1]]
    for body in bodies:
        assert body["choices"][0]["text"] == "cde"  # what one node gives for this prompt
        assert body["kvbridge"]["num_external_tokens"] == 2  # the decode node got do_remote_prefill
        assert body["kvbridge"]["proxy"]["prefill_kvbridge"]["num_external_tokens"] == 0
    assert all(f.num_finished == 4 for f in fakes)  # 2 prefills + 2 decodes each


def test_proxy_streams_the_decode_response_through():
    async def main():
        async with _cluster([FakeEngineCore("p"), FakeEngineCore("d")], [0], [1]) as (client, urls):
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True})
            return resp.status, await resp.text()

    status, raw = _run(main())
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "bcde"
    assert chunks[-1]["kvbridge"]["num_external_tokens"] == 1


def test_a_dead_prefill_node_is_ejected_and_the_decode_node_computes_the_prompt():
    dead = _dead_url()

    async def main():
        async with _cluster([FakeEngineCore()], [], [0], extra_prefill=[dead]) as (client, urls):
            resp = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
            health = await client.get("/health")
            return resp.status, await resp.json(), health.status, await health.json()

    status, body, health_status, health = _run(main())
    assert status == 200 and body["choices"][0]["text"] == "cde", body
    assert body["kvbridge"]["proxy"]["recomputed"] and body["kvbridge"]["num_external_tokens"] == 0
    assert health_status == 200 and health["status"] == "degraded", health  # it still answers completions
    assert health["prefill"][dead].startswith("ejected: health check: unreachable"), health
    assert health["decode"] and all(v == "ok" for v in health["decode"].values())


def test_a_silent_decode_node_gives_504_and_a_silent_prefill_node_a_recompute():
    async def main():
        slow, fast = FakeEngineCore(step_delay_s=1.0), FakeEngineCore()
        async with _cluster([slow, fast], [0], [1], timeout_s=0.3) as (client, urls):
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            recomputed = resp.status, await resp.json()
        async with _cluster([fast, slow], [0], [1], timeout_s=0.3) as (client, urls):
            silent = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            return *recomputed, silent.status, await silent.json()

    status, body, silent_status, silent = _run(main())
    assert status == 200 and body["kvbridge"]["proxy"]["recomputed"], body
    assert silent_status == 504 and "did not answer" in silent["error"]["message"], silent


def test_node_4xx_passes_through_and_5xx_becomes_502():
    async def main():
        async with _cluster([FakeEngineCore(), FakeEngineCore()], [0], [1]) as (client, urls):
            bad = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": "many"})
            not_json = await client.post("/v1/completions", data=b"nope")
            health = await client.get("/health")
            return bad.status, await bad.json(), not_json.status, health.status

    bad_status, bad, not_json, health = _run(main())
    assert bad_status == 400 and bad["error"]["param"] == "max_tokens"
    assert not_json == 400 and health == 200


def test_decode_failure_becomes_502_with_the_nodes_reason(monkeypatch):
    # The fake engine ends a request that carries `fake_error` with that error: make the decode leg carry it.
    monkeypatch.setattr(proxy_mod, "decode_body", lambda body, kv: {**body, "kv_transfer_params": {"fake_error": "pull failed"}})

    async def main():
        async with _cluster([FakeEngineCore(), FakeEngineCore()], [0], [1]) as (client, urls):
            resp = await client.post("/v1/completions", json={"prompt": "a"})
            return resp.status, await resp.json(), client.server.app[PROXY_KEY].num_node_failures

    status, body, failures = _run(main())
    assert status == 502 and "pull failed" in body["error"]["message"] and "decode node" in body["error"]["message"]
    assert failures == 1


def test_client_hang_up_aborts_on_the_decode_node():
    async def main():
        decode = FakeEngineCore("d", step_delay_s=0.002)
        async with _cluster([FakeEngineCore("p"), decode], [0], [1]) as (client, urls):
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100_000, "stream": True})
            await resp.content.readline()
            resp.close()
            for _ in range(300):
                if not decode.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            health = await (await client.get("/health")).json()
            return decode.num_aborted, health["decode"][urls[1]]

    assert _run(main()) == (1, "ok")  # a client that hangs up says nothing about the decode node


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": [' + b"9" * 10_000 + b"]}", b"\xff\xfe{"])
def test_bodies_json_cannot_take_are_a_400_from_the_proxy_too(raw):
    async def go():
        app = create_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])  # never reached
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
            return resp.status, await resp.json()

    status, body = asyncio.run(go())
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
