"""vLLM's own router (`vllm-router` from PyPI, the dev extra) in front of `kvbridge serve` nodes on loopback,
as a fleet runs it: P/D mode (`--vllm-pd-disaggregation`), two prefill nodes publishing KV events, the
`kv_aware` prefill policy fed by them (`--pd-kv-events`). A completion goes through disaggregated (the
decode node pulled the prompt's KV from a prefill node), and a repeated long prefix goes to the prefill
node that holds it, whichever node the policy would pick without the events."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.serve.launcher import HOST, ManagedProcess, free_ports, http_json, start_node, wait_healthy
from kvbridge.transfer.kv_event_messages import BlockStored, decode_batch

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "96", "--max-model-len", "512"]
# Two long prompts that share nothing; the tiny preset's byte-level tokenizer makes ~1 token per character.
PREFIXES = ("The first document, about rivers and the sea. " * 7, "A second text on mountains, snow and ice! " * 7)


class Fleet(NamedTuple):
    router: ManagedProcess
    prefill: list[ManagedProcess]
    decode: ManagedProcess
    events: list[str]  # each prefill node's KV-event endpoint


def _router_argv(port: int, prefill: list[ManagedProcess], decode: ManagedProcess, events: list[str]) -> list[str]:
    exe = shutil.which("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not installed: pip install -e '.[dev]' (it is in the dev extra)")
    argv = [exe, "--host", HOST, "--port", str(port), "--vllm-pd-disaggregation", "--decode", decode.url,
            "--prefill-policy", "kv_aware", "--decode-policy", "round_robin", "--log-level", "info"]  # fmt: skip
    for node, endpoint in zip(prefill, events):
        argv += ["--prefill", node.url, "--pd-kv-events", f"{node.url}={endpoint}"]
    return argv


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="kvbridge-router-") as log_dir:
        events = [f"ipc://{log_dir}/events{i}" for i in range(2)]  # bound by the node: loopback only
        procs: list[ManagedProcess] = []
        try:
            prefill = []
            for i, endpoint in enumerate(events):
                config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
                prefill.append(start_node(f"prefill{i}", "prefill", log_dir, extra_args=[*NODE_ARGS, "--kv-events-config", config]))
                procs.append(prefill[-1])
            decode = start_node("decode0", "decode", log_dir, extra_args=NODE_ARGS)
            procs.append(decode)
            wait_healthy(procs, timeout_s=120)
            (port,) = free_ports(1)
            router = ManagedProcess("vllm-router", f"http://{HOST}:{port}", _router_argv(port, prefill, decode, events), log_dir)
            procs.append(router)
            wait_healthy([router], timeout_s=60)
            yield Fleet(router, prefill, decode, events)
        finally:
            for proc in procs:
                proc.stop()


def _num_ok(node: ManagedProcess) -> float:
    with urllib.request.urlopen(f"{node.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvbridge_requests_total" and sample.labels.get("outcome") == "ok":
                return sample.value
    return 0.0


def _complete(url: str, prompt: str | list[int]) -> dict:
    status, body = http_json(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout_s=60)
    assert status == 200, body
    return body


def _served_by(fleet: Fleet, prompt: str | list[int]) -> tuple[int, dict]:
    """Send `prompt` through the router; (index of the prefill node that served it, the response)."""
    before = [_num_ok(p) for p in fleet.prefill]
    body = _complete(fleet.router.url, prompt)
    grew = [i for i, p in enumerate(fleet.prefill) if _num_ok(p) > before[i]]
    assert len(grew) == 1, f"prefill nodes that served the request: {grew}"
    return grew[0], body


def test_a_completion_goes_through_vllm_router_disaggregated(fleet):
    _, body = _served_by(fleet, "Hello from behind vLLM's router. " * 6)
    stats = body["kvbridge"]
    assert stats["num_external_tokens"] > 0 and stats["kv_external_source"] == "peer", stats
    assert stats["num_failed_load_blocks"] == 0 and body["choices"][0]["finish_reason"] == "length", body


def _wait_for_stored(endpoint: str, node: ManagedProcess, prompt: str | list[int]) -> None:
    """Warm `node` with `prompt` directly and wait until its KV events say the blocks are stored (the
    router subscribes to the same socket)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.2)  # a SUB that connects misses what is published before its subscription lands
        _complete(node.url, prompt)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sub.poll(int((deadline - time.monotonic()) * 1000)):
            batch = decode_batch(sub.recv_multipart()[2])
            if any(isinstance(e, BlockStored) and e.parent_block_hash is None for e in batch.events):
                return
        raise AssertionError(f"{node.name} published no BlockStored for the warm-up prompt")
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("form", ["text", "token ids"])
def test_kv_aware_sends_a_repeated_prefix_to_the_prefill_node_that_holds_it(fleet, form):
    # Text is tokenized by the router through a node's POST /tokenize; token ids are hashed as they are.
    prefixes = list(PREFIXES) if form == "text" else [[(7 * i + 3 * k) % 250 + 1 for k in range(300)] for i in (1, 2)]
    # Each case starts from empty caches (AllBlocksCleared tells the router), so only what follows tells the nodes apart.
    for node in fleet.prefill:
        status, body = http_json(f"{node.url}/v1/kvbridge/reset_prefix_cache", {}, timeout_s=60)
        assert status == 200, body
    for i, (endpoint, node) in enumerate(zip(fleet.events, fleet.prefill)):
        _wait_for_stored(endpoint, node, prefixes[i])  # node i holds prefix i: the router knows only from events
    time.sleep(0.5)  # the router's subscriber got the same batches; leave it a moment to index them
    order = [0, 1, 1, 0, 0, 1, 0, 1]
    suffix = (lambda k: f"question {k}?") if form == "text" else (lambda k: [251, 252, k + 1])
    served = [_served_by(fleet, prefixes[i] + suffix(k))[0] for k, i in enumerate(order)]
    assert served == order, f"prefix i went to prefill nodes {served}, expected {order}"


def test_tokenize_answers_as_vllm_with_the_ids_the_node_serves(fleet):
    node = fleet.prefill[0]
    prompt = "Tokens a router hashes. "
    status, body = http_json(f"{node.url}/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200, body
    served = _complete(node.url, prompt)
    assert body["count"] == len(body["tokens"]) == served["usage"]["prompt_tokens"] and body["max_model_len"] == 512
    ids = [5, 6, 7]
    assert http_json(f"{node.url}/tokenize", {"prompt": ids})[1]["tokens"] == ids
    status, chat = http_json(f"{node.url}/tokenize", {"messages": [{"role": "user", "content": prompt}]})
    assert status == 200 and chat["count"] > body["count"], chat  # the chat template wraps the prompt
    for bad in ({"prompt": ""}, {"prompt": ["a", 1]}, {"model": "other", "prompt": "x"}, {"nothing": 1}):
        status, err = http_json(f"{node.url}/tokenize", bad)
        assert status in (400, 404) and "error" in err, (bad, status, err)
