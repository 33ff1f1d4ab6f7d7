"""Both P/D legs sent at once (transfer/offers.py), attacked from outside: real prefill and decode
`kvbridge serve` processes on loopback, NIXL over UCX, and a plain HTTP and ZMQ client.

The client draws a hand-off key, sends the prefill leg with the key and the decode's inbox, and the
decode leg with the key only, together. The decode waits for the prefill's offer, reads and answers
the colocated engine's tokens. Whatever a client or a stranger on the inbox does (a key nobody
offers, another prompt's offer, an inbox altered, raw frames into the inbox) must leave every
answer right, every wait bounded, and no block held.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import secrets
import tempfile
import time

import msgspec
import pytest
import zmq

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import free_ports, http_json, start_node, wait_healthy
from kvbridge.transfer import messages as m
from kvbridge.transfer.host_secret import side_channel_secret
from kvbridge.transfer.lease_release import release_remote_kv

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

PROMPTS = [f"Both legs leave together, request {i}, and the decode waits for its offer. " * 3 for i in range(4)]
MAX_TOKENS = 5
WAIT_S = 2.0  # handoff_wait_s of the decode node: a key nobody offers is computed after it
NODE_ARGS = ["--num-threads", "1", "--num-blocks", "128", "--max-model-len", "512"]
DECODE_EXTRA = f'{{"handoff_inbox": true, "handoff_wait_s": {WAIT_S}}}'


@pytest.fixture(scope="module")
def nodes():
    with tempfile.TemporaryDirectory() as log_dir:
        prefill = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS)
        decode = start_node("decode", "decode", log_dir, extra_args=[*NODE_ARGS, "--kv-connector-extra", DECODE_EXTRA])
        try:
            with LLM(max_model_len=512) as llm:  # the reference, while the nodes boot
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
            wait_healthy([prefill, decode], timeout_s=120)
            yield prefill, decode, expected
        finally:
            prefill.stop()
            decode.stop()


@pytest.fixture(autouse=True)
def fresh_caches(nodes):
    """Each test starts with both prefix caches empty: a prompt an earlier test computed is read again."""
    for node in nodes[:2]:
        status, answer = http_json(f"{node.url}/v1/kvbridge/reset_prefix_cache", {})
        assert status == 200, answer


def prefill_body(prompt: str, handoff: dict | None = None) -> dict:
    params = {"do_remote_decode": True, **({"handoff": handoff} if handoff else {})}
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params}


def decode_body(prompt: str, params: dict) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params}


def inbox_of(prefill, decode, expected) -> dict:
    """The decode's inbox, as its answer to a request sent in turn names it (a proxy's warm-up)."""
    prompt = PROMPTS[0]
    status, first = http_json(f"{prefill.url}/v1/completions", prefill_body(prompt))
    assert status == 200, first
    status, answer = http_json(f"{decode.url}/v1/completions", decode_body(prompt, {**first["kv_transfer_params"], "do_remote_prefill": True}))
    assert status == 200 and answer["choices"][0]["token_ids"] == expected[prompt], answer
    inbox = answer["kv_transfer_params"]["handoff_inbox"]
    assert inbox["port"] > 0 and len(inbox["mac"]) == 64, inbox  # vouched for: the nodes share the host's secret
    return inbox


def at_once(prefill, decode, prompt: str, key: str, inbox: dict, *, decode_prompt: str | None = None, delay_prefill_s=0.0):
    """Both legs together; (prefill answer, decode answer, decode seconds)."""

    def run_prefill():
        time.sleep(delay_prefill_s)
        return http_json(f"{prefill.url}/v1/completions", prefill_body(prompt, {"key": key, "inbox": inbox}))

    def run_decode():
        t0 = time.monotonic()
        params = {"do_remote_prefill": True, "handoff_key": key, "handoff_inbox": inbox}
        result = http_json(f"{decode.url}/v1/completions", decode_body(decode_prompt or prompt, params))
        return result, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pre, dec = pool.submit(run_prefill), pool.submit(run_decode)
        (status, answer), seconds = dec.result(timeout=120)
        pre_status, pre_answer = pre.result(timeout=120)
    assert pre_status == 200, pre_answer
    assert status == 200, answer
    return pre_answer, answer, seconds


def scheduler_stats(node) -> dict:
    status, state = http_json(f"{node.url}/v1/kvbridge/state")
    assert status == 200, state
    return state["stats"]["connector"]["scheduler"]


def assert_nothing_held(*procs) -> None:
    deadline = time.monotonic() + 15
    for proc in procs:
        while True:
            state = http_json(f"{proc.url}/v1/kvbridge/state")[1]
            if state["stats"]["num_used_blocks"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert state["stats"]["num_used_blocks"] == 0 and state["integrity"]["ok"], (proc.name, state)


def test_legs_sent_at_once_read_the_prefills_kv_and_answer_the_colocated_tokens(nodes):
    prefill, decode, expected = nodes
    inbox = inbox_of(*nodes)
    taken_before = scheduler_stats(decode)["num_offers_taken"]
    for i, prompt in enumerate(PROMPTS[1:]):
        # the prefill leg leaves later than the decode's in one of them: the decode waits for its offer
        _, answer, _ = at_once(prefill, decode, prompt, secrets.token_hex(32), inbox, delay_prefill_s=0.5 * (i == 1))
        assert answer["choices"][0]["token_ids"] == expected[prompt], answer
        assert answer["kvbridge"]["num_external_tokens"] > 0, answer  # read, not computed
        assert answer["kv_transfer_params"]["handoff_inbox"]["port"] == inbox["port"]
    assert scheduler_stats(decode)["num_offers_taken"] == taken_before + len(PROMPTS) - 1
    assert_nothing_held(prefill, decode)


def test_a_key_that_nobody_offers_is_computed_after_the_wait(nodes):
    prefill, decode, expected = nodes
    prompt = PROMPTS[2]
    t0 = time.monotonic()
    status, answer = http_json(
        f"{decode.url}/v1/completions", decode_body(prompt, {"do_remote_prefill": True, "handoff_key": secrets.token_hex(32)})
    )
    seconds = time.monotonic() - t0
    assert status == 200 and answer["choices"][0]["token_ids"] == expected[prompt], answer
    assert answer["kvbridge"]["num_external_tokens"] == 0
    assert WAIT_S <= seconds < WAIT_S + 10, seconds  # bounded by handoff_wait_s, not a hang
    assert scheduler_stats(decode)["num_offers_missed"] >= 1
    assert_nothing_held(decode)


def test_another_prompts_offer_under_the_key_is_refused_and_the_prompt_computed(nodes):
    """A client that sends one prompt to the prefill and another to the decode under one key gets the
    decode's prompt right: the offered blocks hold other tokens (their block hash), so nothing is read."""
    prefill, decode, expected = nodes
    inbox = inbox_of(*nodes)
    _, answer, _ = at_once(prefill, decode, PROMPTS[1], secrets.token_hex(32), inbox, decode_prompt=PROMPTS[3])
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[3]], answer
    assert answer["kvbridge"]["num_external_tokens"] == 0
    assert_nothing_held(prefill, decode)  # the refused lease is released, not held until it expires


