"""Failures the proxy reports once, in kvbridge's words, about the node that failed.

Real processes on loopback: a prefill node, a decode node and the proxy.
* a decode node killed (kill -9) mid-stream: the client's stream ends with an OpenAI-shaped error
  event naming the decode node, not aiohttp's internals, and the proxy does not then claim that the
  healthy prefill node "did not release the blocks" (the decode node had read them);
* a dead prefill node: one warning in the proxy's log for a run of requests, not one per request.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import urllib.request

import pytest

from kvbridge.serve.launcher import PDCluster, http_json

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "128", "--max-model-len", "512"]
AIOHTTP_WORDS = ("TransferEncodingError", "ClientPayloadError", "Not enough data", "aiohttp")


def _log(proc) -> str:
    with open(proc.log_path, errors="replace") as f:
        return f.read()


def test_a_decode_node_killed_mid_stream_ends_the_stream_with_a_named_error():
    body = {"prompt": "A long answer is on its way. " * 3, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    cluster = PDCluster(node_args=NODE_ARGS)
    with cluster:
        decode = cluster.decode[0]
        request = urllib.request.Request(
            f"{cluster.proxy_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            first = resp.readline()
            assert first.startswith(b"data: {"), first
            decode.popen.send_signal(signal.SIGSTOP)  # no more tokens from here on ...
            decode.kill()  # ... and then it is gone, mid-stream
            rest = resp.read().decode()
        events = [e.strip()[len("data: ") :] for e in rest.split("\n\n") if e.strip().startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "[DONE]", rest[-2000:]
        error = json.loads(events[-2])["error"]
        cluster.proxy.stop()  # its releases finish before it exits: its log is complete
        proxy_log = _log(cluster.proxy)
    assert error["type"] == "upstream_error" and error["code"] == 502, error
    assert decode.url in error["message"] and "mid-stream" in error["message"], error
    assert not any(word in error["message"] for word in AIOHTTP_WORDS), error
    warnings = [line for line in proxy_log.splitlines() if " WARNING " in line]
    prefill_url = cluster.prefill[0].url
    broke = next(i for i, w in enumerate(warnings) if "failed mid-stream" in w)
    assert not [w for w in warnings[broke:] if "release" in w or "prefill" in w or prefill_url in w], warnings[broke:]


def test_a_dead_prefill_node_is_one_warning_not_one_per_request():
    num_requests = 12
    cluster = PDCluster(node_args=NODE_ARGS)
    with cluster:
        cluster.prefill[0].kill()
        for i in range(num_requests):
            status, answer = http_json(f"{cluster.proxy_url}/v1/completions", {"prompt": f"request {i} " * 8, "max_tokens": 2})
            assert status == 200 and answer["kvbridge"]["proxy"]["recompute_reason"] == "no_prefill_node", answer
        cluster.proxy.stop()
        proxy_log = _log(cluster.proxy)
    lines = [line for line in proxy_log.splitlines() if "no prefill node answered" in line]
    # One line, then one per 30 s window: far fewer than one per request however slow the machine.
    assert 1 <= len(lines) <= num_requests // 2, lines
