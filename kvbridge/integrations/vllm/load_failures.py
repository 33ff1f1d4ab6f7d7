"""Why a KV load failed, in vLLM's log.

vLLM asks a connector only which blocks failed to load (`get_block_ids_with_load_errors`) and then
applies its `kv_load_failure_policy`: `recompute` computes those blocks again, `fail` ends the
request with an error (HTTP 500 from the api_server). Neither says why. The kvbridge connector
knows (`get_load_errors`: request id -> reason), so the adapter logs it here, a line per reason
and at most one per 30 s for a reason that repeats (`repeated_log.RepeatedWarnings`): a dead peer
or a broken tier fails every request's load, and must not write a line per request.
"""

from __future__ import annotations

import logging
import re

from kvbridge.repeated_log import RepeatedWarnings

logger = logging.getLogger(__name__)

_NUMBERS = re.compile(r"\d+")


class LoadFailureLog:
    """Logs each failed load's reason, rate-limited per kind of reason. One owner thread (vLLM's worker)."""

    def __init__(self) -> None:
        self._warnings = RepeatedWarnings(logger)
        self.num_logged = 0

    def report(self, failed_block_ids: set[int], reasons: dict[str, str]) -> None:
        """Log the loads that failed this step: `reasons` from the connector, or, when it gave none for
        failed blocks, that much."""
        for req_id, reason in reasons.items():
            self._log(reason, "KVBridgeConnector: the KV load of request %s failed: %s", req_id, reason)
        if failed_block_ids and not reasons:
            self._log(
                "unexplained", "KVBridgeConnector: %d block(s) failed to load (the connector gave no reason)",
                len(failed_block_ids),
            )  # fmt: skip

    def _log(self, reason: str, fmt: str, *args: object) -> None:
        # one key per kind of reason: request ids, block counts, addresses' ports differ between requests
        key = _NUMBERS.sub("#", reason)[:200]
        fmt += "; vLLM's kv_load_failure_policy decides what follows (recompute: the blocks are computed again)"
        self.num_logged += self._warnings.warning(key, fmt, *args)
