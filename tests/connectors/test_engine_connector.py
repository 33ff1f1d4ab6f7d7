"""The engine drives a connector: async and sync loads, delayed free, load errors, flush on reset and
shutdown, and the connector registry. Uses `DelayConnector` (transfers finish on threads)."""

from __future__ import annotations

import itertools
import random
import time
import uuid
from types import SimpleNamespace

import pytest
from delay_connector import SHUTDOWNS, STORES, DelayConnector

from kvbridge import LLM, SamplingParams
from kvbridge.block_hash import hash_full_blocks
from kvbridge.config import KVTransferConfig
from kvbridge.connectors import factory
from kvbridge.connectors.base import ConnectorContext, KVConnectorRole
from kvbridge.engine.request import RequestStatus
from kvbridge.errors import (
    ConfigError,
    ConnectorNotFoundError,
    EngineStalledError,
    FlushTimeoutError,
    InvalidRequestError,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(7).randrange(256) for _ in range(52)]  # 3 full blocks of 16 + 4 tokens
_ids = itertools.count()


def make_llm(flush_timeout_s: float = 5.0, **extra) -> LLM:
    extra.setdefault("store", uuid.uuid4().hex)
    config = KVTransferConfig(connector="delay_connector:DelayConnector", flush_timeout_s=flush_timeout_s, extra=extra)
    return LLM(num_blocks=32, kv_transfer_config=config)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    with LLM(num_blocks=32) as llm:
        return llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids


def run(llm: LLM, prompt=PROMPT, params=GREEDY, max_steps=5000):
    """Drive the engine by hand; return (final output, statuses seen after each step)."""
    request_id = f"t{next(_ids)}"
    llm.engine.add_request(request_id, list(prompt), params)
    request = llm.engine.scheduler.requests[request_id]
    seen, final = [], None
    for _ in range(max_steps):
        for out in llm.engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        seen.append(request.status)
        llm.engine.check_integrity()
        if final is not None:
            return final, seen
        if llm.engine.is_idle:
            time.sleep(0.001)
    raise AssertionError("request did not finish")


def test_async_load_parks_request_and_output_matches(expected):
    with make_llm(delay_s=0.05) as llm:
        first, _ = run(llm)  # computes the prompt; its 3 full blocks are saved to the store
        assert first.outputs[0].token_ids == expected and first.kv_transfer_params == {"saved_blocks": 3}
        assert llm.reset_prefix_cache()  # waits for the save; local cache now empty
        computed_before = llm.get_stats()["num_computed_tokens"]
        second, seen = run(llm)
        assert RequestStatus.WAITING_FOR_REMOTE_KVS in seen
        assert second.num_external_tokens == 48 and second.num_cached_tokens == 0
        assert second.outputs[0].token_ids == expected
        assert llm.get_stats()["num_computed_tokens"] - computed_before == 52 - 48 + 7  # 4 prompt + 7 decodes
        # The loaded blocks were registered: a third run hits them locally.
        third, _ = run(llm)
        assert third.num_cached_tokens == 48 and third.outputs[0].token_ids == expected


def test_sync_load_counts_as_computed_in_the_same_step(expected):
    with make_llm(load_async=False, delay_s=0.0) as llm:
        run(llm)
        llm.reset_prefix_cache()
        second, seen = run(llm)
        assert RequestStatus.WAITING_FOR_REMOTE_KVS not in seen
        assert second.num_external_tokens == 48 and second.outputs[0].token_ids == expected
        assert llm.get_stats()["num_external_tokens"] == 48


def test_full_prompt_from_outside_recomputes_the_last_token(expected):
    prompt = PROMPT[:48]  # exactly three blocks
    with LLM(num_blocks=32) as ref:
        want = ref.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    with make_llm(full_prompt=True) as llm:
        run(llm, prompt)
        llm.reset_prefix_cache()
        before = llm.get_stats()["num_computed_tokens"]
        out, _ = run(llm, prompt)
        assert out.num_external_tokens == 48 and out.outputs[0].token_ids == want
        assert llm.get_stats()["num_computed_tokens"] - before == 1 + 7


def test_delayed_free_holds_blocks_until_finished_sending():
    with make_llm(delay_s=0.3) as llm:
        out, _ = run(llm)
        assert out.kv_transfer_params == {"saved_blocks": 3}
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_used_blocks == 4 and llm.engine.has_pending_transfers()  # held for the save
        deadline = time.monotonic() + 5
        while llm.engine.has_pending_transfers() and time.monotonic() < deadline:
            llm.engine.step()
            llm.engine.check_integrity()
            time.sleep(0.01)
        assert pool.num_used_blocks == 0 and not llm.engine.has_pending_transfers()
        assert len(STORES[llm.config.kv_transfer.extra["store"]]) == 3


