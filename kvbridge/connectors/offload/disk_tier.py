"""The disk tier's files: one file per block, named by the block hash, under one directory.

File format (little endian):

    magic      8 bytes   b"KVBBLOCK"
    version    u32       FORMAT_VERSION
    compat     32 bytes  KVCacheLayout.compat_hash(model_id): model identity + block geometry
    hash       16 bytes  the block hash (must match the file name)
    nbytes     u64       payload size (must equal the layout's block size in bytes)
    alg        8 bytes   digest algorithm, ASCII, NUL-padded (transfer/digest.py: "xxh3-64", "wsum64")
    digest     u64       the block's digest, recorded when the block was stored in the host tier
    payload    nbytes    the block, in the block-major layout

A file from another model, dtype or geometry, an older format or a torn write is rejected on read
(`DiskBlockError`); the load then fails like any other and the block is recomputed. Bit rot is
caught by the digest, the same one that guards the host tier (docs/offload.md, "Integrity"): with
`check_payload` the read checks it here, on the I/O thread; without, the read returns the digest
and the worker checks the bytes it finally copied into the KV cache (one pass, fused into that
copy) — either way a corrupt file is a miss, never KV.
Writes go to a temporary name and are renamed into place, so a crash never leaves a half file
under a valid name. The writer holds an exclusive `flock` on its temporary file until the rename:
the kernel drops the lock when the process dies, so a temporary file nobody holds a lock on is an
orphan of a crash, and opening the tier deletes it (`remove_orphaned_temp_files`). Other engines
writing to the same directory at that moment keep their files: they hold the lock. All I/O runs
on one worker thread (FIFO, so a delete or read issued after a write of the same block sees it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvbridge.block_hash import BlockHash
from kvbridge.connectors.offload.disk_index import block_file_name, is_temp_file_name, temp_file_name
from kvbridge.errors import KVBridgeError
from kvbridge.transfer.digest import ALGORITHMS, XXH3, BlockDigest, DigestError, digest_of_bytes

MAGIC = b"KVBBLOCK"
FORMAT_VERSION = 2  # 1: a CRC-32 of the payload instead of (alg, digest)
_HEADER = struct.Struct("<8sI32s16sQ8sQ")
# A writer creates its temporary file and locks it a moment later; a younger unlocked file may be in
# that gap, so it is left alone (the next open removes it if it is an orphan).
ORPHAN_MIN_AGE_S = 10.0

logger = logging.getLogger(__name__)


class DiskBlockError(KVBridgeError):
    """A block file is missing, stale, foreign or corrupt; the block is recomputed instead."""


def encode_header(compat_hash: str, block_hash: BlockHash, nbytes: int, digest: BlockDigest) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, compat_hash.encode(), block_hash, nbytes, digest.alg.encode(), digest.value)


def check_header(header: bytes, compat_hash: str, block_hash: BlockHash, nbytes: int) -> BlockDigest:
    """Validate a header; returns the digest the payload must have."""
    if len(header) != _HEADER.size:
        raise DiskBlockError("truncated header")
    magic, version, compat, stored_hash, stored_nbytes, alg, value = _HEADER.unpack(header)
    if magic != MAGIC:
        raise DiskBlockError("not a kvbridge block file (bad magic)")
    if version != FORMAT_VERSION:
        raise DiskBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if compat != compat_hash.encode():
        raise DiskBlockError("written by another model or KV layout (compat hash differs)")
    if stored_hash != block_hash:
        raise DiskBlockError("block hash in the header does not match the file name")
    if stored_nbytes != nbytes:
        raise DiskBlockError(f"payload of {stored_nbytes} B, expected {nbytes} B")
    alg = alg.rstrip(b"\0").decode("ascii", errors="replace")
    if alg not in ALGORITHMS:
        raise DiskBlockError(f"digest algorithm {alg!r} unknown to this build ({', '.join(ALGORITHMS)})")
    return BlockDigest(alg, value)


class DiskTier:
    """Reads and writes block files for the worker side, on one I/O thread."""

    def __init__(self, directory: str, compat_hash: str, block_nbytes: int, fault: str | None = None) -> None:
        """`fault` (tests only, env.fault_corrupt_disk_file): "flip" a payload bit or "truncate" every
        file after writing it."""
        os.makedirs(directory, exist_ok=True)
        self._fault = fault
        self.directory = directory
        self.compat_hash = compat_hash
        self.block_nbytes = block_nbytes
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-offload-disk")
        self._queued: set[Future] = set()  # operations not yet run
        self.bytes_written = self.bytes_read = self.num_write_failures = self.num_read_failures = 0
        self.num_orphans_removed = remove_orphaned_temp_files(directory)

    def path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.directory, block_file_name(block_hash))

    # ------------------------------------------------------------------ synchronous (I/O thread)

    def write(self, block_hash: BlockHash, block: torch.Tensor, digest: BlockDigest | None = None) -> None:
        """Write one block ([block_nbytes] uint8, CPU) to its file, atomically. `digest`: the one the
        host tier recorded when the block was stored (None: XXH3 of `block`, computed here)."""
        payload = memoryview(block.numpy())
        if digest is None:
            digest = BlockDigest(XXH3, digest_of_bytes(block, XXH3))
        tmp = os.path.join(self.directory, temp_file_name(block_hash, os.getpid()))
        try:
            with open(tmp, "w+b") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # held until after the rename: "not an orphan"
                f.write(encode_header(self.compat_hash, block_hash, payload.nbytes, digest))
                f.write(payload)
                os.replace(tmp, self.path(block_hash))
                if self._fault is not None:
                    self._inject_fault(f)
        except OSError:
            self.num_write_failures += 1
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.bytes_written += payload.nbytes

    def _inject_fault(self, f) -> None:
        """Test hook: corrupt the file just written (`f`, open for update, now under its final name)."""
        if self._fault == "truncate":
            f.truncate(_HEADER.size + self.block_nbytes - 1)
        else:  # "flip": one bit in the middle of the payload
            at = _HEADER.size + self.block_nbytes // 2
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))

    def read_into(self, block_hash: BlockHash, out: torch.Tensor, check_payload: bool = True) -> BlockDigest:
        """Read one block into `out` ([block_nbytes] uint8, CPU) and return the digest its file names.
        DiskBlockError when the file is missing, stale, foreign or torn, and, with `check_payload`,
        when the payload's digest differs (without, the caller must check it before using the bytes)."""
        try:
            with open(self.path(block_hash), "rb") as f:
                digest = check_header(f.read(_HEADER.size), self.compat_hash, block_hash, self.block_nbytes)
                view = memoryview(out.numpy())
                if f.readinto(view) != self.block_nbytes or f.read(1):
                    raise DiskBlockError("payload size differs from the header")
        except OSError as exc:
            self.num_read_failures += 1
            raise DiskBlockError(f"cannot read {self.path(block_hash)}: {exc}") from exc
        except DiskBlockError:
            self.num_read_failures += 1
            raise
        if check_payload and not self._has_digest(out, digest):
            self.num_read_failures += 1
            raise DiskBlockError(f"{digest.alg} digest mismatch (corrupt file)")
        self.bytes_read += self.block_nbytes
        return digest

    @staticmethod
    def _has_digest(block: torch.Tensor, digest: BlockDigest) -> bool:
        try:
            return digest_of_bytes(block, digest.alg) == digest.value
        except DigestError:
            return False

    def delete(self, block_hash: BlockHash) -> None:
        try:
            os.unlink(self.path(block_hash))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ asynchronous

    def _submit(self, fn, *args) -> Future:
        future = self._io.submit(fn, *args)
        self._queued.add(future)
        future.add_done_callback(self._queued.discard)
        return future

    def submit_write(self, block_hash: BlockHash, block: torch.Tensor, digest: BlockDigest | None = None) -> Future:
        return self._submit(self.write, block_hash, block, digest)

    def submit_read(self, block_hash: BlockHash, out: torch.Tensor, check_payload: bool = True) -> Future:
        """A future of `read_into`'s BlockDigest."""
        return self._submit(self.read_into, block_hash, out, check_payload)

    def submit_delete(self, block_hash: BlockHash) -> Future:
        return self._submit(self.delete, block_hash)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued operation ran (at most `timeout_s`); True when none is left."""
        _, not_done = wait(list(self._queued), timeout=timeout_s)
        return not not_done

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def get_stats(self) -> dict[str, int]:
        return {
            "disk_bytes_written": self.bytes_written,
            "disk_bytes_read": self.bytes_read,
            "disk_write_failures": self.num_write_failures,
            "disk_read_failures": self.num_read_failures,
            "disk_orphans_removed": self.num_orphans_removed,
        }


def remove_orphaned_temp_files(directory: str, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
    """Delete the temporary files in `directory` that a crashed write left behind: no process holds
    their lock and they are older than `min_age_s`. Returns how many were deleted."""
    num_removed = 0
    now = time.time()
    with os.scandir(directory) as it:
        for entry in it:
            if is_temp_file_name(entry.name) and _is_orphan(entry.path, now - min_age_s):
                num_removed += 1
    if num_removed:
        logger.warning("disk tier %s: removed %d temporary file(s) left by a crashed write", directory, num_removed)
    return num_removed


def _is_orphan(path: str, created_before: float) -> bool:
    """Deletes `path` and returns True if it is unlocked and was last written before `created_before`."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_mtime >= created_before:
                return False
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a live writer holds it
            os.unlink(path)  # under our lock: no writer can be renaming it now
            return True
    except OSError:
        return False  # renamed into place or removed meanwhile, or not ours to remove
