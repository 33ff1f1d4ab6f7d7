"""What the adapter accepts of vLLM's parallelism, and how its scheduler half takes every TP worker's start-up metadata.

No server: `AdapterConfig.from_vllm` reads vLLM's config by attribute, and the scheduler half is
built inside a real vLLM `Scheduler` (sched_harness.py). The servers' side of TP is test_adapter_tp.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from sched_harness import BLOCK_SIZE, SchedulerHarness  # noqa: E402

from kvbridge.connectors.nixl.scheduler import SIDE_CHANNEL_PORT_STAT  # noqa: E402

from kvbridge.errors import ConfigError, PipelineParallelError, TensorParallelError  # noqa: E402
from kvbridge.integrations.vllm.config import AdapterConfig  # noqa: E402
from kvbridge.integrations.vllm.metadata import KVBridgeHandshake  # noqa: E402

pytestmark = pytest.mark.vllm

INCARNATION = "0123456789abcdef0123456789abcdef"
PORT = 5602


def vllm_config(connector: str, tp: int = 1, pp: int = 1, **options) -> SimpleNamespace:
    """What AdapterConfig.from_vllm reads of vLLM's config."""
    kv = SimpleNamespace(kv_connector_extra_config={"connector": connector, **options}, kv_role="kv_both",
                         engine_id="e-vllm", kv_load_failure_policy="recompute")  # fmt: skip
    return SimpleNamespace(
        kv_transfer_config=kv, parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(model="/nonexistent/model", revision=None), cache_config=SimpleNamespace(block_size=16),
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_nixl_connector_runs_under_tensor_parallelism(tp):
    assert AdapterConfig.from_vllm(vllm_config("NixlConnector", tp=tp)).tp_size == tp


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_parallelism_is_refused_by_name(tp):
    with pytest.raises(PipelineParallelError, match=r"pipeline_parallel_size=2.*--pipeline-parallel-size 1"):
        AdapterConfig.from_vllm(vllm_config("NixlConnector", tp=tp, pp=2))


@pytest.mark.parametrize("connector", ["OffloadingConnector", "MultiConnector"])
def test_a_connector_not_written_for_tensor_parallelism_is_refused_under_it(connector):
    options = {"host_num_blocks": 8} if connector == "OffloadingConnector" else {
        "connectors": [{"connector": "NixlConnector"}, {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 8}}]
    }  # fmt: skip
    AdapterConfig.from_vllm(vllm_config(connector, tp=1, **options))  # accepted without TP
    match = rf"tensor_parallel_size=2.*NixlConnector.*'{connector}'.*--tensor-parallel-size 1"
    with pytest.raises(TensorParallelError, match=match):
        AdapterConfig.from_vllm(vllm_config(connector, tp=2, **options))


def _tp2_harness(tiny_checkpoint) -> SchedulerHarness:
    """A kv_producer scheduler whose adapter was configured for 2 workers, before their start-up metadata."""
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_producer", connector="NixlConnector", incarnation=None)
    h.connector.setup = dataclasses.replace(h.connector.setup, tp_size=2)
    return h


def _handshakes(*incarnations: str) -> dict[tuple[int, int], KVBridgeHandshake]:
    """What EngineCore collects from each TP worker, keyed (pp_rank, tp_rank); only rank 0 serves a side channel."""
    return {(0, rank): KVBridgeHandshake(incarnation=inc, step_stats={SIDE_CHANNEL_PORT_STAT: PORT} if rank == 0 else {})
            for rank, inc in enumerate(incarnations)}  # fmt: skip


def test_the_scheduler_half_names_the_engine_by_rank_0s_metadata(tiny_checkpoint):
    h = _tp2_harness(tiny_checkpoint)
    h.connector.set_xfer_handshake_metadata_pp_aware(_handshakes(INCARNATION, INCARNATION))
    h.add_request("p0", [0, *range(3, 3 + 2 * BLOCK_SIZE + 7)], kv_transfer_params={"do_remote_decode": True})
    params = h.step().finished["p0"].kv_transfer_params
    # the lease is granted under the incarnation every worker adopted, at rank 0's side channel
    assert params["remote_incarnation"] == INCARNATION and params["remote_port"] == PORT, params
    assert params["remote_block_ids"] == h.block_ids("p0")[:2]


@pytest.mark.parametrize(
    ("handshakes", "match"),
    [
        (_handshakes(INCARNATION), r"from one kvbridge worker per tensor-parallel rank, ranks 0..1, got ranks \[0\]"),
        (_handshakes(INCARNATION, "f" * 32), "2 engine incarnations, not one"),
    ],
    ids=["a-rank-missing", "two-incarnations"],
)
def test_the_scheduler_half_refuses_metadata_that_does_not_describe_one_engine_of_every_rank(tiny_checkpoint, handshakes, match):
    h = _tp2_harness(tiny_checkpoint)
    with pytest.raises(ConfigError, match=match):
        h.connector.set_xfer_handshake_metadata_pp_aware(handshakes)
