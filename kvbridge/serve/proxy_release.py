"""The proxy's releases of prefill leases whose decode leg failed.

A prefill node holds a prompt's blocks for the decode node until that node reads them or the lease
expires (`lease_s`, 30 s by default). When the decode leg fails for any reason (a 4xx or 5xx, an
unreachable or silent node, a client that hung up), nobody will read them, so the proxy tells the
prefill node over its side channel to free them at once (`release_remote_kv`). Otherwise a burst of
such failures fills the prefill node's cache for a whole lease. A request sent at once
(serve/proxy_dispatch.py) also releases the params of a prefill whose offer the decode node could
not take.

A release is best-effort and off the request's path: the client gets its answer at once; the
release (a blocking ZMQ round trip) runs on a small thread pool, and a failure is only logged, as
the lease still expires. A release that races a decode read that is still going on is safe: the
decode node's own confirmation then answers "unknown" and it recomputes instead of using the blocks.

Called on the event loop thread: `release_soon` from handlers, `drain` at the proxy's cleanup.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbridge.transfer.lease_release import release_remote_kv

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0  # per release; the lease expires anyway if the prefill node cannot be reached
MAX_RELEASE_THREADS = 4


def _release(kv_transfer_params: dict[str, Any], secret: bytes | None) -> bool:
    """Runs on a pool thread: True when the prefill node freed the blocks; never raises."""
    try:
        return release_remote_kv(kv_transfer_params, secret=secret, timeout_s=RELEASE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - best-effort: the lease expires anyway
        logger.warning("releasing a prefill lease failed: %s: %s", type(exc).__name__, exc)
        return False


class LeaseReleaser:
    """Sends releases for the proxy, counts them, and lets the last ones finish at shutdown."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._pool = ThreadPoolExecutor(MAX_RELEASE_THREADS, thread_name_prefix="kvbridge-proxy-release")
        self._in_flight: set[asyncio.Future] = set()
        self.num_released = 0
        self.num_failed = 0

    def release_soon(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Free the blocks the prefill node holds under these params (as it returned them), in the background."""
        if not isinstance(kv_transfer_params, dict) or not kv_transfer_params.get("remote_block_ids"):
            return  # a prefill node without a connector, or one that holds nothing
        future = asyncio.get_running_loop().run_in_executor(self._pool, _release, kv_transfer_params, self._secret)
        self._in_flight.add(future)
        future.add_done_callback(lambda f, rid=kv_transfer_params.get("remote_request_id"): self._done(f, rid))

    def _done(self, future: asyncio.Future, remote_request_id: Any) -> None:
        self._in_flight.discard(future)
        if not future.cancelled() and future.result():
            self.num_released += 1
            return
        self.num_failed += 1
        # Not a warning: the usual cause is a healthy prefill node whose lease already ended (the decode
        # node read the blocks before its stream broke, and released them). An unreachable prefill
        # node is warned about by release_remote_kv itself.
        logger.info(
            "the prefill node holds no lease of %s any more (already read and released, or expired), or could not "
            "be reached", remote_request_id,
        )  # fmt: skip

    async def drain(self, timeout_s: float = RELEASE_TIMEOUT_S + 1.0) -> None:
        """Let the releases in flight finish (bounded), then stop the pool."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