def test_load_error_recompute_gives_the_right_output(expected):
    with make_llm(fail_loads=1) as llm:
        run(llm)
        llm.reset_prefix_cache()
        out, _ = run(llm)  # the first loaded block is NaN garbage: rolled back to token 0, recomputed
        assert out.outputs[0].token_ids == expected and out.error is None
        stats = llm.get_stats()
        assert stats["num_failed_load_blocks"] == 1 and stats["num_load_recomputes"] == 1
        assert out.num_external_tokens == 0


def test_load_error_fail_policy_finishes_with_the_cause():
    store = uuid.uuid4().hex
    with make_llm(store=store) as llm:
        run(llm)
    config = KVTransferConfig(connector="delay_connector:DelayConnector", load_failure_policy="fail",
                              extra={"store": store, "fail_loads": 1})
    with LLM(num_blocks=32, kv_transfer_config=config) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "failed to load KV" in out.error and "load_failure_policy" in out.error
        assert llm.get_stats()["num_load_failures"] == 1
        while llm.engine.has_pending_transfers():
            llm.engine.step()
        assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
        llm.engine.check_integrity()


def test_reset_waits_for_in_flight_transfers():
    with make_llm(delay_s=0.3) as llm:
        run(llm)
        assert llm.engine.has_pending_transfers()
        start = time.monotonic()
        assert llm.reset_prefix_cache() is True
        assert time.monotonic() - start > 0.1  # it waited for the save
        assert not llm.engine.has_pending_transfers()
        assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
        assert llm.engine.scheduler.kv.pool.num_cached_blocks == 0
        llm.engine.check_integrity()


def test_reset_times_out_naming_the_requests():
    with make_llm(never_finish=True, flush_timeout_s=0.3) as llm:
        out, _ = run(llm)
        with pytest.raises(FlushTimeoutError, match=out.request_id) as info:
            llm.engine.reset_prefix_cache(timeout_s=0.2)
        assert info.value.pending_req_ids == {out.request_id}


