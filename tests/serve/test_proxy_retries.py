"""The proxy's retries and fallbacks over in-process nodes: fake engines that work, and sick nodes
that pass their health checks but fail requests in one chosen way (5xx, 4xx, a reset before the
answer, a stream that breaks). Also /metrics, /v1/models and the proxy's own JSON errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from serve_fakes import FakeEngineCore
from test_proxy import _cluster, _run

import kvbridge.serve.proxy_release as release_mod
from kvbridge.serve.protocol import error_body
from kvbridge.serve.proxy import PROXY_KEY


class SickNode:
    """Answers /health with 200 (503 once it failed a request, with `dies`) and fails every
    completion in its `mode`: "5xx", "4xx", "reset" (drops the connection before answering) or
    "broken_stream" (one SSE event, then drops the connection)."""

    def __init__(self, mode: str, dies: bool = False) -> None:
        self.mode, self.dies = mode, dies
        self.num_requests = 0
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=503 if self.dies and self.num_requests else 200)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        await request.read()
        if self.mode == "5xx":
            return web.json_response(error_body("injected failure", "engine_error", 500), status=500)
        if self.mode == "429":
            return web.json_response(error_body("leases hold this node's blocks", "rate_limit_error", 429), status=429)
        if self.mode == "4xx":
            return web.json_response(error_body("prompt too long for this node", "invalid_request_error", 400, "prompt"), status=400)
        if self.mode == "reset":
            request.transport.abort()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "b"}]}\n\n')
        await asyncio.sleep(0.05)
        request.transport.abort()
        return response


@contextlib.asynccontextmanager
async def _sick(*nodes: SickNode):
    """Start the nodes; yields their URLs."""
    for node in nodes:
        await node.server.start_server()
    try:
        yield [node.url for node in nodes]
    finally:
        for node in nodes:
            await node.server.close()


@pytest.fixture
def releases(monkeypatch) -> list[dict]:
    """The params of every release the proxy sends (recorded, not sent)."""
    sent: list[dict] = []
    lock = threading.Lock()

    def record(kv_transfer_params, secret):
        with lock:
            sent.append(kv_transfer_params)
        return True

    monkeypatch.setattr(release_mod, "_release", record)
    return sent


async def _metrics(client) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the proxy's /metrics."""
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(await resp.text())
        for s in family.samples
    }


def _node(role: str, url: str) -> tuple:
    return (("node", url), ("role", role))


BODY = {"prompt": "ab", "max_tokens": 3, "temperature": 0}


def test_a_prefill_5xx_is_retried_on_another_prefill_node():
    async def main():
        sick = SickNode("5xx")
        async with _sick(sick) as (sick_url,), _cluster(
            [FakeEngineCore("p"), FakeEngineCore("d")], [0], [1], extra_prefill=[sick_url], routing="round-robin"
        ) as (client, urls):
            # round-robin over [fake, sick]: the second request goes to the sick node first
            bodies = [await (await client.post("/v1/completions", json=BODY)).json() for _ in range(2)]
            return bodies, urls, sick_url, sick.num_requests, await _metrics(client)

    bodies, urls, sick_url, sick_requests, metrics = _run(main())
    assert [b["choices"][0]["text"] for b in bodies] == ["cde", "cde"], bodies
    proxy = bodies[1]["kvbridge"]["proxy"]
    assert proxy["prefill_url"] == urls[0] and proxy["prefill_attempts"] == 2 and not proxy["recomputed"]
    assert bodies[1]["kvbridge"]["num_external_tokens"] == 2  # the decode node still got the prefill's params
    assert sick_requests == 1
    assert metrics[("kvbridge_proxy_retries_total", (("leg", "prefill"),))] == 1
    assert metrics[("kvbridge_proxy_node_failures_total", _node("prefill", sick_url))] == 1
    assert metrics[("kvbridge_proxy_node_ejections_total", _node("prefill", sick_url))] == 1
    assert metrics[("kvbridge_proxy_recompute_fallbacks_total", ())] == 0
    assert metrics[("kvbridge_proxy_requests_total", (("outcome", "ok"),))] == 2


