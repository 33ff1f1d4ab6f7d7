"""What the proxy says about an answer: where the decode node's KV for the prompt came from, and why
it computed the prompt itself when it did. Read from the decode node's own figures in its answer's
`kvbridge` object (`num_external_tokens`, `num_failed_load_blocks`, `num_cached_tokens`), never
inferred from what the proxy asked of it. Pure functions; the proxy adds them to `kvbridge.proxy`.
"""

from __future__ import annotations

from typing import Any


# Why a decode node computed the prompt itself instead of pulling it from a prefill node.
RECOMPUTE_REASONS = {
    "not_disaggregated": "the request has several prompts or choices (n > 1): the proxy sent it to the decode node only",
    "no_prefill_node": "no prefill node answered (none healthy, or every one tried failed)",
    "prefill_busy": "the prefill node refused the request for now (HTTP 429: its leases are at their quota), "
    "and no other prefill node answered",
    "no_kv_params": "the prefill node answered without kv_transfer_params (it runs no P/D connector)",
    "authentication_failed": "the decode node's pull was refused: the two nodes' KVBRIDGE_SIDE_CHANNEL_SECRET differ",
    "peer_not_allowed": "the decode node's allowed_peers does not allow the prefill node's host",
    "peer_unreachable": "the decode node could not reach the prefill node's side channel",
    "timeout": "the decode node's pull made no progress within its deadline (transfer_timeout_s)",
    "proof_failed": "the prefill node did not vouch for the read (no lease matched: expired, released, restarted), "
    "or the params name blocks that are not this prompt's (block hash mismatch)",
    "digest_mismatch": "the bytes the decode node read are not the ones the prefill node leased (or it sent no digest)",
    "handoff_missed": "sent at once: no prefill offered its KV to the decode node's inbox within its handoff_wait_s",
    "handoff_misdirected": "sent at once: the prefill leg was given another decode instance's inbox (the decode node "
    "restarted since the proxy learnt it)",
    "kv_load_failed": "the decode node tried to pull the KV and failed for another reason (kv_load_error says which)",
    "kv_not_pulled": "the decode node pulled nothing and gave no reason (e.g. it runs no P/D connector)",
}


def recompute_reason(
    disaggregated: bool, prefill_answered: bool, kv_params: dict[str, Any] | None, decode_kvbridge: dict[str, Any]
) -> str | None:
    """None when the decode node's answer says it pulled the prompt's KV from the prefill node (its
    `num_external_tokens`), else the key of RECOMPUTE_REASONS that says why it did not.
    `disaggregated`: the proxy routed the request through a prefill node (one prompt, n = 1)."""
    if not disaggregated:
        return "not_disaggregated"
    if not prefill_answered:
        return "no_prefill_node"
    if not kv_params:
        return "no_kv_params"
    if _count(decode_kvbridge, "num_external_tokens") > 0:
        return None
    if _count(decode_kvbridge, "num_failed_load_blocks") == 0 and not decode_kvbridge.get("kv_load_error"):
        return "kv_not_pulled"  # nor did it say why: e.g. a decode node without a P/D connector
    return load_failure_cause(decode_kvbridge.get("kv_load_error"))


# What a failed load's message (the decode node's `kv_load_error`) names, checked in this order.
_CAUSES = (
    ("authentication_failed", ("AuthenticationError", "wrong signature", "KVBRIDGE_SIDE_CHANNEL_SECRET")),
    ("peer_not_allowed", ("allowed_peers",)),
    ("peer_unreachable", ("PeerUnreachableError", "unreachable", "did not answer", "REMOTE_DISCONNECT")),
    ("timeout", ("TransferTimeoutError", "within its deadline", "timed out")),
    ("proof_failed", ("did not confirm the read", "are not this prompt's")),
    ("digest_mismatch", ("KV DIGEST MISMATCH", "sent no digest")),
    ("handoff_missed", ("under its handoff_key within",)),
    ("handoff_misdirected", ("which is not this engine instance's",)),
)


def load_failure_cause(kv_load_error: Any) -> str:
    """The RECOMPUTE_REASONS key of a failed load, from the decode node's own message about it."""
    if isinstance(kv_load_error, str):
        for cause, words in _CAUSES:
            if any(word in kv_load_error for word in words):
                return cause
    return "kv_load_failed"


# A decode node's `kv_external_source` -> the proxy's `kv_source` (absent or "peer": pulled).
TIER_SOURCES = {"host_tier": "decode_host_tier", "disk_tier": "decode_disk_tier"}


def kv_source(reason: str | None, decode_kvbridge: dict[str, Any]) -> str:
    """Where the decode node's KV for the prompt came from: "prefill_node" (pulled), its own offload
    tier ("decode_host_tier", "decode_disk_tier", as its `kv_external_source` says), else
    "decode_prefix_cache" when its own prefix cache served part or all of the prompt (it computed
    the rest), else "computed"."""
    if reason is None:
        return TIER_SOURCES.get(decode_kvbridge.get("kv_external_source"), "prefill_node")
    return "decode_prefix_cache" if _count(decode_kvbridge, "num_cached_tokens") > 0 else "computed"


def _count(kvbridge: dict[str, Any], key: str) -> int:
    value = kvbridge.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
