"""The `kv_transfer_params` that P/D requests carry, parsed and validated in one place.

Connector-neutral: the NixlConnector builds and reads them, the HTTP API validates a request's
before it reaches the engine, and a proxy releases the lease they name; none of them parses them
another way. Flow (docs/pd-disaggregation.md):

    client/proxy -> prefill: {"do_remote_decode": true}
    prefill -> client/proxy: RemotePrefillParams as a dict (returned by `request_finished`)
    client/proxy -> decode:  that dict, with "do_remote_prefill": true

At once (transfer/offers.py), a client sends both legs together under a hand-off key it draws, and
the prefill offers its params straight to the decode's inbox, which every decode answer names:

    client/proxy -> prefill: {"do_remote_decode": true, "handoff": {"key": K, "inbox": InboxAddress}}
    client/proxy -> decode:  {"do_remote_prefill": true, "handoff_key": K, "handoff_inbox": InboxAddress}
    decode -> client/proxy:  {"handoff_inbox": InboxAddress}   (with any answer to a remote-prefill request)

The decode leg's "handoff_inbox" (optional) is the inbox the prefill leg was given: a decode engine
that is not that inbox's (it restarted since the client learnt the inbox, or the leg reached another
node) computes the prompt at once instead of waiting for an offer that goes elsewhere.

The params arrive from HTTP clients, so they are validated with msgspec and a malformed dict
raises `InvalidRequestError` naming the bad field instead of surfacing as a KeyError mid-step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.errors import InvalidRequestError

MAX_BLOCK_ID = (1 << 63) - 1  # block ids travel as int64 (NIXL descriptors, numpy)
MAX_MAC_CHARS = 128  # remote_address_mac: an HMAC-SHA256 in hex is 64
MAX_REMOTE_BLOCKS = 1 << 20  # far above any prompt; bounds what one request makes a node parse and plan
# Fields a decode node needs to prove that the KV it reads belongs to its prompt: refused when missing.
REQUIRED_FIELDS = ("remote_block_hash", "remote_incarnation", "remote_lease_token")


class RemotePrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode node finds the prompt's KV, and the lease that proves the blocks are its prompt's."""

    do_remote_prefill: bool = True
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]  # the prompt's full blocks, in token order
    remote_request_id: str
    remote_num_tokens: int = 0  # prompt tokens the blocks cover (len(remote_block_ids) * block_size)
    # Chained hash (hex) of the last remote block: it identifies every token the blocks hold. The
    # decode side checks it against its own prompt, the prefill side against the lease.
    remote_block_hash: str = ""
    remote_block_size: int = 0  # tokens per block on the prefill engine (0: unknown)
    lease_s: float = 0.0  # how long the prefill holds the blocks without a renewal
    remote_incarnation: str = ""  # the prefill engine instance that holds the lease
    remote_lease_token: str = ""  # the lease's secret: only the requester received it
    # The lease granted when the request finished, signed by the prefill (transfer/grants.py): the
    # decode verifies what it read against it and needs no answer from the prefill. "": ask the prefill.
    remote_grant: str = ""
    # The prefill's side-channel address (engine id, incarnation, host, port) vouched for with the
    # side-channel secret until remote_address_expires_at (wall clock; transfer/address_proof.py): a
    # decode node with a secret connects to no address without it. "": the prefill has no secret.
    remote_address_mac: str = ""
    remote_address_expires_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @property
    def side_channel_address(self) -> str:
        """Where the prefill engine that holds the blocks answers."""
        return tcp_address(self.remote_host, self.remote_port)


HANDOFF_KEY_HEX_CHARS = 64  # 256 random bits: only the client that drew a key can name its offer


class InboxAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode engine instance takes hand-off offers (transfer/offers.py), vouched for with the
    side-channel secret until `expires_at` (wall clock; "" and 0 without a secret)."""

    engine_id: str
    incarnation: str
    host: str
    port: int
    mac: str = ""
    expires_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @property
    def address(self) -> str:
        return tcp_address(self.host, self.port)


class HandoffRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill leg sent at once: offer the finished request's params to `inbox` under `key`."""

    key: str
    inbox: InboxAddress


