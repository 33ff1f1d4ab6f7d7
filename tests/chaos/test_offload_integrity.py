"""The offload tiers of a served node verify what they load: a block whose bytes changed since it
was stored — a bit flipped in host memory, a disk file that rotted — is never served as KV.

Real `kvbridge serve` processes with the OffloadingConnector and its fault hooks
(KVBRIDGE_FAULT_FLIP_HOST_BIT, KVBRIDGE_FAULT_CORRUPT_DISK_FILE). A prompt is computed, the GPU
prefix cache is reset, and the same prompt comes back from the tier: the answer must be the
colocated engine's tokens, the corrupted blocks recomputed, and the node's /metrics must count them.
A node without the fault serves the same prompt from the tier (the control: the check refuses only
what differs).
"""

from __future__ import annotations

import json

import pytest
from chaos_harness import NodeSet, assert_correct, complete, metric, prompt, references, request

pytestmark = [pytest.mark.slow]

HOST, DISK = prompt("offload-host-flip", 180), prompt("offload-disk-flip", 180)
METRIC = "kvbridge_engine_connector_worker_{}_digest_mismatches"


def _offload(extra: dict) -> list[str]:
    return ["--kv-connector", "OffloadingConnector", "--kv-connector-extra", json.dumps({"host_num_blocks": 64, **extra})]


def _reset(url: str) -> None:
    status, body = request(url, "/v1/kvbridge/reset_prefix_cache", {})
    assert status == 200, body


def _twice(url: str, text: str, want: list[int]) -> dict:
    """The prompt computed, the prefix cache reset, the prompt again: the second answer's body."""
    status, body = complete(url, text)
    assert_correct(status, body, want, allow_error=False)
    _reset(url)
    status, body = complete(url, text)
    assert_correct(status, body, want, allow_error=False)
    return body


@pytest.fixture(scope="module")
def refs():
    return references([HOST, DISK])


def test_a_block_flipped_in_host_memory_is_recomputed_and_counted(refs):
    with NodeSet() as nodes:
        nodes.start("flipping", "both", _offload({}), env={"KVBRIDGE_FAULT_FLIP_HOST_BIT": "1"})
        nodes.start("clean", "both", _offload({}))
        nodes.wait()
        bad, good = nodes.url("flipping"), nodes.url("clean")
        assert metric(bad, METRIC.format("host")) == 0
        _twice(bad, HOST, refs[HOST])
        assert metric(bad, METRIC.format("host")) >= 1
        body = _twice(good, HOST, refs[HOST])
        assert body["kvbridge"]["num_external_tokens"] > 0  # the control: served from the host tier
        assert metric(good, METRIC.format("host")) == 0


def test_a_rotten_disk_file_is_recomputed_and_counted_after_a_restart(refs, tmp_path):
    extra = _offload({"disk_dir": str(tmp_path)})
    with NodeSet() as nodes:
        nodes.start("writer", "both", extra, env={"KVBRIDGE_FAULT_CORRUPT_DISK_FILE": "flip"})
        nodes.wait()
        status, body = complete(nodes.url("writer"), DISK)
        assert_correct(status, body, refs[DISK], allow_error=False)
        ports = nodes.ports("writer")
        nodes.procs["writer"].stop()  # a clean stop drains the write-through: every file is on disk
        assert list(tmp_path.iterdir()), "the node wrote no block file"
        nodes.start("reader", "both", extra, ports=ports)  # same directory, no fault: a warm restart
        nodes.wait("reader")
        url = nodes.url("reader")
        status, body = complete(url, DISK)
        assert_correct(status, body, refs[DISK], allow_error=False)
        assert metric(url, METRIC.format("disk")) >= 1
        _reset(url)  # the recompute stored and wrote clean blocks: now the tiers serve them
        status, body = complete(url, DISK)
        assert_correct(status, body, refs[DISK], allow_error=False)
        assert body["kvbridge"]["num_external_tokens"] > 0