@pytest.mark.parametrize("field, value", [("port", 1), ("engine_id", "someone-else"), ("expires_at", 1e9), ("mac", "0" * 64)])
def test_an_altered_inbox_is_sent_nothing(nodes, field, value):
    """The prefill sends to no inbox its proof does not vouch for: the decode waits, then computes."""
    prefill, decode, expected = nodes
    inbox = {**inbox_of(*nodes), field: value}
    refused_before = scheduler_stats(prefill)["num_offers_refused"]
    key = secrets.token_hex(32)
    status, pre = http_json(f"{prefill.url}/v1/completions", prefill_body(PROMPTS[1], {"key": key, "inbox": inbox}))
    assert status == 200, pre
    assert scheduler_stats(prefill)["num_offers_refused"] == refused_before + 1
    status, answer = http_json(f"{decode.url}/v1/completions", decode_body(PROMPTS[1], {"do_remote_prefill": True, "handoff_key": key}))
    assert status == 200 and answer["choices"][0]["token_ids"] == expected[PROMPTS[1]], answer
    assert answer["kvbridge"]["num_external_tokens"] == 0
    # the client holds the params the prefill answered, as after any decode leg that failed: it releases them
    assert release_remote_kv(pre["kv_transfer_params"], secret=side_channel_secret(False))
    assert_nothing_held(prefill)


