"""How a `KVEndpoint` transfers: its operations, descriptor modes and tunables, each default once.

`TransferOptions` is validated when built, so an endpoint never starts with a mode it does not
know. A connector that exposes these options to its users extends the dataclass (the
NixlConnector's `NixlOptions` does) rather than repeating the fields and their defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvbridge.errors import ConfigError


class TransferOp(str, enum.Enum):
    """A NIXL / CUDA IPC operation, named from the local side."""

    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class DescriptorMode(str, enum.Enum):
    """How a transfer becomes NIXL descriptors (see nixl_post.py)."""

    BLOCKS = "blocks"  # prepared per-unit lists, cached; NIXL merges adjacent entries
    RANGES = "ranges"  # coalesced byte ranges, prepared per transfer, split at max_descriptor_nbytes


@dataclass(frozen=True)
class TransferOptions:
    handshake_timeout_s: float = 5.0  # per attempt
    handshake_retries: int = 2
    transfer_timeout_s: float = 30.0  # handshake + read of one request, end to end
    backend: str | None = None  # NIXL backend plugin; None: KVBRIDGE_NIXL_BACKEND, else UCX
    backend_params: dict[str, str] = field(default_factory=dict)  # the plugin's parameters (UCX: num_workers)
    descriptor_mode: DescriptorMode = DescriptorMode.BLOCKS
    max_descriptor_nbytes: int | None = None  # "ranges": split longer ranges
    cuda_ipc: bool = True  # GPU peers on one host copy each other's KV through CUDA IPC mappings, not NIXL
    ipc_min_runs: int = 16  # ...for transfers of at least this many runs of blocks (fewer: NIXL is as fast)
    # A read through a CUDA IPC mapping (a copy between GPUs of one host: ~0.3-1.5 ms for 512 MiB) is
    # waited for in the poll after its post, so it lands in the engine step that posted it, not in a
    # later one. Off: polled like a NIXL read.
    wait_ipc_reads: bool = True
    # A read from a peer on this very GPU runs as one kernel on the SMs, which also digests (wsum64) the
    # bytes it wrote, instead of copy-engine copies (about a quarter of the SMs' rate for a same-GPU copy).
    # Needs Triton; without it, or off, the copy engines move it.
    ipc_sm_reads: bool = True
    # Serve a side channel off loopback without KVBRIDGE_SIDE_CHANNEL_SECRET (refused otherwise; auth.py)
    insecure_side_channel: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "descriptor_mode", DescriptorMode(self.descriptor_mode))
        except ValueError:
            modes = " or ".join(repr(m.value) for m in DescriptorMode)
            raise ConfigError(f"{self._owner} option descriptor_mode={self.descriptor_mode!r}; expected {modes}") from None
        for name in ("handshake_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self._owner} option {name} must be positive, got {getattr(self, name)}")
        if self.handshake_retries < 0:
            raise ConfigError(f"{self._owner} option handshake_retries must be >= 0, got {self.handshake_retries}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.backend_params.items()):
            raise ConfigError(
                f"{self._owner} option backend_params must map strings to strings, e.g. {{'num_workers': '4'}}"
            )
        if self.ipc_min_runs < 1:
            raise ConfigError(f"{self._owner} option ipc_min_runs must be >= 1, got {self.ipc_min_runs}")

    @property
    def _owner(self) -> str:
        """Who the options belong to, for error messages (a subclass names its connector)."""
        return "KVEndpoint"
