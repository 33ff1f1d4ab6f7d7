"""A load that landed unconfirmed (`landed_recving`): its first step runs early, and what it yields is
held back until the load is confirmed (`finished_recving`), dropped when it is not. Torch-free."""

from __future__ import annotations

import pytest
from sched_fakes import FakeRunner, expected_output, make_request, make_scheduler, next_token
from test_scheduler_connector import ScriptedConnector, step

from kvbridge.connectors.base import KVConnectorOutput, MatchResult
from kvbridge.engine.outputs import ModelRunnerOutput
from kvbridge.engine.request import RequestStatus

BS = 4
PROMPT = list(range(10, 21))  # 11 tokens: two full blocks loaded, 3 tokens computed here


class KVReadingRunner(FakeRunner):
    """Samples from what the blocks hold, not from the request's tokens: a token computed on wrong KV
    is a wrong token (the FakeRunner would refuse to run on it)."""

    def execute(self, out, kv_output=None):
        self.steps.append(out)
        sampled = {}
        for s in out.scheduled:
            req, end = s.request, s.start + s.num_new_tokens
            for t in range(s.start, end):
                self.write(s.block_ids, t, req.all_token_ids[t])
            if end == req.num_tokens:
                seen = [slot[0] if slot else -1 for slot in (self.slot(s.block_ids, t) for t in range(end))]
                sampled[req.request_id] = next_token(seen)
        return ModelRunnerOutput(sampled, kv_output or KVConnectorOutput())


def parked(runner_cls=FakeRunner, **sched_kw):
    """A scheduler with request "a" parked on an async load of its first 8 tokens, whose bytes landed."""
    sched, runner = make_scheduler(connector=ScriptedConnector([MatchResult(8, True)]), **sched_kw), runner_cls(32, BS)
    sched.add_request(make_request("a", PROMPT, max_tokens=3))
    step(sched, runner)
    return sched, runner, sched.requests["a"]


def land(sched, runner, request, tokens=PROMPT):
    for t in range(8):  # the read's bytes
        runner.write(sched.kv.block_ids(request.request_id), t, tokens[t])
    return step(sched, runner, KVConnectorOutput(landed_recving={request.request_id}))


def loaded_blocks_cached(sched) -> int:
    return sum(sched.kv.pool.block_hash(b) is not None for b in sched.kv.block_ids("a")[:2])


def test_the_early_token_is_held_until_the_load_is_confirmed():
    sched, runner, request = parked()
    _, updates = land(sched, runner, request)
    assert updates == [] and "a" in sched.unconfirmed
    out, updates = step(sched, runner)  # the early step
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("a", 8, 3)]
    for _ in range(3):  # the confirmation takes its time: nothing comes out, nothing is scheduled again
        assert updates == [] and request.output_token_ids == [] and loaded_blocks_cached(sched) == 0
        out, updates = step(sched, runner)
        assert not out.scheduled
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _, updates = step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    assert [u.request.request_id for u in updates] == ["a"]  # the held token, in the confirming step
    assert request.output_token_ids == expected_output(PROMPT, 1) and request.status == RequestStatus.RUNNING
    assert loaded_blocks_cached(sched) == 2
    out, _ = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(11, 1)]  # decoding goes on
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert request.output_token_ids == expected_output(PROMPT, 3)
    stats = sched.get_stats()
    assert stats["num_early_steps"] == stats["num_early_steps_used"] == 1
    assert stats["num_early_steps_discarded"] == 0 and sched.kv.pool.num_used_blocks == 0


def test_a_confirmation_during_the_early_step_gives_the_token_in_that_step():
    sched, runner, request = parked()
    land(sched, runner, request)
    out, updates = step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    assert out.scheduled and [u.request.output_token_ids for u in updates] == [expected_output(PROMPT, 1)]