def test_a_prefill_429_goes_to_another_prefill_node_or_to_the_decode_node_and_ejects_nothing():
    """A prefill node whose lease quota refuses (serve/lease_quota.py) is skipped, never ejected: another
    prefill node serves the request, and with none the decode node computes the prompt itself."""

    async def main():
        busy = SickNode("429")
        async with _sick(busy) as (busy_url,), _cluster(
            [FakeEngineCore("p"), FakeEngineCore("d")], [0], [1], extra_prefill=[busy_url], routing="round-robin"
        ) as (client, urls):
            bodies = [await (await client.post("/v1/completions", json=BODY)).json() for _ in range(2)]
            return bodies, urls, busy_url, busy.num_requests, await _metrics(client)

    bodies, urls, busy_url, busy_requests, metrics = _run(main())
    assert [b["choices"][0]["text"] for b in bodies] == ["cde", "cde"], bodies
    assert bodies[1]["kvbridge"]["proxy"]["prefill_url"] == urls[0] and bodies[1]["kvbridge"]["num_external_tokens"] == 2
    assert busy_requests == 1
    assert metrics.get(("kvbridge_proxy_node_ejections_total", _node("prefill", busy_url)), 0) == 0

    async def alone():
        busy = SickNode("429")
        async with _sick(busy) as (busy_url,), _cluster(
            [FakeEngineCore("d")], [], [0], extra_prefill=[busy_url]
        ) as (client, _):
            resp = await client.post("/v1/completions", json=BODY)
            return resp.status, await resp.json()

    status, body = _run(alone())
    assert status == 200 and body["choices"][0]["text"] == "cde", body  # computed by the decode node
    assert body["kvbridge"]["proxy"]["recomputed"], body


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_node_that_fails_before_answering_is_retried_with_the_same_kv_params(releases, stream):
    async def main():
        sick = SickNode("reset")
        async with _sick(sick) as (sick_url,), _cluster(
            [FakeEngineCore("p"), FakeEngineCore("d")], [0], [1], extra_decode=[sick_url], routing="round-robin"
        ) as (client, urls):
            assert (await client.post("/v1/completions", json=BODY)).status == 200  # decode round-robin: the sick node is next
            resp = await client.post("/v1/completions", json={**BODY, "stream": stream})
            raw = await resp.text()
            await asyncio.sleep(0.2)  # a release would have been sent by now
            return resp.status, raw, sick.num_requests, await _metrics(client)

    status, raw, sick_requests, metrics = _run(main())
    assert status == 200 and sick_requests == 1, raw
    if stream:
        events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in chunks) == "cde"
        assert chunks[-1]["kvbridge"]["num_external_tokens"] == 2  # same params: KV pulled, not recomputed
    else:
        body = json.loads(raw)
        assert body["choices"][0]["text"] == "cde" and body["kvbridge"]["num_external_tokens"] == 2
        assert body["kvbridge"]["proxy"]["decode_attempts"] == 2
    assert metrics[("kvbridge_proxy_retries_total", (("leg", "decode"),))] == 1
    assert releases == []  # the second decode node read the blocks: nothing to release


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_4xx_is_passed_through_and_never_retried(releases, role):
    async def main():
        refusing = SickNode("4xx")
        fakes = [FakeEngineCore("p"), FakeEngineCore("d")]
        async with _sick(refusing) as (refusing_url,), _cluster(
            fakes, [0], [1], routing="round-robin", **{f"extra_{role}": [refusing_url]}
        ) as (client, urls):
            assert (await client.post("/v1/completions", json=BODY)).status == 200  # round-robin: the refusing node is next
            resp = await client.post("/v1/completions", json=BODY)
            await asyncio.sleep(0.2)  # a release would have been sent by now
            return resp.status, await resp.json(), refusing.num_requests, await _metrics(client), fakes

    status, body, refused, metrics, fakes = _run(main())
    assert status == 400 and body["error"]["param"] == "prompt" and refused == 1, body  # the node's own answer
    assert not any(name == "kvbridge_proxy_retries_total" and value for (name, _), value in metrics.items())
    assert metrics[("kvbridge_proxy_recompute_fallbacks_total", ())] == 0
    assert metrics[("kvbridge_proxy_requests_total", (("outcome", "client_error"),))] == 1
    if role == "prefill":  # neither another prefill node nor a decode node was asked
        assert (fakes[0].num_finished, fakes[1].num_finished, releases) == (1, 1, [])
    else:  # the prefill ran, no other decode node was asked, and the prefill's blocks are released
        assert (fakes[0].num_finished, fakes[1].num_finished) == (2, 1)
        assert len(releases) == 1 and releases[0]["remote_engine_id"] == "p"


def test_decode_retries_are_bounded_and_then_a_clear_502_or_503(releases):
    async def main():
        sick = [SickNode("5xx", dies=True) for _ in range(4)]
        async with _sick(*sick) as sick_urls, _cluster(
            [FakeEngineCore("p")], [0], [], extra_decode=sick_urls, max_retries=2
        ) as (client, urls):
            answers = []
            for _ in range(3):
                resp = await client.post("/v1/completions", json=BODY)
                answers.append((resp.status, await resp.json()))
            health = await client.get("/health")
            await asyncio.sleep(0.2)
            return answers, [s.num_requests for s in sick], health.status, await health.json()

    answers, num_requests, health_status, health = _run(main())
    (first_status, first), (second_status, second), (third_status, third) = answers
    assert first_status == 502 and "injected failure" in first["error"]["message"], first
    assert "3 decode node(s) tried" in first["error"]["message"]  # 1 + max_retries, never more
    assert second_status == 502 and sum(num_requests) == 4  # the one left, then none: each node tried once
    assert third_status == 503 and third["error"]["type"] == "service_unavailable", third
    assert "no decode node is healthy" in third["error"]["message"]
    assert health_status == 503 and health["status"] == "unavailable"
    assert len(releases) == 2  # a prefill ran for the first two only, and its blocks were released


