"""A test connector that raises inside the engine step, where a request's `kv_transfer_params` ask.

`{"fault": WHERE}` makes one hook raise for that request:

    match      get_num_new_matched_tokens (scheduler side, at admission)
    alloc      update_state_after_alloc (scheduler side, at admission)
    finished   request_finished (scheduler side, when the request ends)
    load       start_load_kv (worker side, once per step in which the request is scheduled)
    device     start_load_kv, with the message of a lost CUDA device

Everything else is a connector that moves nothing. Tests use it to check that a fault in one
request's processing fails that request only, and that a device fault fails the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connectors.base import KVConnectorBase, KVConnectorMetadata, KVHandoff, MatchResult

DEVICE_FAULT = "CUDA error: an illegal memory access was encountered (injected by FaultConnector)"


def _fault(request) -> str | None:
    params = request.kv_transfer_params
    return params.get("fault") if isinstance(params, dict) else None


@dataclass
class FaultMeta(KVConnectorMetadata):
    faults: dict[str, str] = field(default_factory=dict)  # request id -> where the worker raises


class FaultConnector(KVConnectorBase):
    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> MatchResult:
        if _fault(request) == "match":
            raise RuntimeError(f"fault injected in get_num_new_matched_tokens of {request.request_id}")
        return MatchResult(0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        if _fault(request) == "alloc":
            raise RuntimeError(f"fault injected in update_state_after_alloc of {request.request_id}")

    def build_connector_meta(self, scheduler_output) -> FaultMeta:
        faults = {s.request.request_id: _fault(s.request) for s in scheduler_output.scheduled}
        return FaultMeta({rid: where for rid, where in faults.items() if where in ("load", "device")})

    def request_finished(self, request, block_ids) -> KVHandoff:
        if _fault(request) == "finished":
            raise RuntimeError(f"fault injected in request_finished of {request.request_id}")
        return KVHandoff(False, None)

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self) -> None:
        meta = self.get_connector_metadata()
        faults = meta.faults if isinstance(meta, FaultMeta) else {}
        if "device" in faults.values():
            raise RuntimeError(DEVICE_FAULT)
        if faults:
            raise RuntimeError(f"fault injected in start_load_kv for {sorted(faults)}")

    def wait_for_save(self) -> None:
        pass
