"""KVBridgeConnector inside GPU vLLM (0.25 on CUDA): the KV layout read from the backend, P/D and offload.

Servers of one tiny checkpoint (bf16 on the GPU), booted together on one GPU (a small
`--gpu-memory-utilization` each), with vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), which
honours the connector's `prefer_cross_layer_blocks` and allocates one cross-layer KV tensor:
* `colocated` (FLASH_ATTN, no connector): the reference tokens;
* `prefill` / `decode` (FLASH_ATTN, kvbridge's NixlConnector, kv_producer / kv_consumer): P/D through
  the two-leg protocol of vLLM's toy proxy; tokens equal colocated and the decode's /metrics count
  one transfer of exactly the prompt's full blocks per request;
* `offload-triton` (TRITON_ATTN, OffloadingConnector, kv_both, a 160-block KV cache): the host tier
  serves a prompt that other prompts evicted from vLLM's cache, with the same tokens;

vLLM's default, the V2 model runner (each layer allocated alone), is test_gpu_per_layer.py's.
"""

from __future__ import annotations

import time

import pytest
from adapter_e2e import BYTES, FAILURES, TRANSFERS, delta, greedy, kvbridge_metrics, kvbridge_transfer_config
from adapter_e2e import random_prompt, wait_for_metrics
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import complete, pd_complete

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
MAX_TOKENS = 16
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def _gpu_args(backend: str, utilization: float = 0.1) -> list[str]:
    return ["--dtype", "bfloat16", "--gpu-memory-utilization", str(utilization), "--attention-backend", backend,
            "--block-size", str(BLOCK_SIZE)]  # fmt: skip


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint):
    def start(name: str, backend: str, config: dict | None, env: dict = V1_RUNNER, extra: list[str] = []):  # noqa: B006
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config,
                                  extra_args=[*_gpu_args(backend), *extra], env=env)  # fmt: skip

    start_s = time.monotonic()
    servers = {
        "colocated": start("colocated", "FLASH_ATTN", None),
        "prefill": start("prefill", "FLASH_ATTN", kvbridge_transfer_config("kv_producer", "NixlConnector", lease_s=60)),
        "decode": start("decode", "FLASH_ATTN", kvbridge_transfer_config("kv_consumer", "NixlConnector")),
        "offload": start("offload-triton", "TRITON_ATTN",
                         kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=512),
                         extra=["--num-gpu-blocks-override", str(MAX_MODEL_LEN // BLOCK_SIZE + 32)]),
    }  # fmt: skip
    vllm_servers.wait()
    print(f"\nGPU servers ready after {time.monotonic() - start_s:.0f} s")
    return servers


def test_layout_read_from_backend_is_cross_layer_block_major(servers):
    running = servers
    for name in ("prefill", "decode", "offload"):
        log = running[name].log_tail(200000)
        assert "cross-layer; page 2NHD" in log, (name, log[-3000:])
        assert "blocks outermost" in log, (name, log[-3000:])


@pytest.mark.parametrize("num_tokens", [300, 1000, 1700])
def test_pd_tokens_equal_colocated(servers, tiny_checkpoint, num_tokens):
    running = servers
    prompt = random_prompt(seed=num_tokens, num_tokens=num_tokens)
    reference = complete(running["colocated"].url, greedy(prompt, MAX_TOKENS))
    before = kvbridge_metrics(running["decode"].url)

    out = pd_complete(running["prefill"].url, running["decode"].url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(running["decode"].url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.decode.token_ids == reference.token_ids
    assert delta(after, before, TRANSFERS) == 1, after
    full_blocks = (num_tokens - 1) // BLOCK_SIZE  # vLLM keeps the last prompt token for the decode to compute
    block_nbytes = BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint, dtype_nbytes=2)
    assert delta(after, before, BYTES) in (full_blocks * block_nbytes, (num_tokens // BLOCK_SIZE) * block_nbytes), after
    assert delta(after, before, FAILURES) == 0, after
    print(f"P/D {num_tokens} tokens: prefill leg {out.prefill.total_s * 1e3:.1f} ms, decode leg "
          f"{out.decode.total_s * 1e3:.1f} ms, colocated {reference.total_s * 1e3:.1f} ms, "
          f"{delta(after, before, BYTES) / 2**20:.2f} MiB read")  # fmt: skip


def test_offload_host_tier_serves_evicted_prompt_triton(servers):
    running = servers
    url = running["offload"].url
    prompt = random_prompt(seed=77, num_tokens=40 * BLOCK_SIZE + 5)
    first = complete(url, greedy(prompt, MAX_TOKENS))
    for i in range(4):  # 240 blocks of other prompts through a 160-block KV cache: the prompt's blocks are evicted
        complete(url, greedy(random_prompt(seed=78 + i, num_tokens=60 * BLOCK_SIZE), 2))
    before = kvbridge_metrics(url)
    second = complete(url, greedy(prompt, MAX_TOKENS))
    loaded = "kvbridge_worker_blocks_loaded"
    after = wait_for_metrics(url, lambda m: delta(m, before, loaded) > 0)
    assert second.token_ids == first.token_ids
    assert delta(after, before, loaded) == 40, after
    print(f"offload (TRITON_ATTN): recompute {first.total_s * 1e3:.1f} ms, host-tier hit {second.total_s * 1e3:.1f} ms")