def test_the_deadline_ends_a_request_that_silent_nodes_hold():
    async def main():
        slow = [FakeEngineCore("d0", step_delay_s=1.0), FakeEngineCore("d1", step_delay_s=1.0)]
        async with _cluster([FakeEngineCore("p"), *slow], [0], [1, 2], deadline_s=0.3) as (client, urls):
            resp = await client.post("/v1/completions", json=BODY)
            health = await client.get("/health")
            return resp.status, await resp.json(), await health.json()

    status, body, health = _run(main())
    assert status == 504 and "deadline" in body["error"]["message"], body
    assert health["status"] == "ok"  # a request's deadline says nothing about the node


def test_a_stream_that_breaks_after_its_first_byte_ends_with_an_error_event(releases):
    async def main():
        broken = SickNode("broken_stream")
        async with _sick(broken) as (broken_url,), _cluster(
            [FakeEngineCore("p"), FakeEngineCore("d")], [0], [1], extra_decode=[broken_url], routing="round-robin"
        ) as (client, urls):
            await client.post("/v1/completions", json=BODY)  # to the fake decode node: the broken one is next
            resp = await client.post("/v1/completions", json={**BODY, "stream": True})
            raw = await resp.text()
            await asyncio.sleep(0.2)
            return resp.status, raw, await _metrics(client), broken_url

    status, raw, metrics, broken_url = _run(main())
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert status == 200 and events[0] == '{"choices": [{"text": "b"}]}' and events[-1] == "[DONE]", raw
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]  # never a silent truncation
    assert metrics[("kvbridge_proxy_node_ejections_total", _node("decode", broken_url))] == 1
    assert not any(name == "kvbridge_proxy_retries_total" and value for (name, _), value in metrics.items())
    assert len(releases) == 1


def test_models_metrics_and_the_proxys_own_errors_are_openai_shaped():
    async def main():
        async with _cluster([FakeEngineCore("p"), FakeEngineCore("d")], [0], [1]) as (client, urls):
            models = await client.get("/v1/models")
            missing = await client.get("/v1/nothing")
            wrong_method = await client.get("/v1/completions")
            metrics = await _metrics(client)
            return (models.status, await models.json(), missing.status, await missing.json(), wrong_method.status,
                    await wrong_method.json(), wrong_method.headers.get("Allow"), metrics, urls,
                    client.server.app[PROXY_KEY].num_requests)  # fmt: skip

    (models_status, models, missing_status, missing, method_status, method, allow, metrics, urls, num_requests) = _run(main())
    assert models_status == 200 and models["data"][0]["id"] == "tiny", models
    assert missing_status == 404 and missing["error"]["code"] == 404 and "/v1/nothing" in missing["error"]["message"]
    assert method_status == 405 and method["error"]["code"] == 405 and allow == "POST", method
    assert num_requests == 0
    for role, url in (("prefill", urls[0]), ("decode", urls[1])):
        assert metrics[("kvbridge_proxy_node_healthy", _node(role, url))] == 1
        assert metrics[("kvbridge_proxy_node_in_flight", _node(role, url))] == 0
        assert metrics[("kvbridge_proxy_node_readmissions_total", _node(role, url))] == 0
    assert metrics[("kvbridge_proxy_node_requests_total", _node("decode", urls[1]))] == 1  # the /v1/models
    assert metrics[("kvbridge_proxy_kv_releases_total", (("outcome", "released"),))] == 0


def test_stream_events_are_passed_whole_and_only_kvbridge_objects_change():
    from kvbridge.serve.proxy_legs import _AnnotatedEvents

    events = _AnnotatedEvents(lambda chunk: chunk["kvbridge"].update(proxy={"decode_url": "u"}))
    stream = (b'data: {"choices": [{"text": "a"}]}\n\n'
              b'data: {"choices": [], "kvbridge": {"ttft_s": 0.1}}\n\n'
              b"data: [DONE]\n\n")  # fmt: skip
    out = b"".join(events.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + events.rest()
    first, last, done = out.split(b"\n\n")[:3]
    assert first == b'data: {"choices": [{"text": "a"}]}'  # byte for byte
    assert json.loads(last[len(b"data: "):])["kvbridge"] == {"ttft_s": 0.1, "proxy": {"decode_url": "u"}}
    assert done == b"data: [DONE]" and out.endswith(b"\n\n")
