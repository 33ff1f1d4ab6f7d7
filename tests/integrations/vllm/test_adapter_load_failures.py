"""Every KV load that fails inside vLLM says why in vLLM's log, once per kind of reason per 30 s.

vLLM asks a connector only which blocks failed; the adapter logs the kvbridge connector's reason
(integrations/vllm/load_failures.py). A vLLM api_server runs kvbridge's OffloadingConnector with its
fault hook that flips a bit of each host-tier slot after the store (a flaky DIMM): the prompt's load
back from the host tier fails its digest check, the `recompute` policy computes it again (same
greedy tokens), and the server's log names the reason.
"""

from __future__ import annotations

import pytest
from adapter_e2e import greedy, kvbridge_metrics, kvbridge_transfer_config, random_prompt, reset_prefix_cache, wait_for_metrics
from vllm_client import complete
from vllm_server import CPU_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 6
PROMPT_LEN = 2 * CPU_BLOCK_SIZE + 9
REASON = "differ from the digest taken when they were stored"


def _sum_of(metrics: dict[str, float], leaf: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("kvbridge_worker_") and k.endswith(f"_{leaf}"))


@pytest.fixture(scope="module")
def rotting(vllm_servers, tiny_checkpoint):
    server = vllm_servers.start(
        "rotting-host-tier", tiny_checkpoint, max_model_len=512,
        env={"VLLM_SERVER_DEV_MODE": "1", "KVBRIDGE_FAULT_FLIP_HOST_BIT": "1"},
        kv_transfer_config=kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=32),
    )  # fmt: skip
    vllm_servers.wait()
    return server


def test_a_failed_load_is_recomputed_and_its_reason_is_logged_once_per_kind(rotting):
    prompts = [random_prompt(seed=300 + i, num_tokens=PROMPT_LEN) for i in range(2)]
    firsts = [complete(rotting.url, greedy(p, MAX_TOKENS)) for p in prompts]
    wait_for_metrics(rotting.url, lambda m: _sum_of(m, "blocks_stored") >= 4)
    reset_prefix_cache(rotting.url)
    seconds = [complete(rotting.url, greedy(p, MAX_TOKENS)) for p in prompts]
    assert [s.token_ids for s in seconds] == [f.token_ids for f in firsts]  # recomputed, not served rotten
    wait_for_metrics(rotting.url, lambda m: _sum_of(m, "blocks_loaded") >= 2)
    with open(rotting.log_path, errors="replace") as f:
        lines = [line for line in f if "KVBridgeConnector: the KV load of request" in line]
    assert lines, f"no load failure was explained in the log; its tail:\n{rotting.log_tail()}"
    assert REASON in lines[0], lines
    assert len(lines) == 1, f"a repeated reason was logged once per request: {lines}"
    assert kvbridge_metrics(rotting.url)  # the server still serves its metrics
