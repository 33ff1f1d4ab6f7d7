"""proxy_report: the proxy's report of an answer follows the decode node's own figures, case by case."""

from __future__ import annotations

import pytest

from kvbridge.serve.proxy_report import RECOMPUTE_REASONS, kv_source, recompute_reason


@pytest.mark.parametrize(
    ("disaggregated", "prefill_answered", "kv_params", "decode", "reason", "source"),
    [
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 32}, None, "prefill_node"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 32, "kv_external_source": "peer"}, None, "prefill_node"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 32, "kv_external_source": "host_tier"}, None,
         "decode_host_tier"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 32, "kv_external_source": "disk_tier"}, None,
         "decode_disk_tier"),
        (False, False, None, {"num_external_tokens": 0}, "not_disaggregated", "computed"),
        (True, False, None, {"num_external_tokens": 0, "num_cached_tokens": 16}, "no_prefill_node", "decode_prefix_cache"),
        (True, True, None, {"num_external_tokens": 0}, "no_kv_params", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2}, "kv_load_failed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "read from engine e at tcp://127.0.0.1:1: AuthenticationError: ... wrong signature refused"}, "authentication_failed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "the prefill engine did not confirm the read: no lease matches (expired, ...)"}, "proof_failed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "read from engine e at tcp://127.0.0.1:1: no progress within its deadline (state was POSTED)"}, "timeout", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "read from engine e at tcp://127.0.0.1:1: TransferError: NIXL could not post a READ: NIXL_ERR_REMOTE_DISCONNECT"},
         "peer_unreachable", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "reply from tcp://127.0.0.1:1 refused: ...; set the same KVBRIDGE_SIDE_CHANNEL_SECRET on both nodes (a peer "
         "without our secret cannot sign its answers)"}, "authentication_failed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 2, "kv_load_error":
         "KV DIGEST MISMATCH: 1 of 2 blocks read from engine e at tcp://127.0.0.1:1 do not hold the bytes it leased"},
         "digest_mismatch", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "num_failed_load_blocks": 0, "kv_load_error":
         "it names prefill host '127.0.0.1', which the NixlConnector option allowed_peers ['10.0.0.0/8'] does not allow"},
         "peer_not_allowed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0, "kv_load_error":
         "the remote prefill's blocks are not this prompt's: they hold other tokens (block hash mismatch)"},
         "proof_failed", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": 0}, "kv_not_pulled", "computed"),
        (True, True, {"remote_block_ids": [1]}, {"num_external_tokens": True}, "kv_not_pulled", "computed"),  # not a count
    ],
)  # fmt: skip
def test_the_report_follows_the_decode_nodes_figures(disaggregated, prefill_answered, kv_params, decode, reason, source):
    got = recompute_reason(disaggregated, prefill_answered, kv_params, decode)
    assert got == reason and (got is None or got in RECOMPUTE_REASONS)
    assert kv_source(got, decode) == source
