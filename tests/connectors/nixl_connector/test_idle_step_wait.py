"""The NixlConnector option idle_step_wait_s, attacked end to end: a prefill engine in another OS process,
real NIXL over UCX on loopback, the decode engine in this process.

An engine that polls its connectors (vLLM sleeps ~1 ms after a step that runs no model, then runs another)
says so per step (`SchedulerOutput.runs_model`). In such an empty step the decode waits for a read in
flight to end, up to idle_step_wait_s, so that its request computes in the very next step. The decode
engine here is the reference engine made to say what vLLM's steps say (its own idle waits are woken by
its connectors, so it never says it).
"""

from __future__ import annotations

import pytest
from prefill_node import BLOCK_SIZE, PrefillNode, engine_kwargs, prefill_node
from test_pd import GREEDY, colocated, decode_engine, same_length_prompts

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def node():
    with prefill_node(**engine_kwargs("prefill-idle-wait", "kv_producer")) as n:
        yield n


def prompts_of(seed: int, count: int = 3) -> list[dict]:
    return same_length_prompts(seed, 4 * BLOCK_SIZE + 3, count)


def says_whether_each_step_runs_model(engine, monkeypatch) -> list[bool]:
    """Make `engine` declare every step as vLLM's adapter does; the declarations, in order."""
    declared: list[bool] = []
    build = engine.scheduler.build_connector_meta

    def build_declaring(output):
        output.runs_model = not output.is_empty
        declared.append(output.runs_model)
        return build(output)

    monkeypatch.setattr(engine.scheduler, "build_connector_meta", build_declaring)
    return declared


def worker_stats(dec) -> dict:
    return dec.get_stats()["connector"]["worker"]


@pytest.mark.parametrize("granted", [True, False], ids=["verified-by-grant", "confirmed-by-the-prefill"])
def test_a_read_ends_in_the_empty_step_that_posted_it(node: PrefillNode, reference, monkeypatch, granted: bool):
    """Every request computes in the step right after its admission: one empty step each, never a poll
    more. Without a grant the wait spans the side-channel round trip that confirms the read."""
    prompts = prompts_of(seed=41)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    if not granted:
        params = [{k: v for k, v in p.items() if k != "remote_grant"} for p in params]
    # a generous bound: on a loaded machine the read may take long, and the test is about the step it ends in
    with decode_engine("decode-idle-wait", extra={"idle_step_wait_s": 1.0}) as dec:
        declared = says_whether_each_step_runs_model(dec.engine, monkeypatch)
        for prompt, p, tokens in zip(prompts, params, want):
            declared.clear()
            out = dec.generate([prompt], GREEDY, kv_transfer_params=[p])[0]
            assert out.outputs[0].token_ids == tokens
            assert out.num_external_tokens == 4 * BLOCK_SIZE
            assert declared[:2] == [False, True], declared  # admission (the read posted and ended), then compute
        worker = worker_stats(dec)
        # the first read (its handshake with the prefill first) waited; a later one may end before any wait
        assert 1 <= worker["num_idle_step_waits_ended"] <= len(prompts), worker
        assert worker["num_idle_step_waits_timed_out"] == 0, worker
        assert worker["num_granted_reads"] == (len(prompts) if granted else 0), worker
    node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


def test_the_wait_is_bounded_and_loses_nothing(node: PrefillNode, reference, monkeypatch):
    """A confirmation that takes 1 s (fault injection) against a bound of 50 ms: every empty step's wait
    ends at the bound, the read is seen by a later step, and the tokens are right."""
    prompts = prompts_of(seed=43, count=2)
    want = colocated(reference, prompts)
    params = [{k: v for k, v in p.items() if k != "remote_grant"} for p in node.prefill(prompts)]
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "1")
    with decode_engine("decode-idle-bound", extra={"idle_step_wait_s": 0.05}) as dec:
        says_whether_each_step_runs_model(dec.engine, monkeypatch)
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_external_tokens == 4 * BLOCK_SIZE for o in outs)
        worker = worker_stats(dec)
        waits = worker["num_idle_step_waits_timed_out"]
        assert waits >= 1 and worker["num_load_errors"] == 0, worker
        # each wait ended at its bound (plus one look at the reads): none waited for the confirmation itself
        assert worker["idle_step_wait_ms_total"] <= waits * (50 + 40), worker
    node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


def test_steps_that_run_a_model_or_say_nothing_never_wait(node: PrefillNode, reference):
    """The reference engine says nothing of its steps (runs_model None): it never waits in them."""
    prompts = prompts_of(seed=47, count=2)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    with decode_engine("decode-no-wait", extra={"idle_step_wait_s": 1.0}) as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        worker = worker_stats(dec)
        assert worker["num_idle_step_waits_ended"] == worker["num_idle_step_waits_timed_out"] == 0, worker
    node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
