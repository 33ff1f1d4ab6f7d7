"""Real node and proxy processes on loopback: routing with plain engines, then P/D over NIXL.

Every child is started through kvbridge.serve.launcher and stopped in a finally/fixture
finaliser, whatever the test does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import tempfile
import time

import aiohttp
import pytest

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import PDCluster, http_json, start_node, start_proxy, wait_healthy, wait_proxy_routes_to_all

MAX_TOKENS = 6
NODE_ARGS = ["--num-threads", "1", "--num-blocks", "256", "--max-model-len", "512"]
PROMPTS = [
    "Hi",
    "A medium prompt that spans a few KV blocks of sixteen tokens each.",
    "Long shared context. " * 12,
    "Long shared context. " * 12 + "And a question at the end?",  # partly cached on the decode side
    "A medium prompt that spans a few KV blocks of sixteen tokens each.",  # fully cached
]


def _reference(prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy completions of one colocated engine without a connector."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with LLM(max_model_len=512) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def _complete(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, response = http_json(f"{url}/v1/completions", body, timeout_s=60)
    assert status == 200, response
    return response


def _wait_all_blocks_released(node_urls: list[str], timeout_s: float = 30.0) -> list[dict]:
    """Poll each node's state until no block is in use (held blocks are freed asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [http_json(f"{url}/v1/kvbridge/state")[1] for url in node_urls]
        if all(s["stats"]["num_used_blocks"] == 0 for s in states) or time.monotonic() > deadline:
            return states


def _assert_clean(states: list[dict]) -> None:
    for state in states:
        assert state["integrity"] == {"ok": True, "error": None}, state
        stats = state["stats"]
        assert stats["num_used_blocks"] == 0, stats  # every block free or cached
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
        assert not state["has_unfinished_requests"] and state["num_running"] == 0


def test_plain_nodes_round_robin_through_the_proxy():
    with tempfile.TemporaryDirectory() as log_dir:
        nodes, proxy = [], None
        try:
            nodes = [start_node(f"node{i}", "both", log_dir, extra_args=[*NODE_ARGS, "--no-connector"]) for i in range(2)]
            urls = [n.url for n in nodes]
            proxy = start_proxy(urls, urls, log_dir, extra_args=["--routing", "round-robin"])
            expected = _reference(PROMPTS[:4])  # while the processes boot
            wait_healthy([*nodes, proxy], timeout_s=120)
            wait_proxy_routes_to_all(proxy, timeout_s=60)  # round-robin over both, from the first request
            bodies = [_complete(proxy.url, p) for p in PROMPTS[:4]]
            states = _wait_all_blocks_released(urls)
        finally:
            for proc in [*nodes, *([proxy] if proxy else [])]:
                proc.stop()
    assert [b["choices"][0]["token_ids"] for b in bodies] == expected
    assert [b["kvbridge"]["proxy"]["prefill_url"] for b in bodies] == [urls[0], urls[1], urls[0], urls[1]]
    assert [b["kvbridge"]["proxy"]["decode_url"] for b in bodies] == [urls[0], urls[1], urls[0], urls[1]]
    assert all(b["kv_transfer_params"] is None and b["kvbridge"]["num_external_tokens"] == 0 for b in bodies)
    _assert_clean(states)
    assert all(proc.popen.returncode == 0 for proc in nodes), "nodes must exit cleanly on SIGTERM"


# ---------------------------------------------------------------- P/D over NIXL

needs_connector = pytest.mark.skipif(
    importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None,
    reason="the NixlConnector (kvbridge/connectors/nixl/connector.py) is not there yet",
)


@pytest.fixture(scope="module")
def pd_cluster():
    cluster = PDCluster("tiny", node_args=NODE_ARGS, startup_timeout_s=120)
    with cluster:
        yield cluster


@pytest.mark.nixl
@needs_connector
def test_pd_completions_equal_colocated(pd_cluster):
    expected = _reference(PROMPTS)
    bodies = [_complete(pd_cluster.proxy_url, p) for p in PROMPTS]
    assert [b["choices"][0]["token_ids"] for b in bodies] == expected
    stats = [b["kvbridge"] for b in bodies]
    assert stats[2]["num_external_tokens"] > 0 and stats[2]["kv_transfer_bytes"] > 0  # pulled from prefill
    assert stats[3]["num_cached_tokens"] > 0  # the shared prefix came from the decode node's own cache
    assert stats[3]["num_external_tokens"] < len(PROMPTS[3])  # only the rest was pulled
    assert stats[4]["num_cached_tokens"] >= stats[1]["num_external_tokens"] - 16
    _assert_clean(_wait_all_blocks_released([p.url for p in pd_cluster.prefill + pd_cluster.decode]))


@pytest.mark.nixl
@needs_connector
def test_pd_streaming_through_the_proxy(pd_cluster):
    prompt = "Streamed through the proxy: " + "s" * 50
    expected = _reference([prompt])[0]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    status, raw = http_json(f"{pd_cluster.proxy_url}/v1/completions", body, timeout_s=60)
    assert status == 200
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == expected
    assert chunks[-1]["kvbridge"]["num_external_tokens"] >= 64  # the prompt's full blocks were pulled
    # The proxy's entry, as in a plain answer: the stream's last chunk carries it.
    _, plain = http_json(f"{pd_cluster.proxy_url}/v1/completions", {**body, "stream": False}, timeout_s=60)
    streamed = chunks[-1]["kvbridge"]["proxy"]
    assert streamed.keys() == plain["kvbridge"]["proxy"].keys()
    assert streamed["disaggregated"] and not streamed["recomputed"] and streamed["decode_attempts"] == 1
    assert streamed["decode_url"] in [d.url for d in pd_cluster.decode]


@pytest.mark.nixl
@needs_connector
def test_pd_200_concurrent_requests_leak_no_blocks(pd_cluster):
    num_requests = 200
    prompts = [f"request {i}: " + "p" * (i % 40) for i in range(num_requests)]

    async def main():
        limit = aiohttp.TCPConnector(limit=num_requests)
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(connector=limit, timeout=timeout) as session:

            async def one(i: int):
                body = {"prompt": prompts[i], "max_tokens": 3, "temperature": 0}
                async with session.post(f"{pd_cluster.proxy_url}/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()

            return await asyncio.gather(*(one(i) for i in range(num_requests)))

    results = asyncio.run(main())
    failed = [body for status, body in results if status != 200]
    assert not failed, failed[:3]
    assert [body["choices"][0]["token_ids"] for _, body in results] == _reference(prompts, max_tokens=3)
    # Prompts of 16+ tokens have a full block: each was pulled from the prefill node or cached.
    for prompt, (_, body) in zip(prompts, results):
        stats = body["kvbridge"]
        proxy = stats.get("proxy") or {}
        why = {k: proxy.get(k) for k in ("dispatch", "recompute_reason", "kv_load_error", "prefill_attempts", "prefill_s")}
        assert stats["num_external_tokens"] + stats["num_cached_tokens"] >= 16 * (len(prompt) // 16), f"{prompt!r}: {why}"
    assert sum(body["kvbridge"]["num_external_tokens"] for _, body in results) > 0
    _assert_clean(_wait_all_blocks_released([p.url for p in pd_cluster.prefill + pd_cluster.decode]))
