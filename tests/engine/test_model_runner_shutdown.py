"""ModelRunner.shutdown gives back every tensor it held."""

from __future__ import annotations

import gc
import weakref

import pytest
from memory_snapshot import take_snapshot

from kvbridge.config import CacheConfig, KVTransferConfig, ModelConfig
from kvbridge.connectors.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    MatchResult,
    ScheduledRequest,
    SchedulerOutput,
)
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams


class NullConnector(KVConnectorBase):
    def __init__(self) -> None:
        super().__init__(KVTransferConfig(connector="null"), KVConnectorRole.WORKER, ConnectorContext("m", 16, "cpu"))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return MatchResult(0, False)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self):
        pass

    def wait_for_save(self):
        pass


def use(runner: ModelRunner) -> None:
    """A prefill and a seeded sampled decode (creates a per-request generator)."""
    req = Request("r", list(range(30)), SamplingParams(temperature=1.0, seed=3), 16)
    out = runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 30, [1, 0])]))
    req.append_output_token(out.sampled_token_ids["r"])
    runner.execute(SchedulerOutput([ScheduledRequest(req, 30, 1, [1, 0])]))


def test_shutdown_drops_every_tensor_and_the_connector():
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=8))
    connector = NullConnector()
    runner.attach_connector(connector)
    use(runner)
    refs = {
        "kv_cache": weakref.ref(runner.kv_cache),
        "embedding": weakref.ref(runner.model.model.embed_tokens.weight),
        "layer weight": weakref.ref(runner.model.model.layers[-1].mlp.down_proj.weight),
        "rope cos": weakref.ref(runner.model.rotary.cos),
        "connector": weakref.ref(connector),
    }
    del connector
    runner.shutdown()
    runner.shutdown()  # idempotent
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still referenced after shutdown: {alive}"
    assert runner.is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        runner.execute(SchedulerOutput())


def test_create_use_shutdown_cycles_leave_no_tensor_behind():
    def cycle() -> None:
        runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=8))
        use(runner)
        runner.shutdown()

    cycle()  # warm-up: torch creates some tensors of its own once
    before = take_snapshot()
    for _ in range(3):
        cycle()
    after = take_snapshot()
    assert after.num_live_tensors == before.num_live_tensors, after.diff(before)
