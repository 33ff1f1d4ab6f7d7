"""Fault isolation in EngineCore.step: a fault in one request's processing ends that request only, a
fault of the step as a whole ends the step's requests, and only a device fault or broken bookkeeping
ends the engine. Faults come from `FaultConnector` (tests/connectors/fault_connector.py), the
sampler and the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from dense_reference import dense_greedy

from kvbridge.config import CacheConfig, EngineConfig, KVTransferConfig
from kvbridge.engine import sampler
from kvbridge.engine.core import EngineCore
from kvbridge.engine.faults import EngineFaultError, is_engine_fault
from kvbridge.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": list(range(40, 60)), "b": list(range(100, 137)), "c": [7] * 18}
CONNECTORS_DIR = Path(__file__).resolve().parent.parent / "connectors"


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.syspath_prepend(str(CONNECTORS_DIR))  # for fault_connector
    kv = KVTransferConfig(connector="fault_connector:FaultConnector")
    engine = EngineCore(EngineConfig(cache=CacheConfig(num_blocks=32), kv_transfer=kv))
    yield engine
    engine.shutdown()


def run(engine: EngineCore, faults: dict[str, str | None], params: dict[str, SamplingParams] | None = None) -> dict:
    """Add one request per entry (`{"fault": where}` when set) and step until all finished, checking
    the engine's integrity after every step. Returns each request's final output."""
    for rid, where in faults.items():
        engine.add_request(rid, PROMPTS[rid], (params or {}).get(rid, GREEDY), {"fault": where} if where else None)
    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.check_integrity()
    assert set(finals) == set(faults)
    assert engine.scheduler.kv.pool.num_used_blocks == 0  # the failed requests' blocks were freed too
    return finals


def assert_correct(engine: EngineCore, out) -> None:
    assert out.error is None and out.outputs[0].finish_reason == "length", out
    assert out.outputs[0].token_ids == dense_greedy(engine.runner.model, PROMPTS[out.request_id], 6)


def assert_failed(out, *words: str) -> None:
    assert out.outputs[0].finish_reason == "error" and out.error, out
    assert out.request_id in out.error and all(w in out.error for w in words), out.error


@pytest.mark.parametrize(
    "where, hook",
    [("match", "get_num_new_matched_tokens"), ("alloc", "update_state_after_alloc"), ("finished", "request_finished")],
)
def test_a_connector_hook_that_raises_for_one_request_ends_only_that_request(engine, where, hook):
    finals = run(engine, {"a": None, "b": where, "c": None})
    assert_failed(finals["b"], hook, "RuntimeError")
    assert_correct(engine, finals["a"])
    assert_correct(engine, finals["c"])
    assert_correct(engine, run(engine, {"b": None})["b"])  # the engine serves on


def test_a_step_that_raises_ends_the_requests_it_worked_on_and_the_engine_serves_on(engine):
    finals = run(engine, {"a": None, "b": "load"})  # both are scheduled in the first step
    for out in finals.values():
        assert_failed(out, "the engine step failed", "start_load_kv")
    assert_correct(engine, run(engine, {"c": None})["c"])


def test_a_device_fault_ends_the_engine(engine):
    engine.add_request("a", PROMPTS["a"], GREEDY, {"fault": "device"})
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()


@pytest.mark.parametrize("where, raised", [("load", EngineFaultError), ("match", AssertionError)])
def test_broken_bookkeeping_after_a_fault_ends_the_engine(engine, monkeypatch, where, raised):
    engine.add_request("a", PROMPTS["a"], GREEDY, {"fault": where})

    def broken():
        raise AssertionError("BlockPool integrity: injected")

    monkeypatch.setattr(engine.scheduler.kv, "check_integrity", broken)
    with pytest.raises(raised, match="injected"):
        engine.step()


def test_a_row_whose_sampling_raises_ends_only_its_request(engine, monkeypatch):
    sample_row = sampler.sample_row

    def failing_for_seed_13(logits, params, generator):
        if params.seed == 13:
            raise ValueError("injected sampling failure")
        return sample_row(logits, params, generator)

    monkeypatch.setattr(sampler, "sample_row", failing_for_seed_13)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=13, ignore_eos=True)
    finals = run(engine, {"a": None, "b": None}, params={"b": sampled})
    assert_failed(finals["b"], "sampling", "injected sampling failure")
    assert_correct(engine, finals["a"])


def test_a_request_whose_output_cannot_be_detokenized_ends_alone(engine, monkeypatch):
    make_stream = engine.tokenizer.stream
    fail_next = [True]

    def stream_failing_once():  # the first output to reach 3 tokens cannot be decoded
        stream = make_stream()
        add = stream.add

        def add_failing_once(token_ids):
            if fail_next and stream.num_tokens + len(token_ids) == 3:
                fail_next.clear()
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            add(token_ids)

        stream.add = add_failing_once
        return stream

    monkeypatch.setattr(engine.tokenizer, "stream", stream_failing_once)
    finals = run(engine, {"a": None, "b": None})
    failed = [out for out in finals.values() if out.error]
    assert len(failed) == 1 and "detokenizing" in failed[0].error, finals
    (ok,) = [out for out in finals.values() if not out.error]
    assert_correct(engine, ok)


@pytest.mark.parametrize(
    "exc, is_fault",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"), True),
        (type("AcceleratorError", (RuntimeError,), {})("whatever"), True),
        (EngineFaultError("bookkeeping"), True),
        (KeyboardInterrupt(), True),
        (RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"), False),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (ValueError("CUDA error in a message that is not a RuntimeError"), False),
        (IndexError("index out of range in self"), False),
    ],
)
def test_is_engine_fault(exc, is_fault):
    assert is_engine_fault(exc) is is_fault
