"""The scheduler's connector paths without torch: a scripted scheduler-side connector, a fake runner."""

from __future__ import annotations

import pytest
from sched_fakes import FakeRunner, expected_output, make_request, make_scheduler

from kvbridge.connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVHandoff, MatchResult
from kvbridge.engine.request import RequestStatus

BS = 4


class ScriptedConnector(KVConnectorBase):
    """Scheduler side only. `answers` scripts get_num_new_matched_tokens (a list for every request, or
    {request id: list}); every call is recorded."""

    def __init__(self, answers=(), delay_free=False) -> None:  # noqa: D107 - no config needed here
        self.answers = answers if isinstance(answers, dict) else {None: list(answers)}
        self.delay_free = delay_free
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        script = self.answers.get(request.request_id, self.answers.get(None, []))
        return script.pop(0) if script else MatchResult(0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return KVHandoff(self.delay_free, {"id": request.request_id})

    def start_load_kv(self):
        pass

    def wait_for_save(self):
        pass


def step(sched, runner, kv_output=None, fill_loads=None):
    """One step; `fill_loads` = (request, num_tokens): write that request's loaded KV first."""
    out = sched.schedule()
    out.kv_connector_metadata = sched.build_connector_meta(out)
    if fill_loads:
        request, n = fill_loads
        for t in range(n):
            runner.write(sched.kv.block_ids(request.request_id), t, request.all_token_ids[t])
    updates = sched.update_from_output(out, runner.execute(out, kv_output))
    sched.check_integrity()
    return out, updates


def finish_all(sched, runner, max_steps=200):
    done = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not sched.has_pending_transfers():
            return done
        _, updates = step(sched, runner)
        done.update({u.request.request_id: u for u in updates if u.request.is_finished})
    raise AssertionError("not finished")


def test_undecided_connector_keeps_the_request_waiting_and_is_asked_again():
    conn = ScriptedConnector({"a": [MatchResult(None, False), MatchResult(None, False)]})
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    sched.add_request(make_request("a", list(range(10, 20))))
    sched.add_request(make_request("b", list(range(30, 36))))
    out, _ = step(sched, runner)
    assert [s.request.request_id for s in out.scheduled] == ["b"]  # "a" undecided, "b" goes on
    assert sched.requests["a"].status == RequestStatus.WAITING and sched.waiting[0].request_id == "a"
    step(sched, runner)
    out, _ = step(sched, runner)
    assert [c[:2] for c in conn.calls if c[0] == "match"].count(("match", "a")) == 3
    assert any(s.request.request_id == "a" for s in out.scheduled)


def test_async_load_parks_then_resumes_with_loaded_tokens_cached():
    conn = ScriptedConnector([MatchResult(8, True)])
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    prompt = list(range(10, 21))  # 11 tokens: two full blocks external, 3 tokens to compute
    sched.add_request(make_request("a", prompt, max_tokens=3))
    out, _ = step(sched, runner)
    request = sched.requests["a"]
    assert not out.scheduled and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("alloc", "a", sched.kv.block_ids("a"), 8) in conn.calls and len(sched.kv.block_ids("a")) == 2
    assert sched.has_pending_transfers()
    step(sched, runner)  # still loading
    _, _ = step(sched, runner, KVConnectorOutput(finished_recving={"a"}), fill_loads=(request, 8))
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 8
    assert sched.kv.pool.num_cached_blocks == 2  # loaded blocks registered
    out, _ = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 3)]
    done = finish_all(sched, runner)
    assert done["a"].request.output_token_ids == expected_output(prompt, 3)
    assert sched.stats.num_external_tokens == 8


def test_async_load_of_the_whole_prompt_recomputes_the_last_token():
    conn = ScriptedConnector([MatchResult(8, True)])
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    prompt = list(range(10, 18))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    step(sched, runner)
    request = sched.requests["a"]
    step(sched, runner, KVConnectorOutput(finished_recving={"a"}), fill_loads=(request, 8))
    assert request.num_computed_tokens == 7
    out, _ = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(7, 1)]