def test_try_reset_never_waits_and_resets_once_the_transfers_it_waits_on_ended():
    with make_llm(delay_s=1.0) as llm:
        first, _ = run(llm)
        pool = llm.engine.scheduler.kv.pool
        assert llm.engine.try_reset_prefix_cache() == {first.request_id}  # its save is running: no wait, no reset
        assert pool.num_cached_blocks > 0
        deadline = time.monotonic() + 30  # a hang detector
        while (pending := llm.engine.try_reset_prefix_cache(frozenset({first.request_id}))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending == frozenset() and pool.num_cached_blocks == 0
        later, _ = run(llm, prompt=[(t + 1) % 256 for t in PROMPT])  # cached, its save now running
        assert pool.num_cached_blocks > 0
        # Asked while `first` was in flight: a transfer that started since does not delay the reset.
        assert llm.engine.try_reset_prefix_cache(frozenset({first.request_id})) == frozenset()
        assert later.request_id in llm.engine.scheduler.pending_transfer_req_ids() and pool.num_cached_blocks == 0
        llm.engine.check_integrity()


def test_shutdown_flushes_then_shuts_both_halves_down():
    llm = make_llm(delay_s=0.2)
    run(llm)
    worker, scheduler_side = llm.engine.worker_connector, llm.engine.scheduler_connector
    store = STORES[llm.config.kv_transfer.extra["store"]]
    assert len(store) == 0  # the save is still in flight
    llm.shutdown()
    assert worker.num_flushes == 1 and len(store) == 3
    assert worker.num_shutdowns == 1 and scheduler_side.num_shutdowns == 1
    assert worker._kv is None
    llm.shutdown()
    assert worker.num_shutdowns == 1


def test_engine_integrity_check_covers_both_connector_halves(monkeypatch):
    with make_llm() as llm:
        checked = []
        for half in (llm.engine.scheduler_connector, llm.engine.worker_connector):
            monkeypatch.setattr(half, "check_integrity", lambda role=half.role: checked.append(role))
        llm.engine.check_integrity()
        assert checked == [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]


def test_shutdown_with_transfers_that_never_finish_is_bounded():
    config = KVTransferConfig(connector="delay_connector:DelayConnector", flush_timeout_s=0.2,
                              extra={"store": uuid.uuid4().hex, "never_finish": True})
    llm = LLM(num_blocks=32, kv_transfer_config=config)
    run(llm)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 20  # flush_timeout_s=0.2: bounded, not a hang (generous for a loaded machine)


def test_abort_while_loading_holds_blocks_until_the_load_ends():
    with make_llm(delay_s=0.3) as llm:
        run(llm)
        llm.reset_prefix_cache()
        llm.engine.add_request("victim", list(PROMPT), GREEDY)
        llm.engine.step()
        assert llm.engine.scheduler.requests["victim"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        llm.engine.abort_request("victim")
        [out] = llm.engine.step()
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert llm.engine.scheduler.kv.pool.num_used_blocks == 3  # the load still writes into them
        llm.reset_prefix_cache()  # flush: the load ends
        assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
        llm.engine.check_integrity()


def test_generate_sleeps_instead_of_spinning_while_loads_are_in_flight(expected):
    with make_llm(delay_s=0.3) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
        llm.reset_prefix_cache()
        steps_before = llm.get_stats()["num_steps"]
        start = time.monotonic()
        out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
        waited = time.monotonic() - start
        assert out.num_external_tokens == 48 and out.outputs[0].token_ids == expected
        idle_steps = llm.get_stats()["num_steps"] - steps_before - 8
        # At ~1 ms per idle step the 0.3 s load takes at most ~300 steps; a spinning loop takes 10x more.
        assert waited >= 0.3 and idle_steps <= waited * 1000 + 10, (idle_steps, waited)


def test_generate_raises_when_nothing_progresses():
    store = uuid.uuid4().hex
    for block_hash in hash_full_blocks(PROMPT, 16, namespace="tiny:seed=0"):
        STORES.setdefault(store, {})[block_hash] = None  # offered, but the load never finishes
    with make_llm(store=store, never_finish=True, save=False, flush_timeout_s=0.2) as llm:
        llm.stall_timeout_s = 0.3
        with pytest.raises(EngineStalledError, match="no progress"):
            llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
        assert not llm.engine.scheduler.requests  # aborted
        llm.engine.check_integrity()


def test_request_id_stays_busy_while_its_blocks_are_held():
    with make_llm(delay_s=0.3) as llm:
        out, _ = run(llm)
        with pytest.raises(InvalidRequestError, match="in flight"):
            llm.engine.add_request(out.request_id, [1, 2, 3], GREEDY)
        llm.reset_prefix_cache()
        llm.engine.add_request(out.request_id, [1, 2, 3], GREEDY)  # free again


def test_a_failing_connector_half_releases_what_was_built():
    store = uuid.uuid4().hex
    with pytest.raises(ConfigError, match="fail_scheduler_init"):
        make_llm(store=store, fail_scheduler_init=True)
    assert (store, KVConnectorRole.WORKER) in SHUTDOWNS


# ---------------------------------------------------------------------- registry


def test_unknown_connector_lists_the_available_ones():
    with pytest.raises(ConnectorNotFoundError) as info:
        factory.resolve_connector_class("Nope")
    assert "NixlConnector" in str(info.value) and "OffloadingConnector" in str(info.value)


def test_module_class_path_and_entry_point(monkeypatch):
    assert factory.resolve_connector_class("delay_connector:DelayConnector") is DelayConnector
    plugin = SimpleNamespace(name="Delayed", value="delay_connector:DelayConnector")
    monkeypatch.setattr(factory, "entry_points", lambda group: [plugin] if group == factory.ENTRY_POINT_GROUP else [])
    assert "Delayed" in factory.available_connectors()
    context = ConnectorContext(model_id="m", block_size=16, device="cpu")
    connector = factory.create_connector(KVTransferConfig(connector="Delayed"), KVConnectorRole.WORKER, context)
    assert isinstance(connector, DelayConnector) and connector.role is KVConnectorRole.WORKER


# ---------------------------------------------------------------------- the documented example


def test_minimal_connector_in_the_docs_works(monkeypatch, expected):
    import pathlib
    import re
    import sys
    import types

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "connector-api.md").read_text()
    section = doc[doc.index("## A minimal connector"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("doc_example_connector")
    monkeypatch.setitem(sys.modules, "doc_example_connector", module)
    exec(compile(code, "docs/connector-api.md", "exec"), module.__dict__)
    with LLM(num_blocks=32, kv_transfer_config={"connector": "doc_example_connector:HostStoreConnector"}) as llm:
        first = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
        assert first.kv_transfer_params == {"saved_blocks": 3}
        assert llm.get_stats()["num_used_blocks"] == 4  # held until the save ran
        assert llm.reset_prefix_cache() and len(module.STORE) == 3
        second = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
        assert second.num_external_tokens == 48 and second.outputs[0].token_ids == expected
        assert llm.reset_prefix_cache() and llm.get_stats()["num_used_blocks"] == 0
        llm.engine.check_integrity()
