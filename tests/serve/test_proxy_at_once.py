"""`kvbridge proxy` sends both P/D legs at once (serve/proxy_dispatch.py), attacked from outside:
real prefill, decode and proxy processes on loopback, NIXL over UCX, a plain HTTP client.

The first request to a decode node goes in turn and teaches the proxy the node's inbox; the next go
at once. Every answer must be the colocated engine's greedy tokens, read from the prefill's KV
where the legs went together; a decode node without an inbox is served in turn; a prefill node
killed under the requests costs no hang; and no block is left held on any node.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import tempfile
import time
import urllib.request

import pytest

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import http_json, start_node, start_proxy, wait_healthy, wait_proxy_routes_to_all
from kvbridge.serve.proxy_dispatch import InboxBook

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

PROMPTS = [f"The proxy sends both legs together, request {i}, once it knows the inbox. " * 3 for i in range(8)]
MAX_TOKENS = 5
WAIT_S = 2.0  # handoff_wait_s of the decode node
NODE_ARGS = ["--num-threads", "1", "--num-blocks", "128", "--max-model-len", "512"]
INBOX_EXTRA = f'{{"handoff_inbox": true, "handoff_wait_s": {WAIT_S}}}'
# The proxy checks a healthy node rarely: a prefill node killed under the requests is found by them.
PROXY_ARGS = ["--health-interval", "60", "--max-probe-backoff", "1"]


@pytest.fixture(scope="module")
def cluster():
    """A prefill node, a decode node with an inbox and one without, and a proxy over each decode node."""
    with tempfile.TemporaryDirectory() as log_dir:
        prefill = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS)
        decode = start_node("decode", "decode", log_dir, extra_args=[*NODE_ARGS, "--kv-connector-extra", INBOX_EXTRA])
        plain = start_node("plain", "decode", log_dir, extra_args=NODE_ARGS)
        proxy = start_proxy([prefill.url], [decode.url], log_dir, extra_args=PROXY_ARGS)
        plain_proxy = start_proxy([prefill.url], [plain.url], log_dir, extra_args=PROXY_ARGS, name="plain_proxy")
        procs = [prefill, decode, plain, proxy, plain_proxy]
        try:
            with LLM(max_model_len=512) as llm:  # the reference, while the nodes boot
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
            wait_healthy(procs, timeout_s=120)
            wait_proxy_routes_to_all(proxy, timeout_s=30)
            wait_proxy_routes_to_all(plain_proxy, timeout_s=30)
            yield {"prefill": prefill, "decode": decode, "plain": plain, "proxy": proxy, "plain_proxy": plain_proxy,
                   "expected": expected}  # fmt: skip
        finally:
            for proc in procs:
                proc.signal_stop()
            for proc in procs:
                proc.stop()


def complete(proxy, prompt: str, **extra) -> dict:
    status, answer = http_json(f"{proxy.url}/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra})
    assert status == 200, answer
    return answer


def dispatches(proxy) -> dict[str, float]:
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m: float(n) for m, n in re.findall(r'kvbridge_proxy_dispatches_total\{mode="(\w+)"\} ([0-9.e+]+)', text)}


def offers_taken(node) -> int:
    status, state = http_json(f"{node.url}/v1/kvbridge/state")
    assert status == 200, state
    return state["stats"]["connector"]["scheduler"]["num_offers_taken"]


def assert_nothing_held(*procs) -> None:
    deadline = time.monotonic() + 15
    for proc in procs:
        while True:
            state = http_json(f"{proc.url}/v1/kvbridge/state")[1]
            if state["stats"]["num_used_blocks"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert state["stats"]["num_used_blocks"] == 0 and state["integrity"]["ok"], (proc.name, state["stats"])


def test_after_the_first_request_the_proxy_sends_at_once_and_the_decode_reads_the_kv(cluster):
    proxy, decode, expected = cluster["proxy"], cluster["decode"], cluster["expected"]
    first = complete(proxy, PROMPTS[0])  # in turn: the decode's answer names its inbox
    assert first["choices"][0]["token_ids"] == expected[PROMPTS[0]], first
    assert first["kvbridge"]["proxy"]["dispatch"] == "in_turn"
    before, taken_before = dispatches(proxy), offers_taken(decode)
    for prompt in PROMPTS[1:4]:
        answer = complete(proxy, prompt)
        report = answer["kvbridge"]["proxy"]
        assert answer["choices"][0]["token_ids"] == expected[prompt], answer
        assert answer["kvbridge"]["num_external_tokens"] > 0, answer  # read from the prefill, not computed
        assert report["dispatch"] == "at_once" and report["disaggregated"] and report["recompute_reason"] is None, report
    after = dispatches(proxy)
    assert after["at_once"] == before.get("at_once", 0) + 3 and after["in_turn"] == before["in_turn"], after
    assert offers_taken(decode) == taken_before + 3
    assert_nothing_held(cluster["prefill"], decode)


def test_a_stream_sent_at_once_is_relayed_whole(cluster):
    proxy, expected = cluster["proxy"], cluster["expected"]
    complete(proxy, PROMPTS[0])  # the inbox is known, whichever test ran first
    body = {"prompt": PROMPTS[4], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{proxy.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [line[len(b"data: ") :] for line in resp.read().split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    tokens = [t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []]
    assert tokens == expected[PROMPTS[4]], chunks
    stats = next(c["kvbridge"] for c in chunks if "kvbridge" in c)
    assert stats["num_external_tokens"] > 0 and stats["proxy"]["dispatch"] == "at_once", stats
    assert_nothing_held(cluster["prefill"], cluster["decode"])


def test_a_prefill_lease_that_the_decode_did_not_read_is_not_held(cluster):
    """The decode's prefix cache already holds the prompt, so it reads nothing of the prefill's offer: the
    prefill's lease ends when the decode answers, not at the end of its lease (30 s)."""
    proxy, prefill, expected = cluster["proxy"], cluster["prefill"], cluster["expected"]
    complete(proxy, PROMPTS[0])  # the inbox is known
    complete(proxy, PROMPTS[3])
    answer = complete(proxy, PROMPTS[3])
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[3]], answer
    report = answer["kvbridge"]["proxy"]
    assert report["dispatch"] == "at_once" and report["kv_source"] == "decode_prefix_cache", report
    assert_nothing_held(prefill, cluster["decode"])


