"""P/D between vLLM api_servers of different tensor-parallel sizes through KVBridgeConnector + kvbridge's NixlConnector.

Servers of one tiny checkpoint (2 KV heads), booted once for the module: `tp2` and `tp1`, both
kv_both so each serves as the other's prefill (`tp2`: --tensor-parallel-size 2, two vLLM worker
processes, one KV head each, each with its own NIXL agent), and `tp2_flips`, a TP 2 decode whose
rank 1 flips a bit of every read it lands (kvbridge's fault injection). The colocated reference is
a plain request to each server; the decode's prefix cache is reset before its P/D request, so it
must read the KV.

What each test attacks from outside:
* TP 2 prefill -> TP 1 decode: the decode's one rank reads each head from the prefill rank holding
  it; greedy tokens equal both servers' colocated tokens; vLLM counts the prompt's full blocks as
  external tokens, the decode's /metrics one read of exactly those blocks' bytes; the prefill's
  lease ends (rank 0 holds the node's leases) and vLLM holds no block for the send, which needs
  both prefill workers' finished_sending (vLLM's KVOutputAggregator);
* TP 1 prefill -> TP 2 decode: each decode rank reads its own head (half the bytes each, per-head
  digests from the prefill, `digest_kv_heads`), the same checks; the decode's request ends only
  when both of its workers have finished receiving;
* a load error on one decode rank only: vLLM recomputes (colocated tokens), and the prefill's lease
  ends at once, released by one reader rank's confirmation and the other's abandonment.
"""

from __future__ import annotations

import time

import pytest
from adapter_e2e import (
    BYTES,
    FAILURES,
    HELD,
    LEASES,
    LOAD_ERRORS,
    TRACKED,
    TRANSFERS,
    delta,
    greedy,
    kvbridge_metrics,
    kvbridge_transfer_config,
    random_prompt,
    reset_prefix_cache,
    wait_for_metrics,
)
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import VLLMRequestError, complete, pd_complete, scrape_metrics
from vllm_server import CPU_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
PROMPT_LEN = 300  # two full blocks and a partial one: two blocks move
NUM_BLOCKS = PROMPT_LEN // CPU_BLOCK_SIZE
# Deadlines are not what these tests measure, and they are generous: five vLLM processes per pair of
# servers on 2 cores, and CI has seen a prefill go silent for 16 s at a decode's first read from it (the
# read expired at 15 s and the decode recomputed). Each P/D line prints both servers' num_process_stalls
# (stall_watch.py). Per-head digests, so a wider decode can verify its heads.
NIXL_OPTIONS = dict(lease_s=90.0, handshake_timeout_s=20.0, handshake_retries=1, transfer_timeout_s=60.0,
                    digest_kv_heads=True)  # fmt: skip
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
STALLS = "kvbridge_worker_num_process_stalls"
RANK1 = "kvbridge_worker_tp1_"  # gauges of tensor-parallel rank 1's worker half (rank 0's keep the TP 1 names)


class Servers:
    def __init__(self, tp2, tp1, tp2_flips, block_nbytes: int) -> None:
        self.tp2, self.tp1, self.tp2_flips, self.block_nbytes = tp2, tp1, tp2_flips, block_nbytes


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint):
    def start(name: str, tp: int, role: str = "kv_both", **env: str):
        config = kvbridge_transfer_config(role, "NixlConnector", policy="recompute", **NIXL_OPTIONS)
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config,
                                  extra_args=["--tensor-parallel-size", str(tp)],
                                  env={"VLLM_SERVER_DEV_MODE": "1", **env})  # POST /reset_prefix_cache  # fmt: skip

    start_s = time.monotonic()
    tp2, tp1 = start("tp2", 2), start("tp1", 1)
    # a decode whose rank 1 alone flips a bit of every read once it landed (a fault in flight)
    tp2_flips = start("tp2_flips", 2, "kv_consumer", KVBRIDGE_FAULT_FLIP_READ_BIT="1", KVBRIDGE_FAULT_FLIP_READ_BIT_RANK="1")
    vllm_servers.wait()
    ready = ", ".join(f"{s.name} {s.ready_after_s:.0f} s" for s in (tp2, tp1, tp2_flips))
    print(f"\nservers healthy after {time.monotonic() - start_s:.0f} s ({ready})")
    return Servers(tp2, tp1, tp2_flips, CPU_BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint))


