"""KVBridgeConnector inside GPU vLLM 0.25 with vLLM's defaults: its V2 model runner, which allocates
each layer's KV cache alone. No VLLM_USE_V2_MODEL_RUNNER in any server's environment.

Per attention backend (FLASH_ATTN, TRITON_ATTN, FLASHINFER), servers of one tiny bf16 checkpoint, all
nine started at once on one GPU (each backend's test waits for its own three):
* `prefill-B` / `decode-B` (kvbridge's NixlConnector, kv_producer / kv_consumer): P/D through the two-leg
  protocol of vLLM's toy proxy. The colocated reference is the prefill server answering the whole
  request itself (the connector idle for it: no kv_transfer_params), so both run the same kernels;
  the decode's /metrics count one transfer of the prompt's full blocks per request, and the
  descriptors of each read (`last_read_descriptors`): one per run of blocks per layer;
* `offload-B` (OffloadingConnector, kv_both, a 160-block KV cache): the host tier serves a prompt that
  other prompts evicted from vLLM's cache, with the tokens the first (computed) answer had;
Every server logs the layout it read: one allocation per layer, `2NHD` pages (the NHD layout the
connector asks for; on an H200 no backend would choose HND, whose per-layer `2HND` pages
test_backend_layout.py reads from recorded allocations).

Run on a GPU machine with vLLM 0.25 on PYTHONPATH (docs/vllm.md, "Measured"):

    python3 -m pytest -v -s -m "gpu and vllm" tests/integrations/vllm/test_gpu_per_layer.py
"""

from __future__ import annotations

import os
import time

import pytest
from adapter_e2e import BYTES, FAILURES, TRANSFERS, delta, greedy, kvbridge_metrics, kvbridge_transfer_config
from adapter_e2e import random_prompt, wait_for_metrics
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import complete, pd_complete
from vllm_server import wait_ready

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
MAX_TOKENS = 16
NUM_LAYERS = 4  # conftest.TINY_MODEL
DESCRIPTORS = "kvbridge_worker_last_read_descriptors"
OFFLOAD_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE + 32  # 160: four 60-block prompts evict a 40-block one


def _args(backend: str, num_blocks: int) -> list[str]:
    # 9 servers share the GPU: a small share each, and a fixed KV cache so that memory profiling of
    # servers booting side by side cannot squeeze one out
    return ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.07", "--attention-backend", backend,
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(num_blocks)]  # fmt: skip


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint):
    """Every backend's three servers, started at once and not waited for: each backend's test waits for
    its own, so FLASH_ATTN's and TRITON_ATTN's results come while FlashInfer may still be compiling."""

    def start(name: str, backend: str, config: dict, num_blocks: int):
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config,
                                  extra_args=_args(backend, num_blocks))  # fmt: skip

    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ, "this test runs vLLM's default model runner: unset it"
    running = {"started_at": time.monotonic()}
    for backend in BACKENDS:
        running[backend] = {
            "prefill": start(f"prefill-{backend}", backend,
                             kvbridge_transfer_config("kv_producer", "NixlConnector", lease_s=60), 512),
            "decode": start(f"decode-{backend}", backend, kvbridge_transfer_config("kv_consumer", "NixlConnector"), 512),
            "offload": start(f"offload-{backend}", backend,
                             kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=512), OFFLOAD_BLOCKS),
        }  # fmt: skip
    return running


@pytest.mark.parametrize("backend", BACKENDS)  # in this order: FlashInfer compiles its kernels on first use
def test_default_runner_per_layer_pd_and_offload(servers, tiny_checkpoint, backend):
    group = servers[backend]
    wait_ready(list(group.values()), timeout_s=540)
    print(f"\n{backend}: servers ready {time.monotonic() - servers['started_at']:.0f} s after the first started")
    for name, server in group.items():  # the layout each read from vLLM's tensors
        log = server.log_tail(400000)
        assert f"{backend}, one allocation per layer; page 2NHD" in log, (name, log[-3000:])
        assert "one region per layer" in log, (name, log[-3000:])
    for num_tokens in (300, 1000):
        _check_pd(group["prefill"], group["decode"], tiny_checkpoint, backend, num_tokens)
    _check_offload(group["offload"], backend)


def _check_pd(prefill, decode, tiny_checkpoint, backend: str, num_tokens: int) -> None:
    prompt = random_prompt(seed=num_tokens, num_tokens=num_tokens)
    reference = complete(prefill.url, greedy(prompt, MAX_TOKENS))  # colocated: the prefill server alone
    before = kvbridge_metrics(decode.url)

    out = pd_complete(prefill.url, decode.url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)

    assert out.decode.token_ids == reference.token_ids, (backend, num_tokens)
    assert delta(after, before, TRANSFERS) == 1 and delta(after, before, FAILURES) == 0, after
    full_blocks = (num_tokens - 1) // BLOCK_SIZE  # vLLM keeps the last prompt token for the decode to compute
    block_nbytes = BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint, dtype_nbytes=2)
    assert delta(after, before, BYTES) in (full_blocks * block_nbytes, (num_tokens // BLOCK_SIZE) * block_nbytes), after
    descriptors = after[DESCRIPTORS]
    # one per run of blocks adjacent on both sides, per layer: never one per block per layer
    assert descriptors % NUM_LAYERS == 0 and NUM_LAYERS <= descriptors < full_blocks * NUM_LAYERS, after
    print(f"P/D {backend} {num_tokens} tokens: {full_blocks} blocks x {NUM_LAYERS} layers read with {descriptors:.0f} "
          f"descriptors; prefill leg {out.prefill.total_s * 1e3:.1f} ms, decode leg {out.decode.total_s * 1e3:.1f} ms, "
          f"colocated {reference.total_s * 1e3:.1f} ms")  # fmt: skip


def _check_offload(server, backend: str) -> None:
    url = server.url
    prompt = random_prompt(seed=77, num_tokens=40 * BLOCK_SIZE + 5)
    first = complete(url, greedy(prompt, MAX_TOKENS))
    for i in range(4):  # 240 blocks of other prompts through a 160-block KV cache: the prompt's blocks are evicted
        complete(url, greedy(random_prompt(seed=78 + i, num_tokens=60 * BLOCK_SIZE), 2))
    before = kvbridge_metrics(url)
    second = complete(url, greedy(prompt, MAX_TOKENS))
    loaded = "kvbridge_worker_blocks_loaded"
    after = wait_for_metrics(url, lambda m: delta(m, before, loaded) > 0)
    assert second.token_ids == first.token_ids, backend
    assert delta(after, before, loaded) == 40, after
    print(f"offload {backend}: recompute {first.total_s * 1e3:.1f} ms, host-tier hit {second.total_s * 1e3:.1f} ms")
