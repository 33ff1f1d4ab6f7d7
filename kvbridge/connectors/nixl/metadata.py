"""The NixlConnector's per-step plan, scheduler side -> worker side. Plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connectors.base import KVConnectorMetadata
from kvbridge.kv_transfer_params import tcp_address
from kvbridge.transfer.messages import LeaseRef


@dataclass(frozen=True)
class RemoteEngine:
    """A prefill engine's identity and side-channel address, as its kv_transfer_params gave them."""

    engine_id: str
    host: str
    port: int
    incarnation: str  # the engine instance that granted the lease; a restarted one has another

    @property
    def address(self) -> str:
        return tcp_address(self.host, self.port)


@dataclass(frozen=True)
class RecvJob:
    """Decode side: read `remote_block_ids` of `remote` into `local_block_ids` (token order; as many
    unless the prefill's block size differs from ours, the same tokens either way).

    An empty job still tells the prefill engine to release its blocks (everything hit locally).
    """

    request_id: str
    remote: RemoteEngine
    lease: LeaseRef  # names the prefill's lease in renewals and in the release that confirms the read
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    lease_offset: int = 0  # remote_block_ids start at lease.block_ids[lease_offset] (local prefix hits before)
    lease_s: float = 0.0  # the prefill's lease term from the params (0: not given); renewals keep inside it
    grant: str = ""  # the prefill's signed grant from the params (transfer/grants.py); "": confirm the read
    # loaded in this step, before its forward pass (the NixlConnector option sync_ipc_reads): a CUDA IPC
    # copy verified by `grant`, or a load error; never a read still in flight when the step ends
    sync: bool = False

    @property
    def remote_request_id(self) -> str:
        return self.lease.req_id


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    recvs: dict[str, RecvJob] = field(default_factory=dict)  # decode: reads to start
    leases: dict[str, LeaseRef] = field(default_factory=dict)  # prefill: leases to grant on held blocks
    # the engine runs no model in this step and polls again only after it (SchedulerOutput.runs_model):
    # the decode may wait in it for a read in flight to end (NixlConnector option idle_step_wait_s)
    idle_step: bool = False
