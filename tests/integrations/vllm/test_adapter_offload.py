"""kvbridge's OffloadingConnector inside a vLLM api_server (KVBridgeConnector, kv_both): the host tier
serves a prompt that vLLM's own prefix cache no longer holds, with the same greedy tokens.

Two servers of one tiny checkpoint, booted once for the module:
* `offload`: OffloadingConnector alone; vLLM's prefix cache is emptied with its reset endpoint
  (POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1);
* `multi`: a MultiConnector of NixlConnector and OffloadingConnector with a KV cache of 16 blocks
  (--num-gpu-blocks-override); the prompt is evicted from it by other prompts.
Either way the prompt's full blocks must come back from kvbridge's host tier: the worker's
`blocks_loaded` gauge grows by exactly that many blocks. A server that recomputed the prompt, or
that still had it in vLLM's cache, fails the test.
* `disk`: the OffloadingConnector with a disk tier under a host tier of one prompt's blocks; two other
  prompts evict the first from the host tier, and after a reset it comes back from disk.
"""

from __future__ import annotations

import time

import pytest
from adapter_e2e import greedy, kvbridge_metrics, kvbridge_transfer_config, random_prompt, reset_prefix_cache, wait_for_metrics
from vllm_client import complete
from vllm_server import CPU_BLOCK_SIZE


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
NUM_FULL_BLOCKS = 3
PROMPT_LEN = NUM_FULL_BLOCKS * CPU_BLOCK_SIZE + 17
HOST_NUM_BLOCKS = 64
MULTI_KV_BLOCKS = 16  # vLLM's whole KV cache on `multi` (block 0 is vLLM's null block)
DISK_HOST_BLOCKS = NUM_FULL_BLOCKS + 1  # `disk`'s host tier: one prompt's blocks, not two


def _sum_of(metrics: dict[str, float], side: str, leaf: str) -> float:
    """A statistic of the offload connector whether it runs alone or as a MultiConnector's child
    (kvbridge_worker_blocks_loaded, kvbridge_worker_1_<child>_blocks_loaded)."""
    return sum(v for k, v in metrics.items() if k.startswith(f"kvbridge_{side}_") and k.endswith(f"_{leaf}"))


def _loaded(metrics: dict[str, float]) -> float:
    return _sum_of(metrics, "worker", "blocks_loaded")


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint, tmp_path_factory):
    offload = vllm_servers.start(
        "offload", tiny_checkpoint, max_model_len=MAX_MODEL_LEN, env={"VLLM_SERVER_DEV_MODE": "1"},
        kv_transfer_config=kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=HOST_NUM_BLOCKS),
    )  # fmt: skip
    children = [
        {"connector": "NixlConnector"},
        {"connector": "OffloadingConnector", "extra": {"host_num_blocks": HOST_NUM_BLOCKS}},
    ]
    multi = vllm_servers.start(
        "multi", tiny_checkpoint, max_model_len=MAX_MODEL_LEN,
        extra_args=["--num-gpu-blocks-override", str(MULTI_KV_BLOCKS)],
        kv_transfer_config=kvbridge_transfer_config("kv_both", "MultiConnector", connectors=children),
    )  # fmt: skip
    disk = vllm_servers.start(
        "disk", tiny_checkpoint, max_model_len=MAX_MODEL_LEN, env={"VLLM_SERVER_DEV_MODE": "1"},
        kv_transfer_config=kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=DISK_HOST_BLOCKS,
                                                    disk_dir=str(tmp_path_factory.mktemp("kv-disk"))),
    )  # fmt: skip
    start = time.monotonic()
    vllm_servers.wait()
    print(f"\nservers ready after {time.monotonic() - start:.0f} s more")
    return offload, multi, disk


