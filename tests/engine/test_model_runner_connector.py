"""How ModelRunner.execute drives the worker side of a connector."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_greedy

from kvbridge.config import CacheConfig, KVTransferConfig, ModelConfig
from kvbridge.connectors.base import (
    CompletedTransfers,
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

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


class RecordingConnector(KVConnectorBase):
    """Logs every worker-side call; optionally copies blocks from another cache, layer by layer."""

    def __init__(self, source: torch.Tensor | None = None, copy_blocks: dict[int, int] | None = None) -> None:
        super().__init__(
            KVTransferConfig(connector="recording"), KVConnectorRole.WORKER, ConnectorContext("tiny:seed=0", 16, "cpu")
        )
        self.events: list[tuple] = []
        self.source = source
        self.copy_blocks = copy_blocks or {}  # destination block id -> source block id
        self.kv_cache: torch.Tensor | None = None
        self.finished = CompletedTransfers({"sent"}, {"received"})
        self.saved_layers: list[torch.Tensor] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return MatchResult(0, False)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def register_kv_caches(self, kv_cache, layout):
        self.events.append(("register", tuple(kv_cache.shape), layout.num_blocks))
        self.kv_cache = kv_cache

    def bind_connector_metadata(self, metadata):
        self.events.append(("bind",))
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self):
        self.events.append(("clear",))
        super().clear_connector_metadata()

    def start_load_kv(self):
        self.events.append(("start_load",))

    def wait_for_layer_load(self, layer):
        self.events.append(("wait_layer", layer))
        for dst, src in self.copy_blocks.items():
            self.kv_cache[dst, layer] = self.source[src, layer]

    def save_kv_layer(self, layer):
        self.events.append(("save_layer", layer))
        self.saved_layers.append(self.kv_cache[:, :, 0].abs().sum(dim=(0, 2, 3, 4)).clone())  # [num_layers]

    def wait_for_save(self):
        self.events.append(("wait_save",))

    def get_finished(self, finished_req_ids):
        self.events.append(("get_finished", frozenset(finished_req_ids)))
        return self.finished

    def get_block_ids_with_load_errors(self):
        self.events.append(("load_errors",))
        return {3}

    def get_step_stats(self):
        return {"bytes": 7}

    def get_stats(self):  # on demand only: the runner must not compute it every step
        raise AssertionError("get_stats() called on the step path")


def make_runner() -> ModelRunner:
    return ModelRunner(ModelConfig(), CacheConfig(num_blocks=16))


def test_step_calls_the_connector_in_order():
    runner = make_runner()
    conn = RecordingConnector()
    runner.attach_connector(conn)
    assert conn.events == [("register", runner.layout.shape, 16)]
    assert conn.kv_cache is runner.kv_cache
    req = Request("a", list(range(20)), GREEDY, 16)
    out = runner.execute(
        SchedulerOutput([ScheduledRequest(req, 0, 20, [4, 9])], {"gone"}, kv_connector_metadata=KVConnectorMetadata())
    )
    layers = runner.layout.num_layers
    per_layer = [e for i in range(layers) for e in (("wait_layer", i), ("save_layer", i))]
    assert conn.events[1:] == [
        ("bind",), ("start_load",), *per_layer, ("wait_save",),
        ("get_finished", frozenset({"gone"})), ("load_errors",), ("clear",),
    ]  # fmt: skip
    assert set(out.sampled_token_ids) == {"a"}
    kv_out = out.kv_connector_output
    assert (kv_out.finished_sending, kv_out.finished_recving, kv_out.invalid_block_ids) == ({"sent"}, {"received"}, {3})
    assert kv_out.stats == {"bytes": 7}
    # save_kv_layer(i) runs after layer i wrote its K and before layer i + 1 did.
    for i, written in enumerate(conn.saved_layers):
        assert (written[: i + 1] > 0).all() and (written[i + 1 :] == 0).all()


def test_empty_step_still_polls_the_connector():
    runner = make_runner()
    conn = RecordingConnector()
    runner.attach_connector(conn)
    out = runner.execute(SchedulerOutput(finished_req_ids={"x"}))
    assert conn.events[1:] == [
        ("start_load",), ("wait_save",), ("get_finished", frozenset({"x"})), ("load_errors",), ("clear",),
    ]  # fmt: skip
    assert out.sampled_token_ids == {}
    assert out.kv_connector_output.finished_recving == {"received"}


def test_failed_forward_still_clears_metadata():
    runner = make_runner()
    conn = RecordingConnector()
    runner.attach_connector(conn)
    req = Request("a", list(range(20)), GREEDY, 16)
    with pytest.raises(ValueError):
        runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 20, [4])], kv_connector_metadata=KVConnectorMetadata()))
    assert conn.events[-1] == ("clear",)
    assert conn.get_connector_metadata() is None


def test_kv_loaded_layer_by_layer_continues_like_a_local_prefill():
    """Engine A computes a prompt; engine B receives A's first two blocks through the connector's
    wait_for_layer_load and computes only the rest. B's greedy output equals the dense forward."""
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    producer = make_runner()
    req_a = Request("a", prompt, GREEDY, 16)
    producer.execute(SchedulerOutput([ScheduledRequest(req_a, 0, 40, [11, 2, 5])]))
    consumer = make_runner()
    consumer.attach_connector(RecordingConnector(source=producer.kv_cache, copy_blocks={6: 11, 0: 2}))
    req_b = Request("b", prompt, GREEDY, 16)
    blocks = [6, 0, 13]
    start, num_new = 32, 8
    for _ in range(6):
        sampled = consumer.execute(SchedulerOutput([ScheduledRequest(req_b, start, num_new, blocks)]))
        req_b.append_output_token(sampled.sampled_token_ids["b"])
        start, num_new = req_b.num_tokens - 1, 1
    assert req_b.output_token_ids == dense_greedy(consumer.model, prompt, 6)
