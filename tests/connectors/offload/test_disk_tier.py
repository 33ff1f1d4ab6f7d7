"""Disk tier files: round trip, rejection of stale, foreign and corrupt files, crash leftovers."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from kvbridge.connectors.offload.disk_index import (
    DiskTierIndex,
    block_file_name,
    is_temp_file_name,
    scan_block_files,
    temp_file_name,
)
from kvbridge.connectors.offload.disk_tier import DiskBlockError, DiskTier
from kvbridge.layout import KVCacheLayout

LAYOUT = KVCacheLayout(num_blocks=4, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
HASH = bytes(range(16))


def _tier(directory, model_id="tiny", layout=LAYOUT) -> DiskTier:
    return DiskTier(str(directory), layout.compat_hash(model_id), layout.block_nbytes)


def _block(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.block_shape, generator=gen).to(torch.bfloat16).reshape(-1).view(torch.uint8)


def test_round_trip(tmp_path):
    tier = _tier(tmp_path)
    block = _block(0)
    tier.submit_write(HASH, block).result(timeout=10)
    out = torch.zeros_like(block)
    tier.submit_read(HASH, out).result(timeout=10)
    assert torch.equal(out, block)
    assert tier.get_stats()["disk_bytes_read"] == LAYOUT.block_nbytes
    assert scan_block_files(str(tmp_path)) == [HASH]
    tier.close()


@pytest.mark.parametrize(
    "other",
    [
        {"model_id": "another-model"},
        {"layout": KVCacheLayout(4, 2, 4, 2, 8, "float16")},  # same size, other dtype
    ],
)
def test_foreign_files_are_rejected(tmp_path, other):
    _tier(tmp_path, **other).write(HASH, _block(1))
    with pytest.raises(DiskBlockError, match="compat hash|payload"):
        _tier(tmp_path).read_into(HASH, torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8))


def test_corrupt_truncated_and_old_version_files_are_rejected(tmp_path):
    tier, out = _tier(tmp_path), torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8)
    path = tier.path(HASH)
    tier.write(HASH, _block(2))
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DiskBlockError, match="digest mismatch"):
        tier.read_into(HASH, out)
    tier.write(HASH, _block(2))
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(DiskBlockError, match="size"):
        tier.read_into(HASH, out)
    tier.write(HASH, _block(2))
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 999))
    with pytest.raises(DiskBlockError, match="version"):
        tier.read_into(HASH, out)
    os.replace(path, tier.path(bytes(16)))  # a file under another block's name
    with pytest.raises(DiskBlockError):
        tier.read_into(bytes(16), out)
    with pytest.raises(DiskBlockError, match="cannot read"):
        tier.read_into(HASH, out)  # missing
    assert tier.num_read_failures == 5


def test_disk_index_capacity_pins_and_warm_scan(tmp_path):
    for i in range(3):
        (tmp_path / block_file_name(bytes([i]) * 16)).write_bytes(b"x")
        os.utime(tmp_path / block_file_name(bytes([i]) * 16), (i, i))
    (tmp_path / "unrelated.txt").write_text("ignored")
    index = DiskTierIndex(capacity=2, initial=scan_block_files(str(tmp_path)))
    assert bytes([0]) * 16 not in index and len(index) == 2  # the oldest went over capacity
    assert index.take_deletes() == [bytes([0]) * 16]
    index.pin(bytes([1]) * 16)
    index.add(bytes([9]) * 16)
    assert bytes([1]) * 16 in index and bytes([2]) * 16 not in index  # pinned survives
    index.unpin(bytes([1]) * 16)
    index.check_integrity()


def _crash_mid_write(directory, block_hash: bytes) -> str:
    """A process that dies (SIGKILL) halfway through `DiskTier.write`: its temporary file stays."""
    script = textwrap.dedent(f"""
        import os, signal
        from kvbridge.connectors.offload.disk_tier import DiskTier
        from kvbridge.connectors.offload.disk_index import temp_file_name
        tier = DiskTier({str(directory)!r}, "0" * 32, 64)
        def crash(src, dst):  # the header and payload are written, the rename never happens
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = crash
        import torch
        tier.write({block_hash!r}, torch.zeros(64, dtype=torch.uint8))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    (name,) = [n for n in os.listdir(directory) if is_temp_file_name(n)]
    assert name == temp_file_name(block_hash, int(name.rpartition(".tmp")[2]))
    return str(directory / name)


