"""The `kv_transfer_params` that P/D requests carry, parsed and validated in one place.

Flow (ARCHITECTURE.md, "P/D flow"):

    client/proxy -> prefill: {"do_remote_decode": true}
    prefill -> client/proxy: RemotePrefillParams as a dict (returned by `request_finished`)
    client/proxy -> decode:  that dict, with "do_remote_prefill": true

The params arrive from HTTP clients, so they are validated with msgspec and a malformed dict
raises `InvalidRequestError` naming the bad field instead of surfacing as a KeyError mid-step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.errors import InvalidRequestError


class RemotePrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode node finds the prompt's KV: the prefill engine, its address and its blocks."""

    do_remote_prefill: bool = True
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]  # the prompt's full blocks, in token order
    remote_request_id: str
    remote_num_tokens: int = 0  # prompt tokens the blocks cover (len(remote_block_ids) * block_size)
    # Chained hash (hex) of the last remote block: it identifies every token the blocks hold, so the
    # decode side can tell that these blocks belong to the prompt it was sent. "" skips the check.
    remote_block_hash: str = ""
    remote_block_size: int = 0  # tokens per block on the prefill engine (0: unknown)
    lease_s: float = 0.0  # how long the prefill holds the blocks without a renewal

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True for a request sent to a prefill node: keep its KV for a decode node to read."""
    return bool(params and params.get("do_remote_decode"))


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefillParams | None:
    """The remote-prefill params of a request for a decode node, None when it has none.

    Raises InvalidRequestError when `do_remote_prefill` is set but the rest is malformed.
    """
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        parsed = msgspec.convert(params, RemotePrefillParams, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(
            f"kv_transfer_params for remote prefill are malformed: {e}; pass the kv_transfer_params "
            "that the prefill node returned, unchanged"
        ) from None
    if not 0 < parsed.remote_port < 65536:
        raise InvalidRequestError(f"kv_transfer_params.remote_port={parsed.remote_port} is not a port")
    if any(b < 0 for b in parsed.remote_block_ids):
        raise InvalidRequestError("kv_transfer_params.remote_block_ids holds a negative block id")
    return parsed
