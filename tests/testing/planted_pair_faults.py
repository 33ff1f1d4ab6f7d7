"""A P/D connector that breaks one rule, for the conformance kit's pair mode (`--kvbridge-pair`):
kvbridge's NixlConnector whose decode side reports a read finished as soon as it posts it."""

from __future__ import annotations

from kvbridge.connectors.base import CompletedTransfers
from kvbridge.connectors.nixl.connector import NixlConnector


class EarlyRecvNixlConnector(NixlConnector):
    """The consumer names a read in finished_recving in the step that posts it (its bytes land
    later, after the handshake with the producer), and drops the read's own report when it comes."""

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.posted: set[str] = set()  # reads posted this step
        self.reported_early: set[str] = set()

    def start_load_kv(self) -> None:
        meta = self.get_connector_metadata()
        recvs = getattr(meta, "recvs", None) or {}
        self.posted = {r for r, job in recvs.items() if job.local_block_ids}
        super().start_load_kv()

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        sending, recving = super().get_finished(finished_req_ids)
        late = recving & self.reported_early
        self.reported_early = (self.reported_early | self.posted) - late
        early, self.posted = self.posted, set()
        return CompletedTransfers(sending, (recving - late) | early)