def _pd(prefill, decode, seed: int, attempts: int = 2):
    """Colocated tokens on both servers, then P/D with the decode's prefix cache reset. The first
    request between two servers includes the NIXL handshake, which a loaded machine can miss (the
    decode then recomputes): such a request is retried with a fresh prompt."""
    for attempt in range(attempts):
        prompt = random_prompt(seed + 1000 * attempt, PROMPT_LEN)
        body = greedy(prompt, MAX_TOKENS)
        prefill_colocated = complete(prefill.url, body).token_ids
        decode_colocated = complete(decode.url, body).token_ids
        reset_prefix_cache(decode.url)
        before = kvbridge_metrics(decode.url)
        hits_before = scrape_metrics(decode.url).get(EXTERNAL_HITS, 0.0)
        start = time.monotonic()
        try:
            out = pd_complete(prefill.url, decode.url, body)
        except VLLMRequestError as exc:
            print(f"P/D {prefill.name} -> {decode.name} failed: {exc}")
            continue
        elapsed_s = time.monotonic() - start
        after = wait_for_metrics(decode.url, lambda m: _num_reads(m, before) >= 1)
        external = scrape_metrics(decode.url).get(EXTERNAL_HITS, 0.0) - hits_before
        if external > 0 or attempt == attempts - 1:
            stalls = {s.name: kvbridge_metrics(s.url).get(STALLS, 0.0) for s in (prefill, decode)}
            print(f"P/D {prefill.name} -> {decode.name}: {elapsed_s * 1e3:.0f} ms, {external:.0f} external tokens, "
                  f"tokens {out.token_ids}; process stalls (rank 0) {stalls}")  # fmt: skip
            return out, prefill_colocated, decode_colocated, before, after, external
    pytest.fail(f"P/D {prefill.name} -> {decode.name} failed {attempts} times")


def _num_reads(after: dict, before: dict) -> float:
    """Reads since `before` by the decode's ranks 0 and 1 (a TP 1 decode has no rank 1)."""
    return delta(after, before, TRANSFERS) + delta(after, before, RANK1 + "num_transfers")


def _print_step_cost(server) -> None:
    """What one engine step pays for the adapter on each rank, the per-step exchange between ranks included."""
    metrics = kvbridge_metrics(server.url)
    ranks = [("rank 0", "kvbridge_worker_adapter_"), ("rank 1", RANK1 + "adapter_")]
    print(f"{server.name}: adapter per step " + ", ".join(
        f"{rank} mean {metrics.get(p + 'step_us_mean', 0):.0f} us max {metrics.get(p + 'step_us_max', 0):.0f} us"
        for rank, p in ranks if p + "step_us_mean" in metrics))  # fmt: skip


def _assert_nothing_stranded(prefill, decode) -> None:
    """The prefill's lease ended (rank 0 holds the node's) and vLLM holds no block for the send; the
    decode's scheduler half tracks no request."""
    metrics = wait_for_metrics(prefill.url, lambda m: m.get(LEASES) == 0 and m.get(HELD) == 0, timeout_s=30)  # lease_s is 90
    assert metrics.get(LEASES) == 0 and metrics.get(HELD) == 0, f"the prefill still holds a lease or blocks: {metrics}"
    assert metrics.get("kvbridge_worker_num_expired_leases", 0) == 0, metrics
    metrics = wait_for_metrics(decode.url, lambda m: m.get(TRACKED) == 0 and m.get(HELD) == 0)
    assert metrics.get(TRACKED) == 0 and metrics.get(HELD) == 0, metrics
    for name in (FAILURES, LOAD_ERRORS, RANK1 + "num_failures", RANK1 + "num_load_errors"):
        assert metrics.get(name, 0) == 0, (name, metrics)


def _assert_verified(before: dict, after: dict, prefixes: tuple[str, ...]) -> None:
    """Every decode rank checked the bytes it read against the prefill's digests (granted once every
    prefill rank had digested its heads), and they matched."""
    for prefix in prefixes:
        assert delta(after, before, prefix + "num_digested_bytes") > 0, (prefix, after)  # it digested its copy
        for name in ("num_unverified_reads", "num_digest_mismatches"):
            assert delta(after, before, prefix + name) == 0, (prefix + name, after)


