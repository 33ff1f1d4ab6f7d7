"""The node HTTP API over a fake engine: completions, streaming, errors, health, metrics, admin."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from serve_fakes import FakeEngineCore

from kvbridge.serve.api import API_KEY, create_app
from kvbridge.serve.async_engine import AsyncEngine


def _serve(scenario, fake: FakeEngineCore | None = None, factory=None, wait_ready=True):
    """Run `scenario(client, fake, engine)` against an app on a loopback TestServer."""
    fake = fake or FakeEngineCore()
    engine = AsyncEngine(factory or (lambda: fake))
    engine.start()

    async def main():
        if wait_ready:
            await engine.wait_ready(10)
        async with TestClient(TestServer(create_app(engine, "tiny", "both"), handler_cancellation=True)) as client:
            return await scenario(client, fake, engine)

    try:
        return asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()


def _sse_events(raw: str) -> list:
    events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_text_prompt():
    async def scenario(client, fake, engine):
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3})
        return resp.status, await resp.json()

    status, body = _serve(scenario)
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["token_ids"] == [ord("c"), ord("d"), ord("e")] and choice["text"] == "cde"
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["kv_transfer_params"] is None
    assert body["kvbridge"]["num_external_tokens"] == 0 and body["kvbridge"]["e2e_s"] >= body["kvbridge"]["ttft_s"]


def test_token_id_prompt_and_kv_transfer_params_round_trip():
    async def scenario(client, fake, engine):
        resp = await client.post(
            "/v1/completions",
            json={"prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        prefill = await resp.json()
        resp = await client.post(
            "/v1/completions",
            json={"prompt": [5, 6], "max_tokens": 2, "kv_transfer_params": prefill["kv_transfer_params"]},
        )
        return prefill, await resp.json()

    prefill, decode = _serve(scenario)
    assert prefill["choices"][0]["token_ids"] == [7]
    assert prefill["kv_transfer_params"]["remote_request_id"] == prefill["id"]
    assert decode["kvbridge"]["num_external_tokens"] == 2 and decode["choices"][0]["token_ids"] == [7, 8]


def test_streaming_chunks_add_up_to_the_completion():
    async def scenario(client, fake, engine):
        body = {"prompt": "a", "max_tokens": 4, "stream": True}
        resp = await client.post("/v1/completions", json=body)
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return await resp.text()

    chunks = _sse_events(_serve(scenario))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "bcde"
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == [98, 99, 100, 101]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and "kvbridge" in chunks[-1]


@pytest.mark.parametrize(
    "payload, status, param",
    [
        (b"{not json", 400, None),
        (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "a", "max_tokens": -1}).encode(), 400, None),
        (json.dumps({"prompt": [1000]}).encode(), 400, "prompt"),  # rejected by the engine
        (json.dumps({"prompt": "a", "model": "other"}).encode(), 404, None),
    ],
)
def test_bad_input_gets_a_json_error(payload, status, param):
    async def scenario(client, fake, engine):
        resp = await client.post("/v1/completions", data=payload, headers={"Content-Type": "application/json"})
        return resp.status, await resp.json()

    got_status, body = _serve(scenario)
    assert got_status == status
    assert body["error"]["code"] == status and body["error"]["message"]
    if param:
        assert body["error"]["param"] == param


@pytest.mark.parametrize(
    "payload, status, param",
    [
        (json.dumps({"prompt": "a\ud800b"}).encode(), 400, "prompt"),  # a lone surrogate: UTF-8 cannot encode it
        (b"[" * 100_000 + b"]" * 100_000, 400, None),  # json.loads raises RecursionError
        (json.dumps({"prompt": "a", "temperature": 1e-300}).encode(), 400, "temperature"),
        (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400, None),  # past Python's int digit limit
        (b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', 413, None),  # past client_max_size
    ],
)
def test_hostile_bodies_get_a_json_4xx_never_a_500(payload, status, param):
    async def scenario(client, fake, engine):
        resp = await client.post("/v1/completions", data=payload, headers={"Content-Type": "application/json"})
        follow_up = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        return resp.status, await resp.json(), follow_up.status

    got_status, body, follow_up = _serve(scenario)
    assert got_status == status and body["error"]["code"] == status and body["error"]["param"] == param, body
    assert follow_up == 200


def test_add_request_failure_is_a_500_naming_the_reason_and_the_engine_serves_on():
    class FailingAdd(FakeEngineCore):
        def add_request(self, request_id, prompt_token_ids, *args, **kwargs):
            if prompt_token_ids == [ord("!")]:
                raise RuntimeError("injected add_request failure")
            super().add_request(request_id, prompt_token_ids, *args, **kwargs)

    async def scenario(client, fake, engine):
        resp = await client.post("/v1/completions", json={"prompt": "!"})
        health = await client.get("/health")
        return resp.status, await resp.json(), health.status

    status, body, health = _serve(scenario, FailingAdd())
    assert status == 500 and body["error"]["type"] == "engine_error" and "injected" in body["error"]["message"]
    assert health == 200


def test_engine_error_is_a_500_with_the_reason():
    async def scenario(client, fake, engine):
        resp = await client.post("/v1/completions", json={"prompt": "a", "kv_transfer_params": {"fake_error": "KV gone"}})
        stream = await client.post(
            "/v1/completions", json={"prompt": "a", "stream": True, "kv_transfer_params": {"fake_error": "KV gone"}}
        )
        return resp.status, await resp.json(), await stream.text()

    status, body, raw = _serve(scenario)
    assert status == 500 and "KV gone" in body["error"]["message"]
    assert "KV gone" in _sse_events(raw)[-1]["error"]["message"]


def test_health_is_503_until_ready_then_200():
    release = threading.Event()

    def slow_factory():
        release.wait(10)
        return FakeEngineCore()

    async def scenario(client, fake, engine):
        before = await client.get("/health")
        early = await client.post("/v1/completions", json={"prompt": "a"})
        release.set()
        await engine.wait_ready(10)
        after = await client.get("/health")
        return before.status, (await before.json())["status"], early.status, after.status, await after.json()

    before, before_state, early, after, body = _serve(scenario, factory=slow_factory, wait_ready=False)
    assert (before, before_state, early, after) == (503, "starting", 503, 200)
    assert body["status"] == "ok" and body["role"] == "both"


def test_metrics_parse_and_count_requests():
    async def scenario(client, fake, engine):
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        await client.post("/v1/completions", json={"prompt": ""})
        resp = await client.get("/metrics")
        return await resp.text()

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(_serve(scenario))
        for s in f.samples
    }
    assert samples[("kvbridge_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("kvbridge_requests_total", (("outcome", "bad_request"),))] == 1
    assert samples[("kvbridge_generation_tokens_total", ())] == 4
    assert samples[("kvbridge_time_to_first_token_seconds_count", ())] == 2
    assert samples[("kvbridge_engine_num_finished", ())] == 2
    assert samples[("kvbridge_requests_running", ())] == 0


def test_state_endpoint_reports_stats_and_integrity():
    async def scenario(client, fake, engine):
        resp = await client.get("/v1/kvbridge/state")
        reset = await client.post("/v1/kvbridge/reset_prefix_cache")
        return await resp.json(), await reset.json()

    state, reset = _serve(scenario)
    assert state["integrity"] == {"ok": True, "error": None}
    assert state["stats"]["pool"]["num_free_blocks"] == 10 and state["has_unfinished_requests"] is False
    assert reset == {"reset": True}


def test_client_disconnect_aborts_the_request():
    async def scenario(client, fake, engine):
        body = {"prompt": "a", "max_tokens": 100_000, "stream": True}
        resp = await client.post("/v1/completions", json=body)
        await resp.content.readline()  # the first chunk arrived: the request runs
        resp.close()  # hang up
        for _ in range(200):
            if not fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        api = client.server.app[API_KEY]
        return fake.num_aborted, engine.num_running, api.metrics.running._value.get()

    assert _serve(scenario, FakeEngineCore(step_delay_s=0.002)) == (1, 0, 0)


def test_non_streaming_disconnect_aborts_the_request():
    async def scenario(client, fake, engine):
        task = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 100_000}))
        for _ in range(200):
            if fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        task.cancel()  # the client gives up and closes the connection
        for _ in range(300):
            if not fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return fake.num_aborted

    assert _serve(scenario, FakeEngineCore(step_delay_s=0.002)) == 1


def test_streamed_text_equals_the_whole_text_with_split_utf8():
    # Bytes 0xC3.. are UTF-8 lead bytes: each decodes to U+FFFD until the request ends.
    async def scenario(client, fake, engine):
        body = {"prompt": [0xC2], "max_tokens": 3}
        whole = await (await client.post("/v1/completions", json=body)).json()
        raw = await (await client.post("/v1/completions", json={**body, "stream": True})).text()
        return whole["choices"][0]["text"], _sse_events(raw)

    text, chunks = _serve(scenario)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["", ""]  # held back, not garbled
