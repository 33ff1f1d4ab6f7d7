"""The offload tiers verify what they load (reference engine, CPU, greedy).

Faults are injected through the connector's test hooks: a bit of a host-tier block flipped after
its store completed (KVBRIDGE_FAULT_FLIP_HOST_BIT), and a disk file bit-flipped or torn after it
was written (KVBRIDGE_FAULT_CORRUPT_DISK_FILE). Each time the corrupted blocks must be a miss: the
completion equals a clean recompute, the mismatch is counted in the connector's stats (which
/metrics exports), and the block leaves the tier.
"""

from __future__ import annotations

import logging
import os

import pytest
from offload_helpers import GREEDY, check_integrity, make_prompts, offload_llm, reference_outputs, token_ids

from kvbridge.serve.metrics import flatten_numeric

SEED, NUM, LEN = 23, 6, 80  # 6 prompts of 5 blocks against 12 GPU blocks: the second pass loads


def _stats(llm) -> tuple[dict, dict, dict]:
    stats = llm.engine.get_stats()
    return stats, stats["connector"]["scheduler"], stats["connector"]["worker"]


def test_a_clean_round_trip_verifies_every_block_it_loads(caplog):
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    with offload_llm() as llm:
        llm.generate(prompts, GREEDY)
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        stats, sched, worker = _stats(llm)
        check_integrity(llm)
    assert worker["blocks_loaded"] > 0 and stats["num_failed_load_blocks"] == 0
    assert worker["host_digest_mismatches"] == worker["disk_digest_mismatches"] == 0
    assert "OFFLOAD DIGEST MISMATCH" not in caplog.text
    # the counts are on /metrics from the start (the node exports get_stats' numeric leaves)
    assert flatten_numeric(stats)["connector_worker_host_digest_mismatches"] == 0


def test_a_bit_flipped_in_the_host_tier_is_a_miss_never_kv(monkeypatch, caplog):
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_HOST_BIT", "1")  # the first slot of every store rots
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    with caplog.at_level(logging.WARNING), offload_llm() as llm:
        llm.generate(prompts, GREEDY)
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == want  # equal to a clean recompute
        stats, sched, worker = _stats(llm)
        check_integrity(llm)
    assert worker["host_digest_mismatches"] > 0
    assert stats["num_failed_load_blocks"] >= worker["host_digest_mismatches"]
    assert sched["load_failed_blocks"] >= worker["host_digest_mismatches"]  # dropped from the tier
    lines = [r.getMessage() for r in caplog.records if "OFFLOAD DIGEST MISMATCH" in r.getMessage()]
    assert len(lines) == 1 and "host tier" in lines[0], lines  # named once, not once per block


def test_without_verification_the_flipped_block_is_used(monkeypatch):
    """The check above is what refuses the block: with verify_kv_digest off the same fault is a hit."""
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_HOST_BIT", "1")
    prompts = make_prompts(SEED, NUM, LEN)
    with offload_llm({"verify_kv_digest": False}) as llm:
        llm.generate(prompts, GREEDY)
        llm.generate(prompts, GREEDY)
        stats, _, worker = _stats(llm)
    assert stats["num_failed_load_blocks"] == 0 and worker["blocks_loaded"] > 0
    assert "host_digest_mismatches" not in worker  # nothing verified, nothing counted


@pytest.mark.parametrize("verify", [True, False])
def test_a_bit_flipped_in_a_disk_file_is_a_miss_never_kv(tmp_path, monkeypatch, verify):
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    extra = {"disk_dir": str(tmp_path), "verify_kv_digest": verify}
    monkeypatch.setenv("KVBRIDGE_FAULT_CORRUPT_DISK_FILE", "flip")
    with offload_llm(extra) as llm:
        llm.generate(prompts, GREEDY)
    num_files = len(os.listdir(tmp_path))
    assert num_files == NUM * (LEN // 16)
    monkeypatch.delenv("KVBRIDGE_FAULT_CORRUPT_DISK_FILE")
    with offload_llm(extra) as llm:  # a warm restart: every prompt is on disk only, every file rotten
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        stats, sched, worker = _stats(llm)
        check_integrity(llm)
    assert stats["num_failed_load_blocks"] == sched["disk_hit_blocks"] >= NUM * 4  # no rotten block was used
    if verify:  # caught by the load's own digest of the KV it wrote
        assert worker["disk_digest_mismatches"] == sched["disk_hit_blocks"] and worker["disk_read_failures"] == 0
    else:  # caught by the disk thread as it read the file
        assert worker["disk_read_failures"] > 0
    _assert_the_tier_serves_clean_blocks_again(extra, prompts, want)


def _assert_the_tier_serves_clean_blocks_again(extra: dict, prompts: list, want: list) -> None:
    """The bad files were dropped and written afresh by the recompute: a new engine hits all of them."""
    with offload_llm(extra) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        stats, sched, worker = _stats(llm)
    assert sched["disk_hit_blocks"] >= NUM * 4 and stats["num_failed_load_blocks"] == 0
    assert worker.get("disk_digest_mismatches", 0) == worker["disk_read_failures"] == 0


def test_a_torn_disk_file_is_a_miss_never_kv(tmp_path, monkeypatch):
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    extra = {"disk_dir": str(tmp_path)}
    monkeypatch.setenv("KVBRIDGE_FAULT_CORRUPT_DISK_FILE", "truncate")
    with offload_llm(extra) as llm:
        llm.generate(prompts, GREEDY)
    monkeypatch.delenv("KVBRIDGE_FAULT_CORRUPT_DISK_FILE")
    with offload_llm(extra) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        stats, sched, worker = _stats(llm)
        check_integrity(llm)
    assert stats["num_failed_load_blocks"] == sched["disk_hit_blocks"] >= NUM * 4  # no torn block was used
    assert worker["disk_read_failures"] > 0 and worker["disk_digest_mismatches"] == 0  # torn: short, before any hash
    _assert_the_tier_serves_clean_blocks_again(extra, prompts, want)


def test_an_unknown_disk_fault_is_a_config_error(monkeypatch):
    from kvbridge import env
    from kvbridge.errors import ConfigError

    monkeypatch.setenv("KVBRIDGE_FAULT_CORRUPT_DISK_FILE", "shred")
    with pytest.raises(ConfigError, match="flip, truncate"):
        env.validate()
