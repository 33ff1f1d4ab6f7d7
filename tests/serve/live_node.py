"""A real `kvbridge serve` process for black-box API tests, and the plain HTTP client they use.

    with live_node() as node:                       # tiny model, role both, on loopback
        status, body = post_raw(f"{node.url}/v1/completions", b"...")
        assert_serves_correctly(node)               # /health is 200, a greedy request is right

The reference tokens come from a colocated `LLM` with the same model and max_model_len, computed
while the node boots.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import ManagedProcess, http_json, start_node, wait_healthy

MAX_MODEL_LEN = 256
NODE_ARGS = ("--num-threads", "1", "--num-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN))
VOCAB_SIZE = 384  # the tiny preset's
PROMPT = "One request must never take a node down. "
MAX_TOKENS = 8
GREEDY_BODY = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}


class LiveNode(NamedTuple):
    url: str
    expected_token_ids: list[int]  # the colocated engine's greedy completion of GREEDY_BODY
    process: ManagedProcess


@contextlib.contextmanager
def live_node(extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[LiveNode]:
    """One `kvbridge serve --role both` node; always stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="kvbridge-node-") as log_dir:
        proc = start_node("node", "both", log_dir, extra_args=[*NODE_ARGS, *extra_args], env=env)
        try:
            with LLM(max_model_len=MAX_MODEL_LEN) as llm:  # the reference, while the node boots
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = list(llm.generate(PROMPT, params)[0].outputs[0].token_ids)
            wait_healthy([proc], timeout_s=120)
            yield LiveNode(proc.url, expected, proc)
        finally:
            proc.stop()


def post_raw(url: str, data: bytes, timeout_s: float = 60.0) -> tuple[int, Any]:
    """POST raw bytes as JSON; returns (status, decoded JSON or the text). Raises on a timeout."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", parts.path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    finally:
        conn.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def assert_serves_correctly(node: LiveNode) -> None:
    """The node is healthy and a greedy request returns the colocated engine's tokens."""
    status, health = http_json(f"{node.url}/health", timeout_s=10)
    assert status == 200, f"the node is not healthy: {health}; log:\n{node.process.log_tail()}"
    status, body = http_json(f"{node.url}/v1/completions", GREEDY_BODY, timeout_s=60)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == node.expected_token_ids, body


def assert_openai_error(status: int, body: Any, expected_status: int, param: str | None) -> None:
    """`body` is an OpenAI-shaped JSON error with `expected_status` that names `param`."""
    assert status == expected_status, (status, body)
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    assert body["error"]["code"] == expected_status and body["error"]["message"], body
    assert body["error"]["param"] == param, body
