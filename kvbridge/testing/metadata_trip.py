"""The `plain-metadata` rule's check: the metadata a scheduler half builds crosses a process
boundary, through the connector's own codec (`encode_metadata` / `decode_metadata`) or, where it
has none, msgspec, and comes back equal. The tap runs it on every step's metadata; the vLLM suite
runs it on what `KVBridgeConnector` hands vLLM."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvbridge.connectors.base import KVConnectorMetadata


class Trip(NamedTuple):
    """What came back (`meta` itself where nothing could), and what broke the rule (None: nothing)."""

    copy: Any
    finding: str | None = None


def round_trip(meta: Any, scheduler_half: Any, worker_half: Any) -> Trip:
    """`meta` encoded by `scheduler_half` and decoded by `worker_half`, as if they were two processes."""
    if not isinstance(meta, KVConnectorMetadata):
        return Trip(meta, f"build_connector_meta returned a {type(meta).__name__}, not a KVConnectorMetadata")
    if type(meta) is KVConnectorMetadata and not vars(meta):
        return Trip(meta)  # the empty base: nothing to carry
    try:
        try:
            copy = worker_half.decode_metadata(scheduler_half.encode_metadata(meta))
        except NotImplementedError:  # the connector has no codec of its own: msgspec's
            copy = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=type(meta))
    except Exception as exc:  # noqa: BLE001 - any failure to cross a process boundary is the finding
        return Trip(meta, f"{type(meta).__name__} does not survive a msgspec round trip: {type(exc).__name__}: "
                    f"{exc} (use dataclasses or msgspec.Structs of ids, block ids, hashes; no tensors, locks or "
                    "references to connector objects)")  # fmt: skip
    if copy != meta:
        return Trip(meta, f"{type(meta).__name__} decoded differs from what was encoded: {copy!r} != {meta!r}")
    return Trip(copy)
