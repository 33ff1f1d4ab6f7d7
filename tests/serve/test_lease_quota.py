"""No client can pin a prefill node's memory with leases it never reads: a real prefill node on loopback,
plain HTTP clients from two loopback addresses (127.0.0.1 and 127.0.0.2) that send `do_remote_decode`
requests and never read them. Past a client's quota, and past the share of the cache that leases may
hold, the node answers 429 at once; plain completions are still served; a lease that is released
frees its share."""

from __future__ import annotations

import http.client
import json
import tempfile
import time

import pytest

from kvbridge.errors import ConfigError
from kvbridge.serve.launcher import PDCluster, http_json, start_node, wait_healthy
from kvbridge.serve.lease_quota import LeaseQuota, Occupancy
from kvbridge.transfer.host_secret import side_channel_secret
from kvbridge.transfer.lease_release import release_remote_kv


NUM_BLOCKS, BLOCK_SIZE = 64, 16
# leases of 120 s: nothing expires during the test; at most 3 per client, and leases hold at most half the cache
NODE_ARGS = ["--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
             "--max-model-len", "256", "--max-leases-per-client", "3", "--kv-connector-extra", '{"lease_s": 120}',
             "--flush-timeout", "1"]  # fmt: skip  (unread leases need not hold up the node's stop)
PROMPT_CHARS = 6 * BLOCK_SIZE + 5  # the tiny model's tokens are bytes: a finished request holds 7 blocks


def _post(port: int, body: dict, source: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _prefill(port: int, tag: str, source: str) -> tuple[int, dict]:
    prompt = (f"[{tag}] " + "unread lease " * 20)[:PROMPT_CHARS]
    return _post(port, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, source)


def _refused(url: str, scope: str) -> float:
    _, text = http_json(f"{url}/metrics")
    for line in text.splitlines():
        if line.startswith(f'kvbridge_pd_admissions_refused_total{{scope="{scope}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.nixl
def test_leases_are_bounded_per_client_and_in_total_and_plain_requests_still_run():
    with tempfile.TemporaryDirectory() as log_dir:
        node = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS)
        try:
            wait_healthy([node], 120)
            port = int(node.url.rsplit(":", 1)[1])
            a = [_prefill(port, f"a{i}", "127.0.0.1") for i in range(3)]  # 21 of the 32 blocks leases may hold
            assert all(status == 200 for status, _ in a), a
            status, body = _prefill(port, "a3", "127.0.0.1")
            assert status == 429 and "at most 3" in body["error"]["message"], (status, body)  # its own quota

            b = _prefill(port, "b0", "127.0.0.2")  # another client: 28 blocks in all
            assert b[0] == 200, b
            status, body = _prefill(port, "b1", "127.0.0.2")  # 35 > 32
            assert status == 429 and "limit of 32" in body["error"]["message"], (status, body)  # the node's total

            plain = (_post(port, {"prompt": "[plain] " * 12, "max_tokens": 4}, "127.0.0.2"))
            assert plain[0] == 200 and plain[1]["choices"][0]["text"], plain  # served beside the unread leases
            assert (_refused(node.url, "client"), _refused(node.url, "total")) == (1.0, 1.0)

            # A released lease frees its share: client A is admitted again once the node has freed the blocks.
            assert release_remote_kv(a[0][1]["kv_transfer_params"], secret=side_channel_secret(), timeout_s=10)
            deadline = time.monotonic() + 30
            while (again := _prefill(port, "a4", "127.0.0.1"))[0] == 429:
                assert time.monotonic() < deadline, f"the released lease never freed client A's quota: {again}"
                time.sleep(0.2)
            assert again[0] == 200, again
        finally:
            node.stop()


@pytest.mark.nixl
def test_a_prefill_node_at_its_quota_is_reported_busy_by_the_proxy_and_the_decode_node_computes():
    """Through the proxy: once its client (the proxy's loopback address) holds its quota of unread leases
    on the prefill node, a request is answered by the decode node alone, and the proxy says why:
    `prefill_busy`, not that no prefill node answered (the node is alive and stays in the pool)."""
    cluster = PDCluster(node_args=NODE_ARGS)
    with cluster:
        prefill_url = cluster.prefill[0].url
        port = int(prefill_url.rsplit(":", 1)[1])
        held = [_prefill(port, f"held{i}", "127.0.0.1") for i in range(3)]  # the proxy's address: its quota is full
        assert all(status == 200 for status, _ in held), held
        body = {"prompt": "[through the proxy] " * 4, "max_tokens": 3, "temperature": 0}
        status, answer = http_json(f"{cluster.proxy_url}/v1/completions", body, timeout_s=60)
        assert status == 200 and answer["choices"][0]["token_ids"], answer
        report = answer["kvbridge"]["proxy"]
        assert report["recompute_reason"] == "prefill_busy" and not report["disaggregated"], report
        assert _refused(prefill_url, "client") >= 1.0
        _, text = http_json(f"{cluster.proxy_url}/metrics")
        assert 'kvbridge_proxy_recomputes_total{reason="prefill_busy"}' in text, text[-3000:]
        # released, the quota admits again: the next request is disaggregated
        for _, answered in held:
            assert release_remote_kv(answered["kv_transfer_params"], secret=side_channel_secret(), timeout_s=10)
        deadline = time.monotonic() + 30
        while (again := http_json(f"{cluster.proxy_url}/v1/completions", {**body, "prompt": "[again] " * 6}, timeout_s=60))[1][
            "kvbridge"]["proxy"]["recompute_reason"] == "prefill_busy":  # fmt: skip
            assert time.monotonic() < deadline, again
            time.sleep(0.2)
        assert again[1]["kvbridge"]["proxy"]["recompute_reason"] is None, again[1]["kvbridge"]["proxy"]


def _occupancy(live=(), free=64, held=0, taken_at=None):
    return Occupancy(time.monotonic() if taken_at is None else taken_at, 64, free, held, frozenset(live))


def test_quota_bookkeeping_counts_a_request_from_admission_until_the_engine_lets_it_go():
    quota = LeaseQuota(max_per_client=2, max_leased_fraction=0.5)
    assert quota.admit("c", ["r1"], 8, _occupancy()) is None
    assert quota.admit("c", ["r2"], 8, _occupancy()) is None  # r1 not started yet: an old snapshot cannot drop it
    assert quota.admit("c", ["r3"], 8, _occupancy()).scope == "client"
    quota.mark_started(["r1", "r2"])
    assert quota.admit("c", ["r3"], 8, _occupancy(live={"r2"})) is None  # r1 ended after it started
    quota.mark_started(["r3"])
    quota.forget(["r3"])  # started: only the engine's snapshots let it go
    assert quota.num_admitted == 2
    assert quota.admit("d", ["r4"], 17, _occupancy(live={"r2", "r3"}, held=16)).scope == "total"  # 16 + 17 > 32
    assert quota.admit("d", ["r4"], 16, _occupancy(live={"r2", "r3"}, held=16)) is None  # running ones do not count
    quota.forget(["r9"])  # unknown ids are ignored
    with pytest.raises(ConfigError, match="--max-leased-fraction"):
        LeaseQuota(max_leased_fraction=1.5)
