"""MultiConnector: offload + an in-test connector that delays every free, and offload + offload."""

from __future__ import annotations

import sys
import time

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/offload")
from offload_helpers import GREEDY, make_prompts, reference_outputs, token_ids  # noqa: E402

from kvbridge import LLM  # noqa: E402
from kvbridge.config import KVTransferConfig  # noqa: E402
from kvbridge.connectors.base import (  # noqa: E402
    CompletedTransfers,
    ConnectorContext,
    FlushReport,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVHandoff,
    MatchResult,
)
from kvbridge.connectors.multi import MultiConnector  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402

SEED, NUM, LEN = 23, 6, 80
SLOW = f"{__name__}:SlowSendConnector"


class SlowSendConnector(KVConnectorBase):
    """Loads nothing; keeps every finished request's blocks for `extra["delay_s"]` (like a P/D
    producer waiting for its consumer to read), and names itself in kv_transfer_params."""

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.delay_s = config.extra.get("delay_s", 0.2)
        self._due: dict[str, float] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens) -> MatchResult:
        return MatchResult(0, False)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids) -> KVHandoff:
        return KVHandoff(True, {"slow": request.request_id, "who": self.config.extra.get("name", "slow")})

    def start_load_kv(self) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids) -> CompletedTransfers:
        now = time.monotonic()
        for req_id in finished_req_ids:
            self._due[req_id] = now + self.delay_s
        done = {r for r, due in self._due.items() if due <= now}
        for req_id in done:
            del self._due[req_id]
        return CompletedTransfers(done, set())

    def flush(self, timeout_s: float) -> FlushReport:
        deadline = time.monotonic() + timeout_s
        while self._due and max(self._due.values()) > time.monotonic() < deadline:
            time.sleep(0.005)
        late = frozenset(r for r, due in self._due.items() if due > time.monotonic())
        return FlushReport(not late, late)


def _offload(host_num_blocks: int = 64) -> dict:
    return {"connector": "OffloadingConnector", "extra": {"host_num_blocks": host_num_blocks}}


def _multi_llm(children: list[dict]) -> LLM:
    config = {"connector": "MultiConnector", "flush_timeout_s": 20.0, "extra": {"connectors": children}}
    return LLM(num_blocks=12, max_num_seqs=1, kv_transfer_config=config)


def _children(llm: LLM, side: str) -> list[KVConnectorBase]:
    connector = llm.engine.worker_connector if side == "worker" else llm.engine.scheduler_connector
    return connector.children


def test_offload_plus_a_delaying_connector_end_to_end():
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    with _multi_llm([{"connector": SLOW, "extra": {"delay_s": 0.3}}, _offload()]) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == want
        assert outputs[0].kv_transfer_params == {"slow": outputs[0].request_id, "who": "slow"}
        assert llm.engine.has_pending_transfers()  # the last request waits for the slow child
        assert llm.reset_prefix_cache() is True  # both children flushed within one deadline
        assert not llm.engine.has_pending_transfers()
        before = llm.engine.get_stats()["num_external_tokens"]
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        assert llm.engine.get_stats()["num_external_tokens"] - before >= NUM * 4 * 16  # offload served them
        llm.engine.check_integrity()
        llm.engine.scheduler_connector.check_integrity()
        llm.engine.worker_connector.check_integrity()


def test_loads_come_from_the_first_child_that_has_the_tokens():
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    with _multi_llm([_offload(), _offload()]) as llm:
        llm.generate(prompts, GREEDY)
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        first, second = (child.get_stats() for child in _children(llm, "worker"))
        llm.engine.check_integrity()
    assert first["blocks_stored"] == second["blocks_stored"] > 0  # saved to all
    assert first["blocks_loaded"] > 0 and second.get("blocks_loaded", 0) == 0


def test_loads_fall_through_to_a_later_child():
    prompts, want = make_prompts(SEED, NUM, LEN), reference_outputs(SEED, NUM, LEN)
    with _multi_llm([{"connector": SLOW, "extra": {"delay_s": 0.0}}, _offload()]) as llm:
        llm.generate(prompts, GREEDY)
        assert token_ids(llm.generate(prompts, GREEDY)) == want
        assert _children(llm, "worker")[1].get_stats()["blocks_loaded"] > 0


