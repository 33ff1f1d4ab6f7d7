"""P/D between unmodified vLLM api_servers through KVBridgeConnector + kvbridge's NixlConnector.

Servers of one tiny checkpoint, booted once for the module: a prefill (kv_producer), a decode
(kv_consumer, vLLM's kv_load_failure_policy "recompute"), a second decode with vLLM's default
policy "fail", and `kvbridge proxy` in front of the prefill and the first decode. The colocated
reference is a plain request (no kv_transfer_params) to the prefill server.

What each test attacks from outside:
* kvbridge's proxy drives vLLM servers: greedy tokens equal colocated, the decode read the prompt's
  full blocks over NIXL (its /metrics count one transfer of exactly those bytes), and the prefill's
  lease ends (its lease gauge returns to 0 without another request to step it);
* the proxy frees the prefill's blocks at once when the decode node is down, and passes a streamed
  request's stream_options to the decode leg only (vLLM refuses them with stream=false);
* the two-leg protocol of vLLM's toy proxy gives the same tokens (decode leg streamed: TTFT), and a
  decode request vLLM refuses before admission frees the prefill's blocks at once (vLLM reports
  the refusal to the connector as a pre-aborted request), not when the lease expires;
* forged kv_transfer_params on a decode (another prompt's, a made-up lease token or incarnation,
  absurd block ids, a prefill address nobody answers at): colocated tokens within the NIXL options'
  deadlines under "recompute", a clean error or colocated tokens under "fail", never other tokens;
  the server stays healthy and its next P/D read works;
* an in-process prefill `LLM` resets its prefix cache while the decode server reads its blocks: the
  reset waits for the read (the adapter grants the lease itself: no step runs) and succeeds;
* last, since it kills a server: the prefill's process group is killed after the prefill leg; the
  decode recomputes within a deadline and stays healthy.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from adapter_e2e import (
    BYTES,
    EXPIRED_LEASES,
    FAILURES,
    HELD,
    LEASES,
    LOAD_ERRORS,
    MISMATCHED,
    OFFERS_TAKEN,
    UNPROVEN,
    TRANSFERS,
    delta,
    greedy,
    kvbridge_metrics,
    kvbridge_transfer_config,
    random_prompt,
    wait_for_metrics,
)
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import (
    PREFILL_LEG_PARAMS,
    VLLMRequestError,
    complete,
    handoff_inbox,
    pd_complete,
    pd_complete_handoff,
)
from vllm_server import CPU_BLOCK_SIZE

from kvbridge.serve.launcher import free_ports, http_json, start_proxy, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
NUM_LAYERS = 4  # conftest.TINY_MODEL
PROMPT_LEN = 300  # two full blocks and a partial one: two blocks move
# Short handshakes, so a dead or lying peer costs seconds (kvbridge/connectors/nixl/options.py); a read
# may take 30 s: CI's 2-core machines have seen a server go silent for 16-20 s at the first read from it.
NIXL_OPTIONS = dict(lease_s=60.0, handshake_timeout_s=3.0, handshake_retries=1, transfer_timeout_s=30.0)
DEAD_PREFILL_DEADLINE_S = NIXL_OPTIONS["transfer_timeout_s"] + 10.0  # the read's deadline, plus a loaded machine
INPROCESS_SCRIPT = Path(__file__).with_name("inprocess_llm.py")
READ_DELAY_S = 2.0  # the decode leg starts this long after the in-process prefill's reset began


class PD:
    """The module's servers: prefill, decode (recompute), decode_fail (fail) and the kvbridge proxy's URL."""

    def __init__(self, prefill, decode, decode_fail, proxy, block_nbytes: int) -> None:
        self.prefill, self.decode, self.decode_fail, self.proxy = prefill, decode, decode_fail, proxy
        self.block_nbytes = block_nbytes

    def colocated(self, body: dict) -> list[int]:
        """Greedy tokens of a plain request (no kv_transfer_params) to the prefill server."""
        return complete(self.prefill.url, body).token_ids

    def prefill_leg(self, body: dict) -> dict:
        """The toy proxy's first leg: the kv_transfer_params the prefill returns for `body`'s prompt."""
        leg = complete(self.prefill.url, {**body, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_LEG_PARAMS)})
        assert leg.kv_transfer_params and leg.kv_transfer_params["remote_block_ids"], leg
        return leg.kv_transfer_params


def _warm_up(prefill_url: str, decode_url: str, seed: int, attempts: int = 3) -> None:
    """P/D until the decode has read over NIXL once: the first read includes the handshake, which a
    loaded machine can miss (a recompute then, or an error under policy fail)."""
    body = greedy(random_prompt(seed, 200), 1)
    for attempt in range(1, attempts + 1):
        before = kvbridge_metrics(decode_url).get(TRANSFERS, 0)
        start = time.monotonic()
        try:
            out = pd_complete(prefill_url, decode_url, body)
            print(f"warm-up P/D to {decode_url}: prefill leg {out.prefill.total_s:.2f} s, "
                  f"decode leg {out.decode.total_s:.2f} s")  # fmt: skip
        except VLLMRequestError as exc:
            print(f"warm-up P/D to {decode_url} failed after {time.monotonic() - start:.2f} s: {exc}")
        if wait_for_metrics(decode_url, lambda m: m.get(TRANSFERS, 0) > before, 5.0).get(TRANSFERS, 0) > before:
            return
        body = greedy(random_prompt(seed + 1000 * attempt, 200), 1)  # a prompt the decode has not cached
    pytest.fail(f"the decode server {decode_url} never read over NIXL from {prefill_url} in {attempts} P/D requests")


@pytest.fixture(scope="module")
def pd(vllm_servers, tiny_checkpoint, tmp_path_factory):
    def start(name: str, role: str, policy: str = "recompute", **options):
        config = kvbridge_transfer_config(role, "NixlConnector", policy=policy, **NIXL_OPTIONS, **options)
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config)

    start_s = time.monotonic()
    prefill = start("prefill", "kv_producer")
    decode = start("decode", "kv_consumer", handoff_inbox=True)  # takes hand-offs at once; decode_fail does not
    decode_fail = start("decode_fail", "kv_consumer", policy="fail")
    vllm_servers.wait()
    ready_s = time.monotonic() - start_s
    proxy = start_proxy([prefill.url], [decode.url], str(tmp_path_factory.mktemp("kvbridge-proxy")), timeout_s=120.0)
    try:
        wait_healthy([proxy], 60.0)
        proxy_s = time.monotonic() - start_s
        _warm_up(prefill.url, decode.url, seed=1)
        _warm_up(prefill.url, decode_fail.url, seed=2)
        print(f"\nservers healthy after {ready_s:.0f} s "
              f"({', '.join(f'{s.name} {s.ready_after_s:.0f} s' for s in (prefill, decode, decode_fail))}), "
              f"proxy up after {proxy_s:.0f} s, both decodes warmed up after {time.monotonic() - start_s:.0f} s")  # fmt: skip
        yield PD(prefill, decode, decode_fail, proxy, CPU_BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint))
    finally:
        proxy.stop()


def _assert_read(pd: PD, before: dict, after: dict, num_blocks: int) -> None:
    """The decode read exactly `num_blocks` blocks in one transfer, with no failure."""
    assert delta(after, before, TRANSFERS) == 1, f"the decode read no KV over NIXL: {after}"
    assert delta(after, before, BYTES) == num_blocks * pd.block_nbytes
    assert delta(after, before, FAILURES) == 0 and delta(after, before, LOAD_ERRORS) == 0, after
    # vLLM's CPU buffer is layer-outermost: one descriptor per run of blocks per layer, at most one per page
    descriptors = after["kvbridge_worker_last_read_descriptors"]
    assert descriptors % NUM_LAYERS == 0 and NUM_LAYERS <= descriptors <= num_blocks * NUM_LAYERS, after
    print(f"read of {num_blocks} blocks x {NUM_LAYERS} layers: {descriptors:.0f} descriptors")


def _wait_leases_ended(pd: PD) -> dict[str, float]:
    metrics = wait_for_metrics(pd.prefill.url, lambda m: m.get(LEASES) == 0 and m.get(HELD) == 0)
    assert metrics.get(LEASES) == 0, f"the prefill still holds leases: {metrics}"
    assert metrics.get(HELD) == 0, f"vLLM's prefill still holds blocks for a send: {metrics}"
    return metrics


# ---------------------------------------------------------------------- both legs at once


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_both_legs_at_once_through_the_hand_off(pd, stream):
    """The decode leg leaves with the prefill leg, naming a hand-off key only: vLLM's scheduler keeps it
    waiting (the connector answers "ask again") until the prefill's offer reaches the inbox, then it
    reads the prompt's blocks once, and answers colocated tokens; the prefill's lease ends."""
    inbox = handoff_inbox(pd.prefill.url, pd.decode.url, greedy(random_prompt(seed=40 + stream, num_tokens=PROMPT_LEN), 1))
    prompt = random_prompt(seed=31 + stream, num_tokens=PROMPT_LEN)
    before = kvbridge_metrics(pd.decode.url)
    out = pd_complete_handoff(pd.prefill.url, pd.decode.url, greedy(prompt, MAX_TOKENS, stream=stream), inbox)
    after = wait_for_metrics(pd.decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS))
    _assert_read(pd, before, after, PROMPT_LEN // CPU_BLOCK_SIZE)
    assert delta(after, before, OFFERS_TAKEN) == 1, after
    _wait_leases_ended(pd)
    print(f"at once ({'streamed' if stream else 'whole'}): TTFT {out.ttft_s * 1e3:.0f} ms, "
          f"prefill leg {out.prefill.total_s * 1e3:.0f} ms")  # fmt: skip


def test_a_hand_off_key_sent_to_a_decode_without_an_inbox_is_computed_at_once(pd):
    """decode_fail takes no offers: the request is refused before admission (no load error for vLLM's
    policy "fail" to fail it) and computed there at once, not after a wait."""
    prompt = random_prompt(seed=33, num_tokens=PROMPT_LEN)
    params = {"do_remote_prefill": True, "handoff_key": "ab" * 32}
    start = time.monotonic()
    out = complete(pd.decode_fail.url, {**greedy(prompt, MAX_TOKENS), "kv_transfer_params": params})
    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS))
    assert time.monotonic() - start < 10.0


# ---------------------------------------------------------------------- kvbridge's proxy


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_kvbridge_proxy_drives_vllm_servers(pd, stream):
    prompt = random_prompt(seed=10 + stream, num_tokens=PROMPT_LEN)
    body = greedy(prompt, MAX_TOKENS, stream=stream)
    before = kvbridge_metrics(pd.decode.url)
    out = complete(pd.proxy.url, body)
    after = wait_for_metrics(pd.decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS)), f"proxy log: {pd.proxy.log_path}"
    assert len(out.token_ids) == MAX_TOKENS
    _assert_read(pd, before, after, PROMPT_LEN // CPU_BLOCK_SIZE)
    _wait_leases_ended(pd)
    print(f"through kvbridge proxy ({'streamed' if stream else 'whole'}): TTFT {out.ttft_s * 1e3:.0f} ms, "
          f"total {out.total_s * 1e3:.0f} ms, read {delta(after, before, BYTES) / 2**20:.1f} MiB")  # fmt: skip


def test_kvbridge_proxy_frees_prefill_blocks_when_the_decode_node_fails(pd, tmp_path):
    """A decode node that answers health checks but fails every completion: the prefill leg succeeds,
    the decode leg fails (no other decode node to retry on), the client gets a 502, and the proxy
    releases the prefill's lease over the side channel instead of leaving it to expire."""
    with _failing_decode_node() as decode_url:
        proxy = start_proxy([pd.prefill.url], [decode_url], str(tmp_path), timeout_s=30.0)
        try:
            _wait_answers(proxy.url)
            prefill_before = _wait_leases_ended(pd)
            with pytest.raises(VLLMRequestError, match="answered 502"):
                complete(proxy.url, greedy(random_prompt(seed=20, num_tokens=PROMPT_LEN), MAX_TOKENS))
            # Freed at once by the proxy's release, well before the 60 s lease would expire.
            after = _wait_leases_ended(pd)
            health = _wait_proxy_health(proxy.url, lambda h: h["num_kv_releases"] + h["num_kv_release_failures"] > 0)
        finally:
            proxy.stop()
    assert delta(after, prefill_before, EXPIRED_LEASES) == 0
    assert health["num_kv_releases"] == 1 and health["num_kv_release_failures"] == 0, health


