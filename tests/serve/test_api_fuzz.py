"""Property-based fuzzing of POST /v1/completions against one real node process.

Thousands of generated bodies: JSON values of every shape in every field, absurd numbers, huge,
negative, float, bool and string token ids, nested junk, kv_transfer_params junk (and complete
remote-prefill params with one field wrong), raw bytes that are not JSON. Each must be answered
with a 200 or an OpenAI-shaped 4xx JSON error: never a 5xx, never a hang. Afterwards the node is
healthy, its bookkeeping holds, every block is free again, and a greedy request returns the
colocated engine's tokens.

CI runs a fixed, derandomized set of examples; `--hypothesis-seed=N` draws another set (the seed
in use is printed).
"""

from __future__ import annotations

import collections
import http.client
import importlib.util
import json
import math
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from live_node import MAX_MODEL_LEN, VOCAB_SIZE, assert_serves_correctly, live_node

from kvbridge.serve.launcher import http_json

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

MAX_EXAMPLES = 2000
REQUEST_TIMEOUT_S = 30.0  # per request: far above any answer here, so only a hang trips it
# Remote prefills that reach a handshake fail fast, and leases a fuzzed prefill leg takes expire soon.
FAST_FAIL = {"handshake_timeout_s": 0.5, "handshake_retries": 0, "transfer_timeout_s": 2.0, "lease_s": 1.0}
MAX_CHEAP_TOKENS = 3  # valid bodies generate at most this many tokens, so thousands fit in CI

# ---------------------------------------------------------------------- strategies

ABSURD_INTS = [0, 1, -1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2**31 - 1, 2**31, 2**53 + 1,
               2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30), 10**300]  # fmt: skip
ABSURD_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 0.009, 0.01, 0.5, 1.0, 1.0000001, 2.0, 100.0, 100.5, 1e308, -1.0,
                 math.nan, math.inf, -math.inf]  # fmt: skip

ints = st.one_of(st.sampled_from(ABSURD_INTS), st.integers())
floats = st.one_of(st.sampled_from(ABSURD_FLOATS), st.floats())
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=12))
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
token_id_lists = st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), ints, scalars), min_size=0, max_size=6)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, plausible, junk)


def remote_params(side_channel_port: int) -> st.SearchStrategy:
    """Remote-prefill params: every field present, most of them plausible."""
    return st.fixed_dictionaries(
        {
            "do_remote_prefill": field(st.just(True)),
            "remote_engine_id": field(st.text(max_size=8)),
            "remote_host": field(st.sampled_from(["127.0.0.1", "", "::1", "localhost"])),
            "remote_port": field(st.sampled_from([side_channel_port, 0, 65536, -1])),
            "remote_block_ids": field(st.lists(ints, max_size=4)),
            "remote_request_id": field(st.text(max_size=8)),
            "remote_num_tokens": field(ints),
            "remote_block_hash": field(st.sampled_from(["00" * 16, "zz", ""])),
            "remote_block_size": field(ints),
            "lease_s": field(floats),
            "remote_incarnation": field(st.text(max_size=8)),
            "remote_lease_token": field(st.text(max_size=8)),
        }
    )


def kv_transfer_params(side_channel_port: int) -> st.SearchStrategy:
    return st.one_of(
        junk,
        st.fixed_dictionaries({"do_remote_decode": field(st.booleans())}),
        remote_params(side_channel_port),
        st.dictionaries(st.sampled_from(["do_remote_prefill", "remote_block_ids", "remote_port"]), junk, max_size=3),
    )


