"""KVBridgeConnector with vLLM's FLASHINFER backend on a GPU (0.25): the layout read at start-up and the
host tier serving an evicted prompt with the same tokens. A module of its own: FlashInfer compiles its
kernels on a machine's first use (minutes), which the other GPU tests need not wait for."""

from __future__ import annotations

import pytest
from adapter_e2e import delta, greedy, kvbridge_metrics, kvbridge_transfer_config, random_prompt, wait_for_metrics
from vllm_client import complete

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def server(vllm_servers, tiny_checkpoint):
    config = kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=512)
    args = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.1", "--attention-backend", "FLASHINFER",
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(MAX_MODEL_LEN // BLOCK_SIZE + 32)]  # fmt: skip
    started = vllm_servers.start("offload-flashinfer", tiny_checkpoint, max_model_len=MAX_MODEL_LEN,
                                 kv_transfer_config=config, extra_args=args, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})  # fmt: skip
    vllm_servers.wait(timeout_s=800)
    return started


def test_flashinfer_layout_and_host_tier(server):
    log = server.log_tail(400000)
    assert "FLASHINFER, cross-layer; page 2NHD" in log, log[-3000:]
    prompt = random_prompt(seed=91, num_tokens=40 * BLOCK_SIZE + 5)
    first = complete(server.url, greedy(prompt, 16))
    for i in range(4):  # evict the prompt from the 160-block KV cache
        complete(server.url, greedy(random_prompt(seed=92 + i, num_tokens=60 * BLOCK_SIZE), 2))
    before = kvbridge_metrics(server.url)
    second = complete(server.url, greedy(prompt, 16))
    loaded = "kvbridge_worker_blocks_loaded"
    after = wait_for_metrics(server.url, lambda m: delta(m, before, loaded) > 0)
    assert second.token_ids == first.token_ids
    assert delta(after, before, loaded) == 40, after