class _Stub(KVConnectorBase):
    """A worker half whose finished sends the test scripts."""

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.script: list[set[str]] = []
        self.flush_s = config.extra.get("flush_s", 0.0)
        self.flush_timeouts: list[float] = []

    get_num_new_matched_tokens = SlowSendConnector.get_num_new_matched_tokens
    build_connector_meta = SlowSendConnector.build_connector_meta
    start_load_kv = wait_for_save = SlowSendConnector.start_load_kv

    def request_finished(self, request, block_ids) -> KVHandoff:
        return KVHandoff(self.config.extra.get("delays", True), self.config.extra.get("params"))

    def get_finished(self, finished_req_ids) -> CompletedTransfers:
        return CompletedTransfers(self.script.pop(0) if self.script else set(), set())

    def flush(self, timeout_s: float) -> FlushReport:
        self.flush_timeouts.append(timeout_s)
        time.sleep(min(self.flush_s, timeout_s))
        return FlushReport(self.flush_s <= timeout_s, frozenset() if self.flush_s <= timeout_s else {"r"})


def _stub_multi(role: KVConnectorRole, *extras: dict) -> MultiConnector:
    children = [{"connector": f"{__name__}:_Stub", "extra": e} for e in extras]
    config = KVTransferConfig(connector="MultiConnector", extra={"connectors": children})
    return MultiConnector(config, role, ConnectorContext("tiny", 16, "cpu"))


class _Req:
    request_id = "r"


def test_request_finished_combines_delays_and_params():
    multi = _stub_multi(KVConnectorRole.SCHEDULER, {"delays": False, "params": {"a": 1, "b": 1}},
                        {"delays": True, "params": {"b": 2, "c": 2}}, {"delays": False})  # fmt: skip
    assert multi.request_finished(_Req(), [1]) == (True, {"a": 1, "b": 1, "c": 2})  # earlier child wins "b"
    meta = multi.build_connector_meta(None)
    assert meta.finish_plans == {"r": (1,)}
    none_delays = _stub_multi(KVConnectorRole.SCHEDULER, {"delays": False}, {"delays": False})
    assert none_delays.request_finished(_Req(), [1]) == (False, None)


def test_finished_sending_only_once_every_delaying_child_reported():
    scheduler = _stub_multi(KVConnectorRole.SCHEDULER, {}, {}, {"delays": False})
    worker = _stub_multi(KVConnectorRole.WORKER, {}, {}, {"delays": False})
    scheduler.request_finished(_Req(), [1])
    a, b, c = worker.children
    a.script = [{"r"}]  # child 0 reports before the plan reached the worker
    c.script = [{"r"}]  # child 2 did not delay: its report does not count
    assert worker.get_finished(set()).finished_sending == set()
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    assert worker.get_finished({"r"}).finished_sending == set()  # child 1 still sending
    b.script = [set(), {"r"}]
    assert worker.get_finished(set()).finished_sending == set()
    assert worker.get_finished(set()).finished_sending == {"r"}
    assert worker.get_finished(set()).finished_sending == set()  # reported once


def test_flush_shares_one_deadline():
    worker = _stub_multi(KVConnectorRole.WORKER, {"flush_s": 0.2}, {"flush_s": 5.0})
    result = worker.flush(0.3)
    assert not result.is_complete and result.pending_req_ids == {"r"}
    second = worker.children[1].flush_timeouts[0]
    assert second < 0.3 - 0.1  # what the first child used is gone from the second's budget


def test_config_errors():
    with pytest.raises(ConfigError, match="extra.connectors"):
        LLM(kv_transfer_config={"connector": "MultiConnector"})
    with pytest.raises(ConfigError, match="cannot contain another MultiConnector"):
        _stub_multi(KVConnectorRole.SCHEDULER, {}).__class__(
            KVTransferConfig("MultiConnector", extra={"connectors": [{"connector": "MultiConnector"}]}),
            KVConnectorRole.SCHEDULER,
            ConnectorContext("tiny", 16, "cpu"),
        )