def fields(side_channel_port: int) -> dict[str, st.SearchStrategy]:
    """Every field the API reads (and the refused ones), each: plausible values or junk."""
    text_prompt = st.text(min_size=1, max_size=24)
    id_prompt = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
    return {
        "prompt": field(st.one_of(text_prompt, id_prompt, text_prompt.map(lambda t: [t]), id_prompt.map(lambda i: [i]),
                                  token_id_lists)),  # fmt: skip
        "max_tokens": field(st.sampled_from([1, 2, MAX_CHEAP_TOKENS, 0, -1, MAX_MODEL_LEN + 1, 2**63, 10**30])),
        "temperature": field(floats),
        "top_p": field(floats),
        "top_k": field(st.sampled_from([-2, -1, 0, 1, 5, VOCAB_SIZE, 2**31, 2**63])),
        "seed": field(ints),
        "stop_token_ids": field(st.one_of(token_id_lists, st.just([1] * 1025))),
        "ignore_eos": field(st.booleans()),
        "stream": field(st.booleans()),
        "n": field(st.sampled_from([1, 2, 0, 1.0])),
        "model": field(st.sampled_from(["tiny", "other"])),
        "kv_transfer_params": kv_transfer_params(side_channel_port),
        "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4),
                                st.just(["x"] * 17), st.just("x" * 1001))),  # fmt: skip
        "presence_penalty": field(floats),
        "frequency_penalty": field(floats),
        "repetition_penalty": field(floats),
        "min_tokens": field(st.sampled_from([0, 1, MAX_CHEAP_TOKENS, MAX_CHEAP_TOKENS + 1, -1, 2**63])),
        "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
        **{name: junk for name in ("logprobs", "echo", "best_of", "suffix", "logit_bias")},
    }


def valid_fields() -> dict[str, st.SearchStrategy]:
    """Values every field accepts (with a text prompt and a small max_tokens)."""
    return {
        "temperature": st.sampled_from([0, 0.0, 0.01, 0.7, 1, 2.0, 100]),
        "top_p": st.sampled_from([0.1, 0.9, 1, 1.0]),
        "top_k": st.sampled_from([-1, 0, 1, 5, VOCAB_SIZE, 2**31 - 1]),
        "seed": st.sampled_from([0, 7, 2**63, 2**64 - 1]),
        "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "n": st.sampled_from([1, None]),
        "model": st.sampled_from(["tiny", None]),
        "kv_transfer_params": st.sampled_from([None, {}, {"do_remote_decode": True}, {"do_remote_decode": False}]),
        "stop": st.sampled_from([None, "a", ["b", " "], [], "\n"]),
        "presence_penalty": st.sampled_from([0, -2, 0.5, 2]),
        "frequency_penalty": st.sampled_from([0, -2, 0.5, 2]),
        "repetition_penalty": st.sampled_from([1, 0.01, 1.3, 100]),
        "min_tokens": st.sampled_from([0, 1]),
        "stream_options": st.sampled_from([None, {}, {"include_usage": True}]),
        "logprobs": st.sampled_from([None, 0, 2, 5]),
        **{name: st.sampled_from([None, False, 0, ""]) for name in ("echo", "suffix")},
    }


