"""Every environment variable kvbridge reads, typed, in one place. All are prefixed KVBRIDGE_."""

from __future__ import annotations

import os

from kvbridge.errors import ConfigError


def _get_str(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


def _get_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a number") from None


def _get_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def side_channel_secret() -> bytes | None:
    """KVBRIDGE_SIDE_CHANNEL_SECRET: shared secret that authenticates side-channel peers (HMAC), at least
    32 bytes (transfer/auth.py checks). Unset: this user's host secret (transfer/host_secret.py)."""
    value = _get_str("KVBRIDGE_SIDE_CHANNEL_SECRET", None)
    return value.encode() if value else None


def xdg_runtime_dir() -> str | None:
    """XDG_RUNTIME_DIR (the login session's private directory, read here only to find the host's
    side-channel secret; transfer/host_secret.py)."""
    return os.environ.get("XDG_RUNTIME_DIR") or None


def admin_token() -> str | None:
    """KVBRIDGE_ADMIN_TOKEN: bearer token that a node's admin endpoints require (default none: open).
    `kvbridge serve --admin-token-file` takes precedence."""
    value = (_get_str("KVBRIDGE_ADMIN_TOKEN", None) or "").strip()
    return value or None


def checkpoint_full_hash() -> bool:
    """KVBRIDGE_CHECKPOINT_FULL_HASH: a checkpoint's identity hashes every byte of every weight file,
    not samples of files over 256 MiB (engine/checkpoint_id.py says when that matters)."""
    return _get_bool("KVBRIDGE_CHECKPOINT_FULL_HASH", False)


def log_level(default: str = "WARNING") -> str:
    """KVBRIDGE_LOG_LEVEL: logging level of the `kvbridge` logger; a command's `--log-level` overrides
    it, and `default` (the command's own) applies when it is unset."""
    return (_get_str("KVBRIDGE_LOG_LEVEL", default) or default).upper()


def log_level_override() -> str | None:
    """KVBRIDGE_LOG_LEVEL when it is set, else None (an engine that hosts kvbridge keeps its own level)."""
    value = (_get_str("KVBRIDGE_LOG_LEVEL", "") or "").strip().upper()
    return value or None


def flush_timeout_s() -> float:
    """KVBRIDGE_FLUSH_TIMEOUT_S: default bound on reset_prefix_cache/shutdown waiting for transfers."""
    return _get_float("KVBRIDGE_FLUSH_TIMEOUT_S", 30.0)


def nixl_progress_delay_us() -> float:
    """KVBRIDGE_NIXL_PROGRESS_DELAY_US: pause of NIXL's progress thread between rounds when it has no
    work (default 100 us). 0 spins, as NIXL's Python wrapper does: a whole core per idle agent."""
    value = _get_float("KVBRIDGE_NIXL_PROGRESS_DELAY_US", 100.0)
    if value < 0:
        raise ConfigError(f"environment variable KVBRIDGE_NIXL_PROGRESS_DELAY_US={value:g} must be >= 0")
    return value


def nixl_backend() -> str:
    """KVBRIDGE_NIXL_BACKEND: NIXL backend plugin to create (default UCX)."""
    return _get_str("KVBRIDGE_NIXL_BACKEND", "UCX") or "UCX"


def disable_gc_freeze() -> bool:
    """KVBRIDGE_DISABLE_GC_FREEZE: do not gc.freeze() after engine start-up."""
    return _get_bool("KVBRIDGE_DISABLE_GC_FREEZE", False)


def torch_uses_expandable_segments() -> bool:
    """PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (torch's, read here only to warn): expandable
    segments give CUDA VMM memory, which UCX's cuda_ipc transport cannot export."""
    conf = f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')},{os.environ.get('PYTORCH_ALLOC_CONF', '')}"
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def ucx_tls() -> str | None:
    """UCX_TLS (UCX's transport list, read here only to explain a backend that fails to start)."""
    return os.environ.get("UCX_TLS") or None


def fault_flip_read_bit() -> bool:
    """KVBRIDGE_FAULT_FLIP_READ_BIT: fault injection for tests. A decode node flips one bit of the
    first block of every NIXL read once its bytes land, as a fault in flight would; digest
    verification must then refuse the read. Never set it in production."""
    return _get_bool("KVBRIDGE_FAULT_FLIP_READ_BIT", False)


def fault_digest_defect() -> bool:
    """KVBRIDGE_FAULT_DIGEST_DEFECT: fault injection for tests. An owner's lease digests raise an
    unexpected error (RuntimeError), as a defect in them would: the node must refuse those leases' reads
    to verifying readers and keep serving. Never set it in production."""
    return _get_bool("KVBRIDGE_FAULT_DIGEST_DEFECT", False)


def fault_flip_read_bit_rank() -> int | None:
    """KVBRIDGE_FAULT_FLIP_READ_BIT_RANK: with KVBRIDGE_FAULT_FLIP_READ_BIT, only this tensor-parallel
    rank of the decode node flips its reads' bit (default: every rank). For tests only."""
    value = (_get_str("KVBRIDGE_FAULT_FLIP_READ_BIT_RANK", "") or "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable KVBRIDGE_FAULT_FLIP_READ_BIT_RANK={value!r}; expected a rank number") from None


def fault_delay_confirm_s() -> float:
    """KVBRIDGE_FAULT_DELAY_CONFIRM_S: fault injection for tests. A decode node waits this long (on
    its side-channel thread) before it sends a read's confirmation (TransferDone), as a slow network
    would: the read's request then computes its first step early and holds its token that long.
    Default 0. Never set it in production."""
    return max(0.0, _get_float("KVBRIDGE_FAULT_DELAY_CONFIRM_S", 0.0))


def fault_delay_read_s() -> float:
    """KVBRIDGE_FAULT_DELAY_READ_S: fault injection for tests. A reader (decode node) keeps each NIXL
    read in flight, unposted, this long, then posts it: its bytes land that late, as a stalled peer's
    would (transfer/delayed_post.py). Past transfer_timeout_s the read expires first and its blocks are
    quarantined until the late bytes have landed. Default 0. Never set it in production."""
    return max(0.0, _get_float("KVBRIDGE_FAULT_DELAY_READ_S", 0.0))


def fault_flip_host_block_bit() -> bool:
    """KVBRIDGE_FAULT_FLIP_HOST_BIT: fault injection for tests. The OffloadingConnector flips one bit
    of the first host-tier slot of every store once the store completed and its digest was recorded,
    as a flaky DIMM would; verification must refuse those blocks when they are loaded back. Never set
    it in production."""
    return _get_bool("KVBRIDGE_FAULT_FLIP_HOST_BIT", False)


DISK_FAULTS = ("flip", "truncate")


def fault_corrupt_disk_file() -> str | None:
    """KVBRIDGE_FAULT_CORRUPT_DISK_FILE: fault injection for tests. `flip`: the disk tier flips one bit
    of every block file's payload after writing it (bit rot); `truncate`: it cuts the file's last byte
    off (a torn write). A load from such a file must be a miss. Never set it in production."""
    value = (_get_str("KVBRIDGE_FAULT_CORRUPT_DISK_FILE", "") or "").strip().lower()
    if value and value not in DISK_FAULTS:
        raise ConfigError(
            f"environment variable KVBRIDGE_FAULT_CORRUPT_DISK_FILE={value!r}; expected one of {', '.join(DISK_FAULTS)}"
        )
    return value or None


def vllm_none_hash_seed() -> str | None:
    """PYTHONHASHSEED (vLLM's variable, not ours): the seed vLLM derives its first block hash from when it
    is set. A node publishing KV events must see the value its fleet's vLLM nodes see (block_hash.py)."""
    return _get_str("PYTHONHASHSEED", None)


def vllm_kv_events_int_hashes() -> bool:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's variable, default 1): KV events carry block hashes as
    64-bit ints; 0 carries the digests' bytes. Set it as the fleet's vLLM nodes have it."""
    return _get_bool("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True)


def validate() -> None:
    """Read every numeric variable once: a malformed value is a ConfigError at start, not a
    traceback from deep inside an engine's start-up."""
    flush_timeout_s()
    nixl_progress_delay_us()
    fault_corrupt_disk_file()
