"""P/D between engines of different tensor-parallel sizes over real NIXL on loopback.

Every rank of each side registers its own KV heads with its own NIXL agent; the prefill node's
rank 0 answers handshakes for every rank and holds the node's leases; each decode rank reads the
heads it needs from the prefill ranks that hold them and verifies every rank's bytes against that
rank's digest. Completions equal a colocated TP 1 engine's, and no block is stranded on either side.
"""

from __future__ import annotations

import os

import pytest
from prefill_node import engine_kwargs, prefill_node
from test_pd import GREEDY, assert_all_free_or_cached, colocated, make_prompts

from kvbridge import LLM

pytestmark = [pytest.mark.nixl, pytest.mark.tp]


@pytest.fixture(scope="module")
def want() -> tuple[list[dict], list[list[int]]]:
    prompts = make_prompts(seed=5)
    reference = LLM(num_blocks=96)  # TP 1, colocated
    try:
        return prompts, colocated(reference, prompts)
    finally:
        reference.shutdown()


def run_pd(prefill_tp: int, decode_tp: int, prompts, env: dict | None = None):
    """Prefill on a TP `prefill_tp` node, decode on a TP `decode_tp` engine; returns (outputs, decode worker stats)."""
    # a decode rank holding only some of a prefill rank's heads checks them against per-head digests,
    # which the prefill gives by default (NixlConnector option digest_kv_heads)
    kwargs = engine_kwargs(f"prefill-tp{prefill_tp}", "kv_producer", tensor_parallel_size=prefill_tp)
    with prefill_node(**kwargs) as node:
        params = node.prefill(prompts)
        with LLM(**engine_kwargs(f"decode-tp{decode_tp}", "kv_consumer", tensor_parallel_size=decode_tp)) as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            worker = dec.get_stats()["connector"]["worker"]
            print(worker)
            # a first step computed before the confirmation: one rank only (engine/unconfirmed_loads.py)
            num_early = dec.get_stats()["num_early_steps"]
            assert num_early == 0 if decode_tp > 1 else num_early > 0
            dec.engine.check_integrity()
            assert_all_free_or_cached(dec.get_stats())
        assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))
    return outs, worker


SLOW = pytest.mark.slow  # a TP 2 decode: two more processes, ~25 s on 2 CPU cores


@pytest.mark.parametrize(
    "prefill_tp,decode_tp", [(2, 1), pytest.param(1, 2, marks=SLOW), pytest.param(2, 2, marks=SLOW)]
)
def test_pd_between_tp_sizes_matches_colocated_tp1(prefill_tp, decode_tp, want):
    prompts, tokens = want
    outs, worker = run_pd(prefill_tp, decode_tp, prompts)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert [o.num_external_tokens for o in outs] == [len(p["prompt_token_ids"]) // 16 * 16 for p in prompts]
    assert worker["num_failures"] == worker["num_digest_mismatches"] == worker["num_unverified_reads"] == 0
    assert worker["num_digested_bytes"] > 0  # every read was checked against the prefill ranks' digests


@pytest.mark.parametrize("prefill_tp,decode_tp,flip_rank", [(2, 1, 0), pytest.param(2, 2, 1, marks=SLOW)])
def test_a_bit_flipped_on_one_rank_fails_the_read_for_the_request(prefill_tp, decode_tp, flip_rank, want, monkeypatch):
    """A bit flipped in flight on one decode rank (its first block, in the heads it read from one prefill
    rank) is caught by that rank's digest check, and the request's KV is not used on any rank: it is recomputed."""
    prompts, tokens = want
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT", "1")
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT_RANK", str(flip_rank))  # the decode's rank processes inherit it
    outs, worker = run_pd(prefill_tp, decode_tp, prompts)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert all(o.num_external_tokens == 0 for o in outs)  # recomputed: not one token of the read KV used
    num_read = sum(1 for p in prompts if len(p["prompt_token_ids"]) >= 16)
    # rank 0's own counters: its reads mismatch only when it is the rank that flipped
    assert worker["num_digest_mismatches"] == (num_read if flip_rank == 0 else 0)


def test_a_tp_node_whose_rank_0_cannot_serve_fails_at_once_and_leaves_no_rank_behind():
    """Rank 0 fails to bind its side channel while the other ranks wait to join it: they are killed,
    not told SHUTDOWN (which they could not hear), and the error is the bind's, not a hang."""
    import socket
    import time

    from kvbridge.errors import KVBridgeError

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    start = time.monotonic()
    try:
        with pytest.raises(KVBridgeError):
            LLM(**engine_kwargs("prefill-busy", "kv_producer", tensor_parallel_size=2, kv={"side_channel_port": port}))
    finally:
        busy.close()
    assert time.monotonic() - start < 60
    assert not _tp_workers_of(os.getpid())


def _tp_workers_of(pid: int) -> list[int]:
    """Live tensor-parallel worker processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"tp_worker_main" in cmdline:
            found.append(int(entry))
    return found