def test_opening_the_tier_removes_temporary_files_a_crash_left(tmp_path):
    orphan = _crash_mid_write(tmp_path, HASH)
    os.utime(orphan, (1, 1))  # the crash was a while ago
    fresh = tmp_path / temp_file_name(bytes(16), 99)  # unlocked, but maybe a writer that did not lock yet
    fresh.write_bytes(b"x")
    live = tmp_path / temp_file_name(bytes([7]) * 16, 98)  # old, but a live writer holds its lock
    live.write_bytes(b"x")
    os.utime(live, (1, 1))
    unrelated = tmp_path / "notes.tmp1"
    unrelated.write_text("not a block write")
    os.utime(unrelated, (1, 1))
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        tier = _tier(tmp_path)
    assert not os.path.exists(orphan)
    assert fresh.exists() and live.exists() and unrelated.exists()
    assert tier.get_stats()["disk_orphans_removed"] == 1
    assert scan_block_files(str(tmp_path)) == []  # temporary files never count as blocks
    block = _block(3)
    tier.submit_write(HASH, block).result(timeout=10)  # the tier works: the block the crash lost
    out = torch.zeros_like(block)
    tier.submit_read(HASH, out).result(timeout=10)
    assert torch.equal(out, block) and scan_block_files(str(tmp_path)) == [HASH]
    assert not any(is_temp_file_name(n) for n in os.listdir(tmp_path) if n.startswith(HASH.hex()))
    tier.close()


def test_a_file_carries_the_digest_it_was_written_with_and_a_deferred_check_returns_it(tmp_path):
    """The host tier's digest goes into the header; a read without `check_payload` hands it back for
    the caller to check on the bytes it finally uses, and does not hash the payload itself."""
    from kvbridge.transfer.digest import WSUM, XXH3, BlockDigest, digest_of_bytes

    tier, block, out = _tier(tmp_path), _block(3), torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8)
    recorded = BlockDigest(WSUM, digest_of_bytes(block, WSUM))
    tier.write(HASH, block, recorded)
    assert tier.read_into(HASH, out) == recorded and torch.equal(out, block)  # checked with the header's algorithm
    tier.write(HASH, block)  # no digest given: XXH3 of the payload
    assert tier.read_into(HASH, out) == BlockDigest(XXH3, digest_of_bytes(block, XXH3))
    tier.write(HASH, block, BlockDigest(XXH3, 12345))  # a digest the payload does not have
    assert tier.read_into(HASH, out, check_payload=False) == BlockDigest(XXH3, 12345)
    with pytest.raises(DiskBlockError, match="digest mismatch"):
        tier.read_into(HASH, out)


@pytest.mark.parametrize(("fault", "error"), [("flip", "digest mismatch"), ("truncate", "size")])
def test_the_fault_hooks_corrupt_every_file_they_write(tmp_path, fault, error):
    faulty = DiskTier(str(tmp_path), LAYOUT.compat_hash("tiny"), LAYOUT.block_nbytes, fault=fault)
    faulty.write(HASH, _block(4))
    with pytest.raises(DiskBlockError, match=error):
        _tier(tmp_path).read_into(HASH, torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8))


def test_format_1_files_with_a_crc_are_rejected(tmp_path):
    tier = _tier(tmp_path)
    tier.write(HASH, _block(5))
    with open(tier.path(HASH), "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 1))
    with pytest.raises(DiskBlockError, match="format version 1, expected 2"):
        tier.read_into(HASH, torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8))