@contextlib.contextmanager
def _failing_decode_node():
    """A node on loopback whose /health is 200 and whose completions are all HTTP 500."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply(200, {"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply(500, {"error": {"message": "this decode node fails every request", "code": 500}})

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_kvbridge_proxy_streams_with_stream_options(pd):
    """OpenAI clients send stream_options with stream=true; the prefill leg (stream=false) must not carry them."""
    prompt = random_prompt(seed=25, num_tokens=PROMPT_LEN)
    out = complete(pd.proxy.url, greedy(prompt, MAX_TOKENS, stream=True, stream_options={"include_usage": True}))
    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS))


def _wait_proxy_health(url: str, is_done, timeout_s: float = 10.0) -> dict:
    """The proxy's /health body once `is_done(body)` holds (its releases finish off the request's path)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = http_json(f"{url}/health")[1]
        if is_done(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def _wait_answers(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http_json(f"{url}/health", timeout_s=2.0)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# ---------------------------------------------------------------------- vLLM's toy-proxy protocol


def test_toy_proxy_protocol_gives_colocated_tokens(pd):
    prompt = random_prompt(seed=30, num_tokens=PROMPT_LEN)
    before = kvbridge_metrics(pd.decode.url)
    out = pd_complete(pd.prefill.url, pd.decode.url, greedy(prompt, MAX_TOKENS, stream=True))
    after = wait_for_metrics(pd.decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS))
    assert len(out.kv_transfer_params["remote_block_ids"]) == PROMPT_LEN // CPU_BLOCK_SIZE
    _assert_read(pd, before, after, PROMPT_LEN // CPU_BLOCK_SIZE)
    _wait_leases_ended(pd)
    print(f"toy protocol: prefill leg {out.prefill.total_s * 1e3:.0f} ms, decode leg TTFT "
          f"{out.decode.ttft_s * 1e3:.0f} ms, user TTFT {out.ttft_s * 1e3:.0f} ms")  # fmt: skip


def test_decode_refused_by_vllm_frees_prefill_blocks_promptly(pd):
    """vLLM answers 404 for a model it does not serve, after telling the connector (a pre-aborted request)."""
    prompt = random_prompt(seed=35, num_tokens=PROMPT_LEN)
    prefill_before = _wait_leases_ended(pd)
    params = pd.prefill_leg(greedy(prompt, 1))
    with pytest.raises(VLLMRequestError, match="answered 404"):  # vLLM refuses a model it does not serve
        complete(pd.decode.url, greedy(prompt, MAX_TOKENS, kv_transfer_params=params, model="no-such-model"))
    after = wait_for_metrics(pd.prefill.url, lambda m: m.get(LEASES) == 0, timeout_s=5.0)
    assert after.get(LEASES) == 0, f"the prefill holds the refused request's blocks until its lease expires: {after}"
    assert delta(after, prefill_before, EXPIRED_LEASES) == 0


# ---------------------------------------------------------------------- forged params

FORGERIES = {
    # valid params, from a different prompt's prefill leg: the chained hash does not match this prompt
    "another_prompts_params": lambda own, other: other,
    "made_up_lease_token": lambda own, other: {**own, "remote_lease_token": "ab" * 32},
    "made_up_incarnation": lambda own, other: {**own, "remote_incarnation": "cd" * 16},
    "absurd_block_ids": lambda own, other: {**own, "remote_block_ids": [10**12, 10**12 + 1]},
    # nothing listens there, and the prefill never vouched for that port: refused before any connection
    "unreachable_prefill": lambda own, other: {**own, "remote_port": free_ports(1)[0]},
}
# Forgeries of the address the prefill signed (engine id, incarnation, host, port): the decode connects to
# nothing and computes the prompt, before admission, so vLLM sees no load error at all.
ADDRESS_FORGERIES = {"made_up_incarnation", "unreachable_prefill"}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_params_on_recompute_decode_give_colocated_tokens(pd, forgery):
    seed = 40 + list(FORGERIES).index(forgery) * 2
    prompt, other = random_prompt(seed, PROMPT_LEN), random_prompt(seed + 1, PROMPT_LEN)
    expected = pd.colocated(greedy(prompt, MAX_TOKENS))
    params = FORGERIES[forgery](pd.prefill_leg(greedy(prompt, 1)), pd.prefill_leg(greedy(other, 1)))
    before = kvbridge_metrics(pd.decode.url)

    start = time.monotonic()
    out = complete(pd.decode.url, greedy(prompt, MAX_TOKENS, kv_transfer_params=params))
    elapsed = time.monotonic() - start
    refusals = (MISMATCHED, LOAD_ERRORS, UNPROVEN)
    after = wait_for_metrics(pd.decode.url, lambda m: sum(delta(m, before, name) for name in refusals) > 0)

    assert out.token_ids == expected, "the decode used KV that was not its prompt's"
    assert elapsed < DEAD_PREFILL_DEADLINE_S, f"the decode took {elapsed:.1f} s to give up on forged params"
    # ...because it refused the params, not by luck: a hash mismatch, or a load error vLLM recomputed
    if forgery == "another_prompts_params":
        assert delta(after, before, MISMATCHED) == 1 and delta(after, before, TRANSFERS) == 0, after
    elif forgery in ADDRESS_FORGERIES:
        assert delta(after, before, UNPROVEN) == 1 and delta(after, before, LOAD_ERRORS) == 0, after
        assert delta(after, before, TRANSFERS) == 0 and delta(after, before, FAILURES) == 0, after
    else:
        assert delta(after, before, LOAD_ERRORS) == PROMPT_LEN // CPU_BLOCK_SIZE, after
    print(f"{forgery}: recomputed in {elapsed:.2f} s")
    _assert_still_serves_pd(pd, pd.decode, seed + 100)


def test_forged_lease_token_on_fail_policy_decode_is_a_clean_error(pd):
    prompt = random_prompt(seed=60, num_tokens=PROMPT_LEN)
    expected = pd.colocated(greedy(prompt, MAX_TOKENS))
    params = {**pd.prefill_leg(greedy(prompt, 1)), "remote_lease_token": "ef" * 32}
    try:
        out = complete(pd.decode_fail.url, greedy(prompt, MAX_TOKENS, kv_transfer_params=params))
    except VLLMRequestError as exc:  # vLLM's policy "fail": the request ends with an error
        assert "answered 500" in str(exc), exc
        print(f"policy fail: {str(exc)[:120]}")
    else:
        assert out.token_ids == expected, "the decode used KV that was not its prompt's"
    _assert_still_serves_pd(pd, pd.decode_fail, seed=61)


def _assert_still_serves_pd(pd: PD, decode, seed: int) -> None:
    """The decode server is healthy and its next P/D request reads its KV and gives colocated tokens."""
    assert http_json(f"{decode.url}/health")[0] == 200
    prompt = random_prompt(seed, PROMPT_LEN)
    before = kvbridge_metrics(decode.url)
    out = pd_complete(pd.prefill.url, decode.url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)
    assert out.token_ids == pd.colocated(greedy(prompt, MAX_TOKENS))
    _assert_read(pd, before, after, PROMPT_LEN // CPU_BLOCK_SIZE)


# ---------------------------------------------------------------------- in-process prefill, reset


def test_inprocess_prefill_reset_waits_for_decode_read(pd, tiny_checkpoint):
    prompt = random_prompt(seed=70, num_tokens=PROMPT_LEN)
    expected = pd.colocated(greedy(prompt, MAX_TOKENS))
    before = kvbridge_metrics(pd.decode.url)
    proc = subprocess.Popen(
        [sys.executable, str(INPROCESS_SCRIPT), "prefill-reset", tiny_checkpoint, json.dumps(prompt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        records = (json.loads(line) for line in proc.stdout if line.startswith("{"))
        params = next(records)["params"]  # the prefill leg is done and the reset has begun
        time.sleep(READ_DELAY_S)
        out = complete(pd.decode.url, greedy(prompt, MAX_TOKENS, kv_transfer_params=params))
        reset = next(records)
        proc.wait(60)
    finally:
        proc.kill()
        stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr[-6000:]
    after = wait_for_metrics(pd.decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.token_ids == expected
    _assert_read(pd, before, after, PROMPT_LEN // CPU_BLOCK_SIZE)
    assert reset["reset"] is True, f"vLLM refused the reset: {reset}"
    assert reset["reset_s"] >= READ_DELAY_S, f"the reset did not wait for the decode's read: {reset}"
    print(f"in-process prefill: reset waited {reset['reset_s']:.2f} s (decode leg started after {READ_DELAY_S} s)")


# ---------------------------------------------------------------------- last: the prefill dies


def test_prefill_killed_before_read_decode_recomputes_within_deadline(pd):
    prompt, next_prompt = random_prompt(seed=80, num_tokens=PROMPT_LEN), random_prompt(seed=81, num_tokens=PROMPT_LEN)
    expected, next_expected = pd.colocated(greedy(prompt, MAX_TOKENS)), pd.colocated(greedy(next_prompt, MAX_TOKENS))
    params = pd.prefill_leg(greedy(prompt, 1))
    os.killpg(pd.prefill.popen.pid, signal.SIGKILL)  # api_server, EngineCore and Worker at once
    pd.prefill.stop()  # reaps them
    before = kvbridge_metrics(pd.decode.url)

    start = time.monotonic()
    out = complete(pd.decode.url, greedy(prompt, MAX_TOKENS, kv_transfer_params=params))
    elapsed = time.monotonic() - start
    after = wait_for_metrics(pd.decode.url, lambda m: delta(m, before, LOAD_ERRORS) > 0)

    assert out.token_ids == expected
    assert elapsed < DEAD_PREFILL_DEADLINE_S, f"the decode took {elapsed:.1f} s to give up on a dead prefill"
    assert delta(after, before, LOAD_ERRORS) == PROMPT_LEN // CPU_BLOCK_SIZE, after
    assert http_json(f"{pd.decode.url}/health")[0] == 200
    assert complete(pd.decode.url, greedy(next_prompt, MAX_TOKENS)).token_ids == next_expected
    print(f"dead prefill: the decode recomputed in {elapsed:.2f} s")