@st.composite
def mutated_valid_bodies(draw, valid: dict, wild: dict) -> dict:
    """A valid body with up to two fields set to anything (most often one; none in a fifth of the draws)."""
    token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=16)
    prompt = st.one_of(st.text(min_size=1, max_size=16), token_ids)
    body = {"prompt": draw(prompt), "max_tokens": draw(st.integers(1, MAX_CHEAP_TOKENS))}
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=5, unique=True)):
        body[name] = draw(valid[name])
    num_wild = draw(st.sampled_from([0, 1, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from(sorted(wild)), min_size=num_wild, max_size=num_wild, unique=True)):
        body[name] = draw(wild[name])
    return body


def cheap(body: Any) -> Any:
    """Cap a valid max_tokens (and the default of 16) at MAX_CHEAP_TOKENS: generation is not what is tested."""
    if isinstance(body, dict):
        value = body.get("max_tokens")
        if value is None or (type(value) is int and MAX_CHEAP_TOKENS < value <= MAX_MODEL_LEN):
            body = {**body, "max_tokens": MAX_CHEAP_TOKENS}
    return body


def payloads(side_channel_port: int) -> st.SearchStrategy[bytes]:
    """Mostly valid bodies with a field or two gone wrong, so that every field's checks are reached;
    then bodies of any fields, any JSON at all, and bytes that are not JSON."""
    strategies = fields(side_channel_port)
    as_json = lambda body: json.dumps(cheap(body)).encode()  # noqa: E731
    depth = st.integers(1, 3000)
    kinds = {
        "mutated": mutated_valid_bodies(valid_fields(), strategies).map(as_json),
        "any fields": st.fixed_dictionaries({}, optional=strategies).map(as_json),
        "wild": st.dictionaries(st.one_of(st.sampled_from(sorted(strategies)), st.text(max_size=6)), junk,
                                max_size=6).map(as_json),  # fmt: skip
        "any JSON": junk.map(as_json),
        "not JSON": st.binary(max_size=48),
        "truncated": mutated_valid_bodies(valid_fields(), strategies).map(lambda body: as_json(body)[:-1]),
        "deep": depth.map(lambda d: b"[" * d + b"]" * d),
        "deep field": depth.map(lambda d: b'{"prompt": "a", "kv_transfer_params": ' + b'{"x": ' * d + b"1}" + b"}" * d),
    }
    weighted = ["mutated"] * 12 + sorted(kinds)
    return st.sampled_from(weighted).flatmap(lambda kind: kinds[kind])


# ---------------------------------------------------------------------- the client


class Client:
    """One keep-alive HTTP connection to the node; reconnects after the server closes it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, data: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body); a timeout raises, which fails the test as a hang."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
            try:
                self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.getheader("Content-Type", ""), resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()  # the server closed a kept-alive connection; the request was not answered
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check_answer(status: int, content_type: str, raw: bytes, payload: bytes) -> None:
    """200 (a completion, or an SSE stream that ends with [DONE]) or an OpenAI-shaped 4xx JSON error."""
    sent = payload[:300]
    assert status < 500, f"{status} for {sent!r}: {raw[:500]!r}"
    if status >= 400:
        body = json.loads(raw)
        assert body["error"]["code"] == status and body["error"]["message"], (sent, body)
    elif content_type.startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n"), (sent, raw[-300:])
        assert b'"error"' not in raw, (sent, raw[-500:])
    else:
        body = json.loads(raw)
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"], (sent, body)


# ---------------------------------------------------------------------- the test


def _side_channel_port(node) -> int:
    argv = node.process.argv
    return int(argv[argv.index("--side-channel-port") + 1])


def _wait_all_blocks_free(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status, state = http_json(f"{url}/v1/kvbridge/state", timeout_s=10)
        assert status == 200 and state["integrity"]["ok"], state
        if state["stats"]["num_used_blocks"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def test_no_request_body_gets_a_5xx_or_takes_the_node_down(request):
    chosen = request.config.getoption("hypothesis_seed", default=None)
    print(f"hypothesis: {MAX_EXAMPLES} examples, " + (f"seed {chosen}" if chosen else "derandomized (fixed) set"))
    with live_node(["--kv-connector-extra", json.dumps(FAST_FAIL)]) as node:
        client = Client(node.url)
        statuses: collections.Counter[int] = collections.Counter()
        first_5xx: list[bytes] = []  # once a body kills the node, every later one fails: this names the killer

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=chosen is None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(payload=payloads(_side_channel_port(node)))
        def answers_every_payload(payload: bytes) -> None:
            answer = client.post("/v1/completions", payload)
            statuses[answer[0]] += 1
            if answer[0] >= 500 and not first_5xx:
                first_5xx.append(payload)
            check_answer(*answer, payload)

        if chosen is not None:
            answers_every_payload = seed(int(chosen))(answers_every_payload)
        try:
            answers_every_payload()
        finally:
            client.close()
            if first_5xx:
                print(f"the first body answered with a 5xx: {first_5xx[0][:1000]!r}")
        print(f"answers by status: {dict(sorted(statuses.items()))}")
        assert statuses[200] >= MAX_EXAMPLES // 10, statuses  # the bodies reach the engine, not only the parser
        state = _wait_all_blocks_free(node.url)
        assert state["stats"]["num_used_blocks"] == 0, state
        assert_serves_correctly(node)