def test_a_decode_node_without_an_inbox_is_served_in_turn(cluster):
    proxy, expected = cluster["plain_proxy"], cluster["expected"]
    for prompt in PROMPTS[5:7]:
        answer = complete(proxy, prompt)
        assert answer["choices"][0]["token_ids"] == expected[prompt], answer
        assert answer["kvbridge"]["num_external_tokens"] > 0 and answer["kvbridge"]["proxy"]["dispatch"] == "in_turn"
    assert dispatches(proxy).get("at_once", 0) == 0
    assert_nothing_held(cluster["prefill"], cluster["plain"])


def test_a_decode_node_restarted_before_the_proxy_noticed_costs_one_recompute_not_a_wait(cluster):
    """kill -9 the decode node and start it again on its port between two health checks: the proxy still
    holds the dead instance's inbox and sends the next request at once to it. The new instance is not the
    one the decode leg names, so it computes the prompt at once (not after handoff_wait_s), the proxy
    releases the prefill's lease and learns the new inbox from that answer, and the next request reads."""
    proxy, prefill, decode, expected = cluster["proxy"], cluster["prefill"], cluster["decode"], cluster["expected"]
    complete(proxy, PROMPTS[0])  # the inbox is known
    decode.kill()
    decode.restart()
    wait_healthy([decode], timeout_s=120)

    t0 = time.monotonic()
    answer = complete(proxy, PROMPTS[5])
    assert time.monotonic() - t0 < WAIT_S, "the decode waited for an offer sent to its dead instance"
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[5]], answer
    report = answer["kvbridge"]["proxy"]
    assert report["dispatch"] == "at_once" and report["recompute_reason"] == "handoff_misdirected", report
    assert_nothing_held(prefill)  # released by the proxy, not held until its lease ends

    answer = complete(proxy, PROMPTS[6])
    report = answer["kvbridge"]["proxy"]
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[6]], answer
    assert report["dispatch"] == "at_once" and answer["kvbridge"]["num_external_tokens"] > 0, report
    assert_nothing_held(prefill, decode)


def test_a_prefill_node_killed_under_requests_sent_at_once_costs_no_hang(cluster):
    """Last: the prefill node is killed. Requests in flight, and those after it (the proxy still holds the
    node healthy), complete with the colocated tokens; a prefill leg that found no node offers nothing, so
    the decode computes at once rather than after its handoff_wait_s."""
    proxy, prefill, decode, expected = cluster["proxy"], cluster["prefill"], cluster["decode"], cluster["expected"]
    complete(proxy, PROMPTS[0])  # the inbox is known
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {pool.submit(complete, proxy, p): p for p in PROMPTS[:4]}
        time.sleep(0.05)
        prefill.kill()
        for future, prompt in futures.items():
            answer = future.result(timeout=WAIT_S + 60)  # a hang detector
            assert answer["choices"][0]["token_ids"] == expected[prompt], answer
    t0 = time.monotonic()
    answer = complete(proxy, PROMPTS[7])  # after the kill: no prefill node answers
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[7]], answer
    report = answer["kvbridge"]["proxy"]
    assert report["dispatch"] == "at_once" and report["recompute_reason"] == "no_prefill_node", report
    assert time.monotonic() - t0 < WAIT_S, "the decode waited for an offer that the proxy knew would not come"
    assert_nothing_held(decode)


def test_an_inbox_is_used_while_its_proof_has_the_margin_left_and_its_node_was_not_ejected():
    now = 1000.0
    book = InboxBook(margin_s=30.0, wall_clock=lambda: now)
    inbox = {"host": "127.0.0.1", "port": 5, "mac": "m" * 64, "expires_at": now + 600}
    assert not book.has_any() and book.fresh("http://d", 0) is None
    book.learn("http://d", {"handoff_inbox": inbox}, num_ejections=0)
    assert book.fresh("http://d", 0) == inbox
    assert book.fresh("http://d", 1) is None  # ejected since: maybe another process, another inbox
    assert book.fresh("http://e", 0) is None
    book.learn("http://d", {"handoff_inbox": {**inbox, "expires_at": now + 30}}, num_ejections=0)
    assert book.fresh("http://d", 0) is None  # within the margin
    book.learn("http://d", {"handoff_inbox": {**inbox, "mac": "", "expires_at": 0.0}}, num_ejections=0)
    assert book.fresh("http://d", 0) is not None  # a node without a secret names no end
    book.learn("http://d", {"remote_block_ids": [1]}, num_ejections=0)  # no inbox named: the last one stands
    book.learn("http://d", {"handoff_inbox": "garbage"}, num_ejections=0)
    assert book.fresh("http://d", 0) is not None