def test_host_tier_serves_prompt_after_prefix_cache_reset(servers):
    offload, _, _ = servers
    prompt = random_prompt(seed=100, num_tokens=PROMPT_LEN)
    first = complete(offload.url, greedy(prompt, MAX_TOKENS))
    stored = wait_for_metrics(offload.url, lambda m: _sum_of(m, "worker", "blocks_stored") >= NUM_FULL_BLOCKS)
    assert _sum_of(stored, "worker", "blocks_stored") == NUM_FULL_BLOCKS, stored
    attempts = reset_prefix_cache(offload.url)
    before = kvbridge_metrics(offload.url)

    second = complete(offload.url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(offload.url, lambda m: _loaded(m) > _loaded(before))

    assert second.token_ids == first.token_ids
    assert _loaded(after) - _loaded(before) == NUM_FULL_BLOCKS, "the prompt was not loaded from the host tier"
    assert _sum_of(after, "scheduler", "hit_blocks") - _sum_of(before, "scheduler", "hit_blocks") == NUM_FULL_BLOCKS
    print(f"offload: reset took {attempts} attempt(s); second request {second.total_s * 1e3:.0f} ms "
          f"(first {first.total_s * 1e3:.0f} ms)")  # fmt: skip


def test_host_tier_serves_prompt_evicted_from_a_small_kv_cache_multiconnector(servers):
    _, multi, _ = servers
    prompt = random_prompt(seed=200, num_tokens=PROMPT_LEN)
    first = complete(multi.url, greedy(prompt, MAX_TOKENS))
    # Other prompts that need every block of vLLM's cache between them: the first prompt's are evicted.
    fillers = [random_prompt(seed=201 + i, num_tokens=4 * CPU_BLOCK_SIZE + 40) for i in range(4)]
    for filler in fillers:
        complete(multi.url, greedy(filler, MAX_TOKENS))
    before = kvbridge_metrics(multi.url)

    second = complete(multi.url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(multi.url, lambda m: _loaded(m) > _loaded(before))

    assert second.token_ids == first.token_ids
    assert _loaded(after) - _loaded(before) == NUM_FULL_BLOCKS, "the evicted prompt was not loaded from the host tier"
    assert _sum_of(after, "worker", "load_failures") == 0, after


def check_disk_tier_serves_an_evicted_prompt(url: str, prompt_len: int, num_full_blocks: int, max_tokens: int) -> None:
    """On a server whose host tier holds one prompt's blocks and a disk tier: a prompt that two later
    prompts evicted from the host tier comes back from disk, once vLLM's prefix cache is reset, with
    the same tokens (also test_gpu_offload_seeds.py's)."""
    prompt = random_prompt(seed=400, num_tokens=prompt_len)
    first = complete(url, greedy(prompt, max_tokens))
    for i, seed in enumerate((401, 402), start=2):
        complete(url, greedy(random_prompt(seed=seed, num_tokens=prompt_len), max_tokens))
        wait_for_metrics(url, lambda m, n=i: _sum_of(m, "worker", "blocks_stored") >= n * num_full_blocks)
    reset_prefix_cache(url)
    before = kvbridge_metrics(url)

    second = complete(url, greedy(prompt, max_tokens))
    after = wait_for_metrics(url, lambda m: _loaded(m) > _loaded(before))

    assert second.token_ids == first.token_ids
    assert _loaded(after) - _loaded(before) == num_full_blocks, "the prompt was not loaded from kvbridge's tiers"
    disk_hits = _sum_of(after, "scheduler", "disk_hit_blocks") - _sum_of(before, "scheduler", "disk_hit_blocks")
    assert disk_hits == num_full_blocks, f"the host tier evicted the prompt, yet {disk_hits} blocks came from disk: {after}"
    assert _sum_of(after, "worker", "load_failures") == 0, after


def test_disk_tier_serves_a_prompt_the_host_tier_evicted(servers):
    _, _, disk = servers
    check_disk_tier_serves_an_evicted_prompt(disk.url, PROMPT_LEN, NUM_FULL_BLOCKS, MAX_TOKENS)