@pytest.mark.parametrize("when", ["with the early step", "after it"])
def test_a_refused_load_drops_the_early_token_and_recomputes(when):
    sched, runner, request = parked(KVReadingRunner)
    wrong = [t + 1 for t in PROMPT]  # the landed bytes are another prompt's: the early token is wrong
    land(sched, runner, request, tokens=wrong)
    refused = KVConnectorOutput(finished_recving={"a"}, invalid_block_ids=set(sched.kv.block_ids("a")[:2]))
    if when == "after it":
        _, updates = step(sched, runner)
        assert updates == []
    _, updates = step(sched, runner, refused)
    assert updates == [] and request.output_token_ids == [] and "a" not in sched.unconfirmed
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    assert loaded_blocks_cached(sched) == 0
    while sched.has_unfinished_requests():
        _, updates = step(sched, runner)
        assert all(u.request.output_token_ids == expected_output(PROMPT, u.request.num_output_tokens) for u in updates)
    assert request.output_token_ids == expected_output(PROMPT, 3)
    assert sched.get_stats()["num_early_steps_discarded"] == 1
    assert sched.get_stats()["num_early_steps_used"] == 0 and sched.kv.pool.num_used_blocks == 0


def test_a_refused_load_under_the_fail_policy_ends_the_request_without_its_token():
    sched, runner, request = parked(policy="fail")
    land(sched, runner, request)
    step(sched, runner)
    _, updates = step(sched, runner, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={sched.kv.block_ids("a")[0]}))
    [update] = updates
    assert update.request.status == RequestStatus.FINISHED_ERROR and update.request.output_token_ids == []
    assert sched.kv.pool.num_used_blocks == 0 and not sched.has_pending_transfers()


def test_an_abort_while_computing_early_holds_the_blocks_until_the_load_ends():
    sched, runner, request = parked()
    land(sched, runner, request)
    step(sched, runner)
    update = sched.abort_request("a")
    assert update.request.output_token_ids == [] and "a" not in sched.unconfirmed
    step(sched, runner)
    assert sched.kv.pool.num_used_blocks == 3  # the read's blocks and the early step's
    step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    assert sched.kv.pool.num_used_blocks == 0 and not sched.has_pending_transfers()


def test_an_early_step_that_could_not_sample_runs_again_once_confirmed():
    sched, runner, request = parked()
    land(sched, runner, request)
    out = sched.schedule()
    result = runner.execute(out)
    failed = ModelRunnerOutput({}, result.kv_connector_output, {"a": "sampling failed"})
    assert sched.update_from_output(out, failed) == [] and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.check_integrity()
    step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    out, updates = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 3)]
    assert updates[0].request.output_token_ids == expected_output(PROMPT, 1)


def test_seeded_sampling_and_a_full_batch_wait_for_the_confirmation():
    conn = ScriptedConnector({rid: [MatchResult(8, True)] for rid in ("seeded", "b", "a")})
    sched, runner = make_scheduler(connector=conn, max_num_seqs=2), FakeRunner(32, BS)
    sched.add_request(make_request("busy", list(range(40, 46)), max_tokens=50))
    for rid in ("seeded", "b", "a"):
        sched.add_request(make_request(rid, PROMPT, temperature=1.0 if rid == "seeded" else 0.0, seed=7))
    step(sched, runner)
    assert sched.transfers.num_parked == 3 and [r.request_id for r in sched.running] == ["busy"]
    for rid in ("seeded", "b", "a"):
        for t in range(8):
            runner.write(sched.kv.block_ids(rid), t, PROMPT[t])
    step(sched, runner, KVConnectorOutput(landed_recving={"seeded", "b", "a"}))
    # "seeded": a dropped sample would shift its stream; of "b" and "a", one fills max_num_seqs with "busy"
    assert len(sched.unconfirmed) == 1 and "seeded" not in sched.unconfirmed
    out, _ = step(sched, runner)
    assert len(out.scheduled) == 2
    step(sched, runner, KVConnectorOutput(finished_recving={"seeded", "b", "a"}))
    for _ in range(200):
        _, updates = step(sched, runner)
        for u in updates:
            if u.request.request_id != "seeded":
                assert u.request.output_token_ids == expected_output(u.request.prompt_token_ids, u.request.num_output_tokens)
        if not sched.has_unfinished_requests():
            break
    assert sched.get_stats()["num_early_steps_used"] == 1 and sched.kv.pool.num_used_blocks == 0
