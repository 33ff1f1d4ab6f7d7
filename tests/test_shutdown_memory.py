"""Create -> generate -> shutdown, 10 times in one process, gives back every byte.

After the cycles: no engine tensor is alive (weak references), the live tensor count is back at its
baseline, gc is not left frozen, RSS is roughly flat; on CUDA, memory_allocated is back at its
baseline exactly and memory_reserved after empty_cache().
"""

from __future__ import annotations

import gc
import uuid
import weakref

import pytest
import torch
from memory_snapshot import take_snapshot

from kvbridge import LLM, SamplingParams

NUM_CYCLES = 10
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(1, 40))}, {"prompt_token_ids": list(range(50, 70))}]
MiB = 2**20


def one_cycle(device: str, num_blocks: int, with_connector: bool) -> list[weakref.ref]:
    """Build an engine, generate, shut it down; return weak references to its tensors."""
    kv_transfer = None
    if with_connector:  # the worker connector holds the KV tensor too and must let go of it
        kv_transfer = {"connector": "tests.connectors.delay_connector:DelayConnector",
                       "extra": {"store": uuid.uuid4().hex, "save": False}}
    llm = LLM(device=device, num_blocks=num_blocks, kv_transfer_config=kv_transfer)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    runner = llm.engine.runner
    refs = [weakref.ref(runner.kv_cache), weakref.ref(next(runner.model.parameters()))]
    llm.shutdown()
    del llm, runner, outputs
    return refs


def run_cycles(device: str, num_blocks: int):
    one_cycle(device, num_blocks, with_connector=False)  # warm-up: lazy torch state, imports, allocator
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    before = take_snapshot(device)
    # What the permanent generation holds without any engine: 0 on CPU; a few hundred objects that a
    # plain gc.collect() parks there on some CUDA builds (seen: Python 3.12.3, torch 2.11+cu130).
    # An engine that left gc frozen would leave every object of the process there (~10^5).
    frozen_at_rest = gc.get_freeze_count()
    refs = []
    for cycle in range(NUM_CYCLES):
        refs += one_cycle(device, num_blocks, with_connector=cycle % 2 == 1)
        assert gc.get_freeze_count() <= frozen_at_rest, f"cycle {cycle}: gc left frozen"
    gc.collect()
    after = take_snapshot(device)
    print(f"\n{device}: before={before}\n{device}: after={after}\ndiff={after.diff(before)}")
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} engine tensors still alive, e.g. shape {tuple(alive[0]().shape)}"
    assert after.num_live_tensors == before.num_live_tensors, after.diff(before)
    return before, after


@pytest.fixture(autouse=True)
def _import_path(monkeypatch):
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)  # for tests.connectors.delay_connector
    yield
    sys.modules.pop("tests.connectors.delay_connector", None)


def test_cpu_cycles_give_back_memory():
    # 1024 blocks of 32 KiB = 32 MiB of KV per engine: ten leaked caches would be 320 MiB.
    before, after = run_cycles("cpu", num_blocks=1024)
    rss_growth = after.rss_bytes - before.rss_bytes
    print(f"RSS growth over {NUM_CYCLES} cycles: {rss_growth / MiB:.1f} MiB")
    assert rss_growth < 96 * MiB


@pytest.mark.gpu
def test_cuda_cycles_give_back_memory():
    before, after = run_cycles("cuda", num_blocks=1024)
    assert after.cuda_allocated == before.cuda_allocated, after.diff(before)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == before.cuda_reserved, after.diff(before)
