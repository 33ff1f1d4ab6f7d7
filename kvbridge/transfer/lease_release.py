"""Release a prefill engine's lease from outside any engine: what a P/D proxy does when the decode
leg fails, so the prefill frees the blocks at once instead of holding them until the lease expires.

Only the holder of the kv_transfer_params can do this: the release names the lease by its token,
block ids and block hash under the prefill's incarnation, like a decode node's (the NixlConnector's
leases: docs/pd-disaggregation.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.kv_transfer_params import parse_remote_prefill
from kvbridge.transfer import messages as m
from kvbridge.transfer.auth import audience_of
from kvbridge.transfer.side_channel import SideChannelClient

logger = logging.getLogger(__name__)

RETRY_PENDING_S = 0.05  # a lease is granted at the prefill's next engine step


def release_remote_kv(
    kv_transfer_params: dict[str, Any], *, secret: bytes | None, timeout_s: float = 2.0, engine_id: str = "proxy"
) -> bool:
    """Tell the prefill engine named in `kv_transfer_params` (as it returned them) to free the blocks.

    Blocking, up to about `timeout_s`. True when the prefill released the lease (an abandon that
    comes before the lease's grant is answered "pending", remembered, and ends the lease at the
    grant; the retry then hears "released"), False when it no longer held it (expired, released,
    restarted) or could not be reached; never raises for those.
    Raises InvalidRequestError for params that name no lease.
    """
    params = parse_remote_prefill({**kv_transfer_params, "do_remote_prefill": True})
    if not params.remote_block_ids:
        return True  # nothing was held
    address = params.side_channel_address
    lease = m.LeaseRef.of(params)
    msg = m.TransferDone(engine_id=engine_id, incarnation=params.remote_incarnation, failed_leases=[lease])
    audience = audience_of(params.remote_engine_id, params.remote_incarnation)
    deadline = time.monotonic() + timeout_s
    client = SideChannelClient(address, secret, timeout_s=timeout_s, retries=0)
    try:
        while True:
            try:
                reply = client.request(msg, timeout_s=max(0.05, deadline - time.monotonic()), audience=audience)
            except KVBridgeError as e:
                logger.warning("releasing the lease of %s at %s failed: %s", params.remote_request_id, address, e)
                return False
            if not isinstance(reply, m.TransferDoneReply):
                return False
            if params.remote_request_id not in reply.pending or time.monotonic() + RETRY_PENDING_S > deadline:
                return params.remote_request_id in reply.released
            time.sleep(RETRY_PENDING_S)
    finally:
        client.close()