def test_tp2_prefill_feeds_a_tp1_decode(servers):
    out, prefill_colocated, decode_colocated, before, after, external = _pd(servers.tp2, servers.tp1, seed=31)

    assert out.token_ids == decode_colocated, "the TP 1 decode decoded other tokens from the KV it read than from its own"
    assert prefill_colocated == decode_colocated, "TP 2 and TP 1 colocated tokens differ (their numerics)"
    assert external == NUM_BLOCKS * CPU_BLOCK_SIZE > 0
    # one read, of both heads (from two prefill ranks), of exactly the prompt's full blocks
    assert delta(after, before, TRANSFERS) == 1, after
    assert delta(after, before, BYTES) == NUM_BLOCKS * servers.block_nbytes
    _assert_verified(before, after, ("kvbridge_worker_",))
    _assert_nothing_stranded(servers.tp2, servers.tp1)
    _print_step_cost(servers.tp2)
    _print_step_cost(servers.tp1)


def test_tp1_prefill_feeds_a_tp2_decode(servers):
    out, prefill_colocated, decode_colocated, before, after, external = _pd(servers.tp1, servers.tp2, seed=41)

    assert out.token_ids == decode_colocated, "the TP 2 decode decoded other tokens from the KV it read than from its own"
    assert prefill_colocated == decode_colocated, "TP 1 and TP 2 colocated tokens differ (their numerics)"
    assert external == NUM_BLOCKS * CPU_BLOCK_SIZE > 0
    # each decode rank read its own head: one read each, half of the blocks' bytes each
    # each rank's read and its digest reach /metrics in that rank's own snapshot: wait for both ranks' both
    after = wait_for_metrics(servers.tp2.url, lambda m: all(
        delta(m, before, prefix + name) > 0 for prefix in ("kvbridge_worker_", RANK1) for name in ("num_transfers", "num_digested_bytes")
    ), timeout_s=30)  # fmt: skip
    for prefix in ("kvbridge_worker_", RANK1):
        assert delta(after, before, prefix + "num_transfers") == 1, (prefix, after)
        assert delta(after, before, prefix + "bytes_transferred") == NUM_BLOCKS * servers.block_nbytes // 2, (prefix, after)
    _assert_verified(before, after, ("kvbridge_worker_", RANK1))
    _assert_nothing_stranded(servers.tp1, servers.tp2)
    _print_step_cost(servers.tp2)


def test_a_load_error_on_one_decode_rank_fails_the_whole_read_and_vllm_recomputes(servers):
    """Rank 1 of the decode refuses its read (its bytes differ from the prefill's per-head digest); rank 0's
    read is fine. vLLM unites both workers' invalid blocks and finishes the load once both reported it:
    the decode recomputes (policy recompute) and decodes its colocated tokens, and the prefill's lease
    ends at once (rank 1 abandoned its part, rank 0 confirmed), not when it expires."""
    out, _, decode_colocated, before, after, _ = _pd(servers.tp1, servers.tp2_flips, seed=51)
    after = wait_for_metrics(servers.tp2_flips.url, lambda m: delta(m, before, RANK1 + "num_digest_mismatches") >= 1)

    assert out.token_ids == decode_colocated, "the decode used KV one of its ranks refused"
    assert delta(after, before, RANK1 + "num_digest_mismatches") == 1, after
    assert delta(after, before, RANK1 + "num_load_errors") == NUM_BLOCKS, after
    assert delta(after, before, "kvbridge_worker_num_digest_mismatches") == 0, after
    assert delta(after, before, FAILURES) == 0, after
    # well inside the 90 s lease: a release, not an expiry (asserted below), even after a stalled host
    prefill = wait_for_metrics(servers.tp1.url, lambda m: m.get(LEASES) == 0 and m.get(HELD) == 0, timeout_s=30)
    assert prefill.get(LEASES) == 0 and prefill.get(HELD) == 0, prefill
    assert prefill.get("kvbridge_worker_num_expired_leases", 0) == 0, prefill
    decode = wait_for_metrics(servers.tp2_flips.url, lambda m: m.get(TRACKED) == 0 and m.get(HELD) == 0)
    assert decode.get(TRACKED) == 0 and decode.get(HELD) == 0, decode
