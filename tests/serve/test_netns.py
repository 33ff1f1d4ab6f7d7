"""P/D across a real network interface: a prefill "host" and a decode "host" in two network
namespaces joined by a veth pair (tests/serve/netns.py), exactly as the multi-host recipe in
docs/pd-disaggregation.md deploys them.

- UCX is restricted to TCP (`UCX_TLS=tcp`): no shared memory or CMA shortcut between the two
  processes, the KV crosses the veth, and the decode host's interface counters show it.
- The prefill node binds `0.0.0.0` and advertises the address of its default route; the decode
  node binds `0.0.0.0` with `--side-channel-host`; a wildcard bind with no route is refused.
- A partition (the link taken down) after the prefill answered and before the decode node read:
  the read hangs past its deadline (`transfer_timeout_s`) and stays quarantined while the link is down (TCP
  would deliver its bytes once it is back), then fails, the decode node computes the prompt itself and answers
  right, and once the link is back the prefill's lease has expired (no block held) and P/D works again.

Skipped with the reason where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from kvbridge.serve.launcher import ManagedProcess, cli_argv, http_json, wait_healthy, wait_proxy_routes_to_all
from netns import NetnsPair, NetnsUnavailable

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

PREFILL_PORT, DECODE_PORT, PROXY_PORT = 8100, 8200, 8000
LEASE_S, TRANSFER_TIMEOUT_S = 6.0, 4.0
NODE_ARGS = ["--model", "tiny", "--num-threads", "1", "--num-blocks", "128", "--max-model-len", "1024"]
UCX_OVER_TCP = {"UCX_TLS": "tcp"}
PROMPT = "Across two hosts, the KV cache crosses a real wire. " * 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def net():
    try:
        with NetnsPair() as pair:
            yield pair
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces are unavailable here: {exc}")


@pytest.fixture(scope="module")
def nodes(net):
    """prefill (10.213.0.1, bound 0.0.0.0), decode (bound 0.0.0.0, --side-channel-host 10.213.0.2)
    and the proxy (on the decode host's loopback). URLs are as seen from the decode host."""
    net.add_default_route(net.prefill)
    env = {**UCX_OVER_TCP, "KVBRIDGE_SIDE_CHANNEL_SECRET": "netns-suite-secret-of-32-bytes-or-more"}  # off loopback: required
    decode_extra = {"allowed_peers": ["10.213.0.0/24"], "transfer_timeout_s": TRANSFER_TIMEOUT_S, "handshake_timeout_s": 15.0}
    with tempfile.TemporaryDirectory(prefix="kvbridge-netns-") as log_dir:
        prefill = ManagedProcess("prefill", f"http://{net.prefill.address}:{PREFILL_PORT}", net.exec_argv(net.prefill, cli_argv(
            "serve", "--role", "prefill", "--host", "0.0.0.0", "--port", str(PREFILL_PORT), *NODE_ARGS,
            "--kv-connector-extra", json.dumps({"lease_s": LEASE_S}),
        )), log_dir, env=env)  # fmt: skip
        decode = ManagedProcess("decode", f"http://127.0.0.1:{DECODE_PORT}", net.exec_argv(net.decode, cli_argv(
            "serve", "--role", "decode", "--host", "0.0.0.0", "--port", str(DECODE_PORT), *NODE_ARGS,
            "--side-channel-host", net.decode.address, "--kv-connector-extra", json.dumps(decode_extra),
        )), log_dir, env=env)  # fmt: skip
        proxy = ManagedProcess("proxy", f"http://127.0.0.1:{PROXY_PORT}", net.exec_argv(net.decode, cli_argv(
            "proxy", "--port", str(PROXY_PORT), "--prefill", prefill.url, "--decode", decode.url,
        )), log_dir, env=env)  # fmt: skip
        processes = [prefill, decode, proxy]
        try:
            with net.entered(net.decode):
                wait_healthy(processes, timeout_s=240)
                # Healthy nodes are not yet a proxy that routes to them: its own checks must see the
                # prefill node up, or the first request is (rightly) computed by the decode node alone.
                wait_proxy_routes_to_all(proxy, timeout_s=60)
            yield {"prefill": prefill.url, "decode": decode.url, "proxy": proxy.url, "proxy_process": proxy}
        finally:
            for proc in processes:
                proc.stop()


def post(net, url: str, body: dict, timeout_s: float = 120.0) -> dict:
    with net.entered(net.decode):
        status, reply = http_json(url, body, timeout_s=timeout_s)
    assert status == 200, reply
    return reply


def state(net, node_url: str) -> dict:
    with net.entered(net.decode):
        status, reply = http_json(f"{node_url}/v1/kvbridge/state")
    assert status == 200, reply
    return reply["stats"]


def reference_tokens(net, nodes) -> list[int]:
    """The prompt computed on the prefill node alone, no P/D: what every answer must equal."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post(net, f"{nodes['prefill']}/v1/completions", body)["choices"][0]["token_ids"]


def test_pd_over_a_real_interface_moves_the_kv_across_it(net, nodes):
    rx_before = net.rx_bytes(net.decode)
    reply = post(net, f"{nodes['proxy']}/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    stats = reply["kvbridge"]
    assert stats["num_external_tokens"] > 0 and stats["kv_transfer_bytes"] > 0, json.dumps(stats)
    assert net.rx_bytes(net.decode) - rx_before >= stats["kv_transfer_bytes"]  # the KV crossed the veth
    assert reply["choices"][0]["token_ids"] == reference_tokens(net, nodes)


def test_a_wildcard_bound_prefill_node_advertises_its_reachable_address(net, nodes):
    body = {"prompt": "advertise", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = post(net, f"{nodes['prefill']}/v1/completions", body)["kv_transfer_params"]
    assert params["remote_host"] == net.prefill.address


def test_a_wildcard_bind_without_a_route_is_refused_naming_the_flag(net):
    # the decode host has no default route: nothing to guess an address from
    argv = net.exec_argv(net.decode, cli_argv("serve", "--role", "prefill", "--host", "0.0.0.0", "--port", "8300"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--side-channel-host" in done.stderr, done.stderr


def test_a_partition_before_the_read_ends_in_a_recompute_and_strands_nothing(net, nodes):
    warm = post(net, f"{nodes['proxy']}/v1/completions", {"prompt": "Warm up the peers. " * 8, "max_tokens": 1})
    assert warm["kvbridge"]["num_external_tokens"] > 0  # the handshake is done: the partition hits the read
    prompt_body = {"prompt": "A partition cuts the wire between the hosts. " * 8, "max_tokens": MAX_TOKENS, "temperature": 0}
    leg = post(net, f"{nodes['prefill']}/v1/completions", {**prompt_body, "max_tokens": 1,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
    assert state(net, nodes["prefill"])["connector"]["scheduler"]["num_leased_requests"] >= 1
    net.set_link(up=False)
    replies: list[dict] = []
    params = {**leg["kv_transfer_params"], "do_remote_prefill": True}
    body = {**prompt_body, "kv_transfer_params": params}
    decode_leg = threading.Thread(target=lambda: replies.append(
        post(net, f"{nodes['decode']}/v1/completions", body, timeout_s=2 * TRANSFER_TIMEOUT_S + 60)))  # fmt: skip
    start = time.monotonic()
    try:
        decode_leg.start()
        # Past the read's deadline and as long again: a read still in flight then is quarantined, and
        # its blocks stay withheld while the partition lasts (TCP delivers its bytes once the link is back).
        decode_leg.join(2 * TRANSFER_TIMEOUT_S + 2)
    finally:
        net.set_link(up=True)
    decode_leg.join(TRANSFER_TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    assert replies, "the decode leg never answered"
    reply = replies[0]
    assert reply["kvbridge"]["num_external_tokens"] == 0  # nothing served from the unreachable prefill
    alone = post(net, f"{nodes['decode']}/v1/completions", {**prompt_body, "kv_transfer_params": None})
    assert reply["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    print(f"partitioned read gave up and recomputed after {elapsed:.1f} s (transfer_timeout_s={TRANSFER_TIMEOUT_S}):",
          reply["kvbridge"])

    deadline = time.monotonic() + LEASE_S + 30  # the unread lease expires on the prefill node
    while (prefill := state(net, nodes["prefill"]))["connector"]["scheduler"]["num_leased_requests"]:
        assert time.monotonic() < deadline, prefill
        time.sleep(0.5)
    assert prefill["num_used_blocks"] == 0
    decode = state(net, nodes["decode"])
    assert decode["num_used_blocks"] == 0 and decode["num_waiting_for_remote_kvs"] == 0

    with net.entered(net.decode):  # it took the unreachable prefill node out of rotation: until it is back
        wait_proxy_routes_to_all(nodes["proxy_process"], timeout_s=60)
    after = {"prompt": PROMPT + " after the partition", "max_tokens": MAX_TOKENS, "temperature": 0}
    again = post(net, f"{nodes['proxy']}/v1/completions", after)
    assert again["kvbridge"]["num_external_tokens"] > 0, json.dumps(again["kvbridge"])  # the link is back: P/D reads again
    assert again["choices"][0]["token_ids"] == post(net, f"{nodes['prefill']}/v1/completions", after)["choices"][0]["token_ids"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