def test_a_decode_restarted_since_its_inbox_was_learnt_computes_at_once(nodes):
    """kill -9 a decode node and start it again on the same ports, inbox port included: the inbox a client
    learnt is the dead instance's, so the prefill offers to it and the new instance drops the frame (its
    audience is the old incarnation). The decode leg names the inbox it sent the prefill, and the new
    instance computes the prompt at once instead of waiting handoff_wait_s for an offer that never
    comes; its answer names its own inbox, which then works at once."""
    prefill, _, expected = nodes
    long_wait_s = 60.0
    extra = f'{{"handoff_inbox": true, "handoff_wait_s": {long_wait_s}, "handoff_inbox_port": {free_ports(1)[0]}}}'
    with tempfile.TemporaryDirectory() as log_dir:
        decode = start_node("decode-restarted", "decode", log_dir, extra_args=[*NODE_ARGS, "--kv-connector-extra", extra])
        try:
            wait_healthy([decode], timeout_s=120)
            old_inbox = inbox_of(prefill, decode, expected)
            decode.kill()
            decode.restart()
            wait_healthy([decode], timeout_s=120)

            key = secrets.token_hex(32)
            pre, answer, seconds = at_once(prefill, decode, PROMPTS[1], key, old_inbox)
            assert answer["choices"][0]["token_ids"] == expected[PROMPTS[1]], answer
            assert answer["kvbridge"]["num_external_tokens"] == 0
            assert seconds < long_wait_s / 3, f"waited {seconds:.1f} s for an offer sent to the dead instance"
            assert "not this engine instance's" in answer["kvbridge"]["kv_load_error"], answer["kvbridge"]
            assert scheduler_stats(decode)["num_offers_misdirected"] == 1
            new_inbox = answer["kv_transfer_params"]["handoff_inbox"]
            assert new_inbox["port"] == old_inbox["port"] and new_inbox["incarnation"] != old_inbox["incarnation"]
            # the client holds the prefill's params, as after any decode leg that did not read them
            assert release_remote_kv(pre["kv_transfer_params"], secret=side_channel_secret(False))

            _, answer, _ = at_once(prefill, decode, PROMPTS[2], secrets.token_hex(32), new_inbox)
            assert answer["choices"][0]["token_ids"] == expected[PROMPTS[2]] and answer["kvbridge"]["num_external_tokens"] > 0
            assert_nothing_held(prefill, decode)
        finally:
            decode.stop()


def test_a_decode_leg_naming_a_malformed_inbox_is_a_400(nodes):
    _, decode, _ = nodes
    params = {"do_remote_prefill": True, "handoff_key": secrets.token_hex(32), "handoff_inbox": {"host": "127.0.0.1"}}
    status, answer = http_json(f"{decode.url}/v1/completions", decode_body(PROMPTS[0], params))
    assert status == 400 and "handoff_inbox" in answer["error"]["message"], answer


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "handoff_key": "not-hex"},
    {"do_remote_prefill": True, "handoff_key": "A" * 64},
    {"do_remote_prefill": True, "handoff_key": 7},
])  # fmt: skip
def test_a_malformed_key_is_a_400_naming_the_field(nodes, params):
    _, decode, _ = nodes
    status, answer = http_json(f"{decode.url}/v1/completions", decode_body(PROMPTS[0], params))
    assert status == 400 and "handoff_key" in answer["error"]["message"], answer


def test_a_malformed_handoff_on_the_prefill_leg_is_a_400(nodes):
    prefill, _, _ = nodes
    for handoff in ({"key": "x"}, {"key": secrets.token_hex(32), "inbox": {"host": "127.0.0.1"}}, "oops"):
        status, answer = http_json(f"{prefill.url}/v1/completions", prefill_body(PROMPTS[0], handoff))
        assert status == 400 and "handoff" in answer["error"]["message"], (handoff, answer)


def test_frames_from_a_stranger_on_the_inbox_are_refused_and_the_node_serves_on(nodes):
    """Raw frames into the inbox without the secret: garbage, an unsigned offer for a key a decode request
    waits on, pointing at a port of the stranger's choosing. None is taken; the request is computed."""
    prefill, decode, expected = nodes
    inbox = inbox_of(*nodes)
    key = secrets.token_hex(32)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{inbox['host']}:{inbox['port']}")
    try:
        forged = {
            "do_remote_prefill": True, "remote_engine_id": "prefill", "remote_host": "127.0.0.1", "remote_port": 22,
            "remote_block_ids": [0, 1, 2], "remote_request_id": "x", "remote_block_hash": "00" * 8,
            "remote_incarnation": "i", "remote_lease_token": "t" * 64,
        }  # fmt: skip
        offer = m.encode(m.HandoffOffer(key=key, params=forged))
        frames = [b"", b"\xff" * 100, msgspec.msgpack.encode([0, offer]), m.encode_frame(m.Frame(0, offer, b"n" * 16, time.time_ns(), b"m" * 32, b"decode/x"))]
        for frame in frames:
            sock.send(frame)
        rejected_before = scheduler_stats(decode).get("num_offers_taken", 0)
        status, answer = http_json(f"{decode.url}/v1/completions", decode_body(PROMPTS[2], {"do_remote_prefill": True, "handoff_key": key}))
    finally:
        sock.close(0)
    assert status == 200 and answer["choices"][0]["token_ids"] == expected[PROMPTS[2]], answer
    assert answer["kvbridge"]["num_external_tokens"] == 0
    assert scheduler_stats(decode)["num_offers_taken"] == rejected_before
    # and the node still serves a hand-off at once
    _, answer, _ = at_once(prefill, decode, PROMPTS[3], secrets.token_hex(32), inbox)
    assert answer["choices"][0]["token_ids"] == expected[PROMPTS[3]] and answer["kvbridge"]["num_external_tokens"] > 0
    assert_nothing_held(prefill, decode)
