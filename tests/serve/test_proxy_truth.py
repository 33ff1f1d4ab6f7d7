"""The proxy reports what the decode node did, not what it asked for.

Real processes on loopback: one prefill node and three decode nodes behind one round-robin proxy.
One decode node shares the prefill node's side-channel secret, one has a wrong secret, and one
allows no loopback peer (`allowed_peers`). Every answer is the colocated engine's; only the first
node's answers may say `disaggregated`, and the others must say `recomputed` with the decode
node's own reason, in JSON answers and in streams, and in the proxy's /metrics.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import urllib.request

import pytest

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import http_json, start_node, start_proxy, wait_healthy, wait_proxy_routes_to_all

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "128", "--max-model-len", "512"]
FAST_FAIL = {"handshake_timeout_s": 1.0, "handshake_retries": 0, "transfer_timeout_s": 5.0}
SECRET, WRONG_SECRET = "the-cluster-secret-of-32-bytes-or-more", "not-the-cluster-secret-of-32-bytes-or-more"
MAX_TOKENS = 4
NUM_ROUNDS = 2  # each decode node gets one JSON answer and one stream


def _stream(url: str, body: dict) -> tuple[list[int], dict]:
    """POST a streaming completion; (the token ids, the `kvbridge` object of the chunk that carries it)."""
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    token_ids, kvbridge = [], None
    with urllib.request.urlopen(request, timeout=120) as resp:
        for line in resp.read().decode().split("\n\n"):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                token_ids += choice.get("token_ids") or []
            kvbridge = chunk.get("kvbridge", kvbridge)
    return token_ids, kvbridge


def test_the_proxy_reports_what_each_decode_node_did():
    prompts = [f"Request {i} asks the proxy to tell the truth about where its KV came from. " * 2 for i in range(6)]
    with tempfile.TemporaryDirectory() as log_dir:
        procs = []
        try:
            extra = ["--kv-connector-extra"]
            prefill = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS, env={"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET})
            decodes = {
                "pulls": start_node("decode-ok", "decode", log_dir, extra_args=[*NODE_ARGS, *extra, json.dumps(FAST_FAIL)],
                                    env={"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET}),
                "authentication_failed": start_node("decode-wrong-secret", "decode", log_dir,
                                             extra_args=[*NODE_ARGS, *extra, json.dumps(FAST_FAIL)],
                                             env={"KVBRIDGE_SIDE_CHANNEL_SECRET": WRONG_SECRET}),
                "peer_not_allowed": start_node("decode-no-peers", "decode", log_dir,
                                            extra_args=[*NODE_ARGS, *extra, json.dumps({**FAST_FAIL, "allowed_peers": ["10.0.0.0/8"]})],
                                            env={"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET}),
            }  # fmt: skip
            proxy = start_proxy([prefill.url], [d.url for d in decodes.values()], log_dir, 60.0, ["--routing", "round-robin"],
                                env={"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET})  # fmt: skip
            procs = [prefill, *decodes.values(), proxy]
            with LLM(max_model_len=512) as llm:  # the reference, while the nodes boot
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
            wait_healthy(procs, timeout_s=120)
            wait_proxy_routes_to_all(proxy, 60)

            seen: dict[str, list[dict]] = {}
            for i, prompt in enumerate(prompts):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                if i < len(prompts) // NUM_ROUNDS:
                    status, answer = http_json(f"{proxy.url}/v1/completions", body)
                    assert status == 200, answer
                    token_ids, kvbridge = answer["choices"][0]["token_ids"], answer["kvbridge"]
                else:
                    token_ids, kvbridge = _stream(f"{proxy.url}/v1/completions", body)
                assert token_ids == expected[i], (i, kvbridge)
                seen.setdefault(kvbridge["proxy"]["decode_url"], []).append(kvbridge)
            with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
        finally:
            for proc in procs:
                proc.stop()

    for expectation, node in decodes.items():
        answers = seen.get(node.url, [])
        assert len(answers) == NUM_ROUNDS, (node.name, seen.keys())
        for kvbridge in answers:
            report = kvbridge["proxy"]
            if expectation == "pulls":
                assert report["disaggregated"] and not report["recomputed"], kvbridge
                assert report["recompute_reason"] is None and kvbridge["num_external_tokens"] > 0, kvbridge
                assert report["kv_source"] == "prefill_node", kvbridge
            else:
                assert not report["disaggregated"] and report["recomputed"], (node.name, kvbridge)
                assert report["recompute_reason"] == expectation, (node.name, kvbridge)
                assert kvbridge["num_external_tokens"] == 0 and report["kv_source"] == "computed", kvbridge
                if expectation == "authentication_failed":  # the decode node's own words, passed on
                    assert "AuthenticationError" in report["kv_load_error"] == kvbridge["kv_load_error"], kvbridge
                if expectation == "peer_not_allowed":  # refused before any pull: the scheduler's words
                    assert "allowed_peers" in report["kv_load_error"] == kvbridge["kv_load_error"], kvbridge
                    assert kvbridge["num_failed_load_blocks"] == 0, kvbridge
    for reason in ("authentication_failed", "peer_not_allowed"):
        assert f'kvbridge_proxy_recomputes_total{{reason="{reason}"}} {float(NUM_ROUNDS)}' in metrics, metrics