def test_sync_load_counts_as_computed_in_the_admission_step():
    conn = ScriptedConnector([MatchResult(8, False)])
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    prompt = list(range(10, 21))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 3)]
    for t in range(8):  # the worker's sync load
        runner.write(sched.kv.block_ids("a"), t, prompt[t])
    sched.update_from_output(out, runner.execute(out))
    assert finish_all(sched, runner)["a"].request.output_token_ids == expected_output(prompt, 2)


def test_delayed_free_and_early_finished_sending():
    conn = ScriptedConnector(delay_free=True)
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    sched.add_request(make_request("a", list(range(10, 19)), max_tokens=1))
    _, updates = step(sched, runner)
    assert updates[0].request.is_finished and updates[0].kv_transfer_params == {"id": "a"}
    assert sched.kv.pool.num_used_blocks == 3 and sched.has_pending_transfers()
    step(sched, runner)
    assert sched.kv.pool.num_used_blocks == 3  # still held
    step(sched, runner, KVConnectorOutput(finished_sending={"a"}))
    assert sched.kv.pool.num_used_blocks == 0 and not sched.has_pending_transfers()
    # A send reported while the request still runs: its blocks are freed at finish, not held.
    sched.add_request(make_request("b", list(range(10, 19)), max_tokens=3))
    step(sched, runner, KVConnectorOutput(finished_sending={"b"}))
    finish_all(sched, runner)
    assert sched.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_errors(policy):
    conn = ScriptedConnector([MatchResult(8, True)])
    sched, runner = make_scheduler(connector=conn, policy=policy), FakeRunner(32, BS)
    prompt = list(range(10, 23))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    step(sched, runner)
    request = sched.requests["a"]
    bad = sched.kv.block_ids("a")[1]
    # Block 0 arrives, block 1 does not.
    _, updates = step(sched, runner, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={bad}),
                      fill_loads=(request, 4))
    assert sched.kv.pool.block_hash(bad) is None
    if policy == "recompute":
        assert request.num_computed_tokens == 4 and request.status == RequestStatus.WAITING
        assert sched.kv.pool.num_cached_blocks == 1  # only the good block
        done = finish_all(sched, runner)
        assert done["a"].request.output_token_ids == expected_output(prompt, 2)
        assert sched.stats.num_load_recomputes == 1
    else:
        [update] = updates
        assert update.request.status == RequestStatus.FINISHED_ERROR
        assert "failed to load KV" in update.request.error and "'recompute'" in update.request.error
        assert sched.kv.pool.num_used_blocks == 0 and sched.stats.num_load_failures == 1


def test_load_error_in_a_sync_load_discards_the_steps_token_and_recomputes():
    conn = ScriptedConnector([MatchResult(8, False)])
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    prompt = list(range(10, 21))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    out = sched.schedule()
    blocks = sched.kv.block_ids("a")
    for t in range(8):
        runner.write(blocks, t, prompt[t])
    runner_output = runner.execute(out, KVConnectorOutput(invalid_block_ids={blocks[0]}))
    assert sched.update_from_output(out, runner_output) == []  # the sampled token used bad KV
    request = sched.requests["a"]
    assert request.num_computed_tokens == 0 and request.num_output_tokens == 0
    runner.kv[blocks[0]] = [None] * BS  # make sure nothing relies on the bad block's content
    assert finish_all(sched, runner)["a"].request.output_token_ids == expected_output(prompt, 2)


def test_abort_while_loading_holds_blocks_until_the_load_ends():
    conn = ScriptedConnector([MatchResult(8, True)])
    sched, runner = make_scheduler(connector=conn), FakeRunner(32, BS)
    sched.add_request(make_request("a", list(range(10, 21))))
    step(sched, runner)
    update = sched.abort_request("a")
    assert update.request.status == RequestStatus.FINISHED_ABORTED and update.kv_transfer_params == {"id": "a"}
    assert sched.kv.pool.num_used_blocks == 2 and sched.has_pending_transfers()
    out, _ = step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    assert "a" in out.finished_req_ids
    assert sched.kv.pool.num_used_blocks == 0 and not sched.has_pending_transfers()
