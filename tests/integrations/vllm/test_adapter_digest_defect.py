"""A defect in a prefill's lease digests inside vLLM costs those leases' verified reads, never vLLM's engine.

On an H100 with vLLM's default model runner, the per-head digests raised out of the prefill's grant, through
vLLM's step, and vLLM's engine died (every later request a 500). Here a prefill api_server runs kvbridge's
NixlConnector with the fault hook KVBRIDGE_FAULT_DIGEST_DEFECT (its lease digests raise), beside a
verifying decode api_server: each P/D request is answered with the tokens the prefill server gives alone
(the decode refuses blocks without a digest and computes them, under `recompute`), and the prefill
server keeps serving and ends every lease.
"""

from __future__ import annotations

import pytest
from adapter_e2e import LEASES, greedy, kvbridge_metrics, kvbridge_transfer_config, random_prompt, wait_for_metrics
from vllm_client import complete, pd_complete

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 4
OPTIONS = dict(lease_s=60.0, handshake_timeout_s=3.0, handshake_retries=1, transfer_timeout_s=30.0)


@pytest.fixture(scope="module")
def pair(vllm_servers, tiny_checkpoint):
    prefill = vllm_servers.start(
        "defective-prefill", tiny_checkpoint, max_model_len=1024, env={"KVBRIDGE_FAULT_DIGEST_DEFECT": "1"},
        kv_transfer_config=kvbridge_transfer_config("kv_producer", "NixlConnector", **OPTIONS),
    )  # fmt: skip
    decode = vllm_servers.start(
        "verifying-decode", tiny_checkpoint, max_model_len=1024,
        kv_transfer_config=kvbridge_transfer_config("kv_consumer", "NixlConnector", **OPTIONS),
    )  # fmt: skip
    vllm_servers.wait()
    return prefill, decode


def test_pd_from_a_prefill_whose_digests_raise_is_computed_and_the_prefill_lives(pair):
    prefill, decode = pair
    for seed in (700, 701):
        prompt = random_prompt(seed=seed, num_tokens=300)
        out = pd_complete(prefill.url, decode.url, greedy(prompt, MAX_TOKENS))
        assert out.prefill.kv_transfer_params and out.prefill.kv_transfer_params["remote_block_ids"], out.prefill
        alone = complete(prefill.url, greedy(prompt, MAX_TOKENS))  # the engine that granted still answers
        assert out.decode.token_ids == alone.token_ids
    with open(prefill.log_path, errors="replace") as f:
        assert "digesting its leased blocks failed" in f.read(), prefill.log_tail()
    ended = wait_for_metrics(prefill.url, lambda m: m.get(LEASES) == 0, timeout_s=40)
    assert ended.get(LEASES) == 0, f"the prefill still holds leases: {ended}"
    assert kvbridge_metrics(decode.url)
