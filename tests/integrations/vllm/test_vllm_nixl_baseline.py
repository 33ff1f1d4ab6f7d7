"""vLLM's own NixlConnector on CPU, through the harness: P/D gives the colocated server's greedy tokens.

Three servers of one tiny checkpoint: a colocated one without a connector, and a prefill (kv_producer)
and a decode (kv_consumer) server with NixlConnector and a host KV buffer. Each prompt is longer than
one 128-token block; the decode server must have read every block of it over NIXL (its /metrics
count the transfer and its bytes), so a decode that silently recomputed the prompt fails the test.
This is the baseline the KVBridgeConnector tests copy, with the connector swapped in.
"""

from __future__ import annotations

import random

import pytest
from vllm_checkpoint import kv_bytes_per_token, training_text
from vllm_client import complete, pd_complete, scrape_metrics, wait_for_counter, warm_up_pd
from vllm_server import CPU_BLOCK_SIZE, nixl_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
PROMPT_LENS = (129, 300, 700)  # just past one block; a few blocks; five blocks and a partial one
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
BYTES = "vllm:nixl_bytes_transferred_sum"


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint):
    """(colocated, prefill, decode), booted together. Not pinned to cores: correctness only, on a shared machine."""
    colocated, prefill, decode = vllm_servers.start_pd(tiny_checkpoint, nixl_transfer_config, max_model_len=MAX_MODEL_LEN)
    warm_up_pd(prefill.url, decode.url, _greedy([0, *range(3, 203)]))  # the NIXL handshake, retried if slow
    return colocated, prefill, decode


def _greedy(prompt, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def _assert_pd_matches(servers, body: dict, num_prompt_tokens: int, tiny_checkpoint: str) -> None:
    colocated, prefill, decode = servers
    expected = complete(colocated.url, body)
    before = scrape_metrics(decode.url, prefixes=("vllm:nixl_",))
    out = pd_complete(prefill.url, decode.url, body)
    after = wait_for_counter(decode.url, TRANSFERS, before.get(TRANSFERS, 0) + 1, ("vllm:nixl_",))

    assert out.token_ids == expected.token_ids, (out.token_ids, expected.token_ids)
    assert len(out.token_ids) == MAX_TOKENS
    (block_ids,) = out.kv_transfer_params["remote_block_ids"]  # one KV cache group
    assert len(block_ids) == -(-num_prompt_tokens // CPU_BLOCK_SIZE), out.kv_transfer_params
    assert after.get(TRANSFERS, 0) - before.get(TRANSFERS, 0) == 1, "the decode server read no KV over NIXL"
    block_nbytes = CPU_BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint)
    assert after[BYTES] - before.get(BYTES, 0) == len(block_ids) * block_nbytes


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
def test_pd_gives_colocated_greedy_tokens(servers, tiny_checkpoint, prompt_len):
    seed = prompt_len  # a distinct prompt per case: the decode's prefix cache never serves it
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompt = [0, *(rng.randrange(3, 1024) for _ in range(prompt_len - 1))]  # BOS, then no special token
    _assert_pd_matches(servers, _greedy(prompt), prompt_len, tiny_checkpoint)


def test_text_prompt_and_streamed_decode(servers, tiny_checkpoint):
    """A text prompt (tokenized by each server) with the decode leg streamed, as benchmarks/vllm_pd.py sends it."""
    colocated = servers[0]
    text = " ".join(training_text(seed=7, num_lines=12))
    num_prompt_tokens = len(complete(colocated.url, _greedy(text, max_tokens=1)).prompt_token_ids)
    assert CPU_BLOCK_SIZE < num_prompt_tokens < MAX_MODEL_LEN - MAX_TOKENS, num_prompt_tokens
    _assert_pd_matches(servers, _greedy(text, stream=True), num_prompt_tokens, tiny_checkpoint)