def parse_handoff(params: dict[str, Any] | None) -> HandoffRequest | None:
    """The hand-off a prefill request asks for (its params' "handoff"), None when it asks for none.
    Raises InvalidRequestError naming the field when it is malformed."""
    if not params or params.get("handoff") is None:
        return None
    try:
        handoff = msgspec.convert(params["handoff"], HandoffRequest, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(
            f"kv_transfer_params.handoff is malformed: {e}; pass {{'key': 64 hex digits, 'inbox': the decode's "
            "handoff_inbox, unchanged}}"
        ) from None
    _check_key(handoff.key, "handoff.key")
    inbox = handoff.inbox
    if not 0 < inbox.port < 65536 or len(inbox.mac) > MAX_MAC_CHARS or not 0 <= inbox.expires_at < 1e12:
        raise InvalidRequestError("kv_transfer_params.handoff.inbox is malformed (port, mac or expires_at)")
    return handoff


def parse_handoff_key(params: dict[str, Any] | None) -> str | None:
    """The hand-off key of a decode request sent at once (remote prefill, no blocks named yet: they come
    in the prefill's offer), None for any other request. Raises InvalidRequestError for a malformed key."""
    if not params or not params.get("do_remote_prefill") or "remote_block_ids" in params:
        return None
    key = params.get("handoff_key")
    if key is None:
        return None
    _check_key(key, "handoff_key")
    return key


def parse_handoff_inbox(params: dict[str, Any] | None) -> InboxAddress | None:
    """The inbox a decode request sent at once says its prefill leg was given (its params' "handoff_inbox"
    beside a hand-off key), None when it names none. Raises InvalidRequestError when it is malformed."""
    if parse_handoff_key(params) is None or params.get("handoff_inbox") is None:
        return None
    try:
        return msgspec.convert(params["handoff_inbox"], InboxAddress, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(
            f"kv_transfer_params.handoff_inbox is malformed: {e}; pass the inbox the prefill leg was given, unchanged"
        ) from None


def _check_key(key: object, name: str) -> None:
    if not (isinstance(key, str) and len(key) == HANDOFF_KEY_HEX_CHARS and all(c in "0123456789abcdef" for c in key)):
        raise InvalidRequestError(
            f"kv_transfer_params.{name} must be {HANDOFF_KEY_HEX_CHARS} lowercase hex digits (256 random bits, "
            "e.g. secrets.token_hex(32)), drawn afresh for each request"
        )


def tcp_address(host: str, port: int) -> str:
    """A ZMQ TCP address; an IPv6 host goes in brackets."""
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True for a request sent to a prefill node: keep its KV for a decode node to read."""
    return bool(params and params.get("do_remote_decode"))


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefillParams | None:
    """The remote-prefill params of a request for a decode node, None when it has none or when they are
    still to come in the prefill's hand-off offer (`parse_handoff_key` names it).

    Raises InvalidRequestError naming the field when `do_remote_prefill` is set but the rest is
    malformed, incomplete or out of range.
    """
    if not params or not params.get("do_remote_prefill") or parse_handoff_key(params) is not None:
        return None  # none, or the prefill's params are still to come, in its offer
    try:
        parsed = msgspec.convert(params, RemotePrefillParams, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(
            f"kv_transfer_params for remote prefill are malformed: {e}; pass the kv_transfer_params "
            "that the prefill node returned, unchanged"
        ) from None
    for name in REQUIRED_FIELDS if parsed.remote_block_ids else ():  # reading nothing needs no proof
        if not getattr(parsed, name):
            raise InvalidRequestError(
                f"kv_transfer_params.{name} is required for a remote prefill: without it the decode node "
                "cannot prove that the remote KV belongs to this prompt; pass the kv_transfer_params "
                "that the prefill node returned, unchanged"
            )
    if not 0 < parsed.remote_port < 65536:
        raise InvalidRequestError(f"kv_transfer_params.remote_port={parsed.remote_port} is not a port")
    if len(parsed.remote_block_ids) > MAX_REMOTE_BLOCKS:
        raise InvalidRequestError(
            f"kv_transfer_params.remote_block_ids holds {len(parsed.remote_block_ids)} ids, more than {MAX_REMOTE_BLOCKS}"
        )
    if any(not 0 <= b <= MAX_BLOCK_ID for b in parsed.remote_block_ids):
        raise InvalidRequestError(f"kv_transfer_params.remote_block_ids holds an id outside [0, {MAX_BLOCK_ID}]")
    if len(parsed.remote_address_mac) > MAX_MAC_CHARS or not 0 <= parsed.remote_address_expires_at < 1e12:
        raise InvalidRequestError("kv_transfer_params.remote_address_mac or remote_address_expires_at is malformed")
    if parsed.remote_block_size < 0 or not 0 <= parsed.lease_s < 1e9 or parsed.remote_num_tokens < 0:
        raise InvalidRequestError(
            "kv_transfer_params.remote_block_size, remote_num_tokens and lease_s must be non-negative"
        )
    return parsed
