"""Scheduler: continuous batching, chunked prefill, prefix hits, preemption, stops, abort (no torch)."""

from __future__ import annotations

import random

import pytest
from sched_fakes import EOS, FakeRunner, expected_output, make_request, make_scheduler, next_token, run_to_completion

from kvbridge.engine.request import RequestStatus


def prompt(n: int, offset: int = 0) -> list[int]:
    return [10 + (offset + i) % 80 for i in range(n)]


def test_batches_prefills_and_decodes_and_outputs_match():
    sched, runner = make_scheduler(), FakeRunner(32, 4)
    prompts = {f"r{i}": prompt(5 + 3 * i, i * 7) for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=5))
    first = sched.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["r0", "r1", "r2", "r3"]
    assert [s.num_new_tokens for s in first.scheduled] == [5, 8, 11, 14]
    sched.update_from_output(first, runner.execute(first))
    second = sched.schedule()
    assert [s.num_new_tokens for s in second.scheduled] == [1, 1, 1, 1]  # all decoding together
    sched.update_from_output(second, runner.execute(second))
    done = run_to_completion(sched, runner)
    for rid, p in prompts.items():
        assert done[rid].output_token_ids == expected_output(p, 5)
        assert done[rid].status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 32


def test_token_budget_and_max_num_seqs():
    sched, runner = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10), FakeRunner(32, 4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(4, i)))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]  # max_num_seqs
    assert out.num_scheduled_tokens == 8
    sched.update_from_output(out, runner.execute(out))
    run_to_completion(sched, runner)
    assert all(s.num_scheduled_tokens <= 10 and len(s.scheduled) <= 2 for s in runner.steps)


def test_chunked_prefill_samples_only_at_the_end():
    sched, runner = make_scheduler(max_num_batched_tokens=6), FakeRunner(32, 4)
    p = prompt(17)
    sched.add_request(make_request("long", p, max_tokens=3))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append((out.scheduled[0].start, out.scheduled[0].num_new_tokens))
        updates = sched.update_from_output(out, runner.execute(out))
        assert bool(updates) == (out.scheduled[0].start + out.scheduled[0].num_new_tokens == 17)
    assert chunks == [(0, 6), (6, 6), (12, 5)]
    done = run_to_completion(sched, runner)
    assert done["long"].output_token_ids == expected_output(p, 3)


def test_chunked_prefill_off_waits_for_a_whole_prompt():
    sched, runner = make_scheduler(max_num_batched_tokens=8, chunked=False), FakeRunner(32, 4)
    sched.add_request(make_request("a", prompt(6), max_tokens=4))
    sched.add_request(make_request("b", prompt(6, 3), max_tokens=4))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b's 6 tokens do not fit the 2 left
    sched.update_from_output(out, runner.execute(out))
    done = run_to_completion(sched, runner)
    assert done["b"].output_token_ids == expected_output(prompt(6, 3), 4)


def test_prefix_hit_at_admission_never_covers_the_whole_prompt():
    sched, runner = make_scheduler(), FakeRunner(32, 4)
    p = prompt(12)  # exactly three blocks
    sched.add_request(make_request("a", p, max_tokens=2))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", p, max_tokens=2))
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.start, s.num_new_tokens) == (8, 4)  # two blocks hit, the last block recomputed
    assert s.request.num_cached_tokens == 8
    sched.update_from_output(out, runner.execute(out))
    done = run_to_completion(sched, runner)
    assert done["b"].output_token_ids == expected_output(p, 2)
    assert sched.stats.num_prefix_hit_tokens == 8


def test_prefix_hit_shares_blocks_with_a_running_request():
    sched, runner = make_scheduler(), FakeRunner(32, 4)
    shared = prompt(8)
    sched.add_request(make_request("a", shared + [90, 91], max_tokens=6))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("b", shared + [92], max_tokens=6))
    out = sched.schedule()
    a_blocks, b_blocks = (sched.kv.block_ids(r) for r in ("a", "b"))
    assert a_blocks[:2] == b_blocks[:2] and sched.kv.pool.ref_count(a_blocks[0]) == 2
    sched.update_from_output(out, runner.execute(out))
    done = run_to_completion(sched, runner)
    assert done["b"].output_token_ids == expected_output(shared + [92], 6)


def test_prefix_caching_off_never_hits():
    sched, runner = make_scheduler(prefix_caching=False), FakeRunner(32, 4)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, prompt(12), max_tokens=2))
        run_to_completion(sched, runner)
    assert sched.stats.num_prefix_hit_tokens == 0 and sched.kv.pool.num_cached_blocks == 0


def test_preemption_by_recompute_keeps_outputs():
    # 8 blocks of 4 tokens; three requests of 7 prompt tokens growing by 10 tokens each cannot all fit.
    sched, runner = make_scheduler(num_blocks=8), FakeRunner(8, 4)
    prompts = {f"r{i}": prompt(7, 11 * i) for i in range(3)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=10))
    done = run_to_completion(sched, runner)
    assert sched.stats.num_preemptions > 0
    preempted = [rid for rid, r in done.items() if r.num_preemptions]
    assert preempted and "r0" not in preempted  # the newest running request is the victim
    for rid, p in prompts.items():
        assert done[rid].output_token_ids == expected_output(p, 10)
    victim_steps = [s for s in runner.steps if s.preempted_req_ids]
    assert victim_steps
    assert sched.kv.pool.num_free_blocks == 8


def test_preempted_request_goes_back_to_the_front_and_recomputes_its_outputs():
    sched, runner = make_scheduler(num_blocks=4), FakeRunner(4, 4)
    sched.add_request(make_request("a", prompt(6), max_tokens=8))
    sched.add_request(make_request("b", prompt(6, 5), max_tokens=8))
    sched.add_request(make_request("c", prompt(3, 9), max_tokens=1))
    while not any(s.preempted_req_ids for s in runner.steps):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        sched.check_integrity()
    victim = sched.waiting[0]
    assert victim.request_id == "b" and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens > 0
    assert not sched.kv.holds_blocks("b")
    run_to_completion(sched, runner)
    readmit = next(s for s in runner.steps if any(x.request.request_id == "b" and x.start == 0 for x in s.scheduled)
                   and s is not runner.steps[0])
    [b] = [x for x in readmit.scheduled if x.request.request_id == "b"]
    assert b.num_new_tokens > 6  # prompt plus the kept outputs


def test_stop_conditions():
    p = prompt(5)
    first = next_token(p)
    cases = [
        (dict(max_tokens=3), RequestStatus.FINISHED_LENGTH, 3),
        (dict(max_tokens=9, stop_token_ids=(first,)), RequestStatus.FINISHED_STOPPED, 1),
    ]
    for params, status, n in cases:
        sched, runner = make_scheduler(), FakeRunner(32, 4)
        sched.add_request(make_request("r", p, **params))
        done = run_to_completion(sched, runner)
        assert done["r"].status == status and done["r"].num_output_tokens == n


def test_eos_stops_unless_ignored(monkeypatch):
    import sched_fakes

    monkeypatch.setattr(sched_fakes, "next_token", lambda tokens: EOS)
    for ignore_eos, n in ((False, 1), (True, 4)):
        sched, runner = make_scheduler(), FakeRunner(32, 4)
        sched.add_request(make_request("r", prompt(5), max_tokens=4, ignore_eos=ignore_eos))
        done = run_to_completion(sched, runner)
        assert done["r"].num_output_tokens == n


def test_max_model_len_finishes_requests():
    sched, runner = make_scheduler(max_model_len=9), FakeRunner(32, 4)
    sched.add_request(make_request("r", prompt(6), max_tokens=50))
    done = run_to_completion(sched, runner)
    assert done["r"].status == RequestStatus.FINISHED_LENGTH and done["r"].num_tokens == 9
    # A request alone must fit the pool: max_model_len is capped to the blocks.
    assert make_scheduler(num_blocks=4, max_model_len=1000).max_model_len == 17


def test_abort_waiting_and_running():
    sched, runner = make_scheduler(max_num_seqs=1), FakeRunner(32, 4)
    sched.add_request(make_request("run", prompt(6), max_tokens=20))
    sched.add_request(make_request("wait", prompt(6, 1), max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.abort_request("wait").request.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("run").request.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("run") is None and sched.abort_request("nope") is None
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and not out.scheduled
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == 32
    sched.check_integrity()


@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_matches_expected_outputs(chunked, seed=None):
    seed = random.randrange(2**32) if seed is None else seed
    print(f"seed={seed}")
    rng = random.Random(seed)
    num_blocks = rng.randint(12, 40)
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=rng.randint(1, 6),
                           max_num_batched_tokens=rng.randint(4, 40), chunked=chunked)
    runner = FakeRunner(num_blocks, 4)
    shared = prompt(rng.randint(0, 12), 3)
    prompts = {f"r{i}": shared + prompt(rng.randint(1, 14), rng.randrange(80)) for i in range(12)}
    max_tokens = {rid: rng.randint(1, 12) for rid in prompts}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=max_tokens[rid]))
    done = run_to_completion(sched, runner, max_steps=2000)
    for rid, p in prompts.items():
        assert done[rid].output_token_ids == expected_output(p, max_tokens[rid]), rid
    assert sched.kv.pool.num_free_blocks == num_blocks


def test_check_integrity_catches_a_leaked_block_table():
    sched, runner = make_scheduler(), FakeRunner(32, 4)
    sched.add_request(make_request("r", prompt(6)))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    del sched.requests["r"]
    with pytest.raises(AssertionError, match="unknown request"):
        sched.check_integrity()


def test_blocks_are_cached_only_once_computed():
    # "a" is mid-way through a chunked prefill when "b" with the same prompt arrives: "b" may hit only
    # the blocks "a" already computed (FakeRunner checks every claimed token is in the blocks).
    sched, runner = make_scheduler(max_num_batched_tokens=5), FakeRunner(32, 4)
    p = prompt(16)
    sched.add_request(make_request("a", p, max_tokens=2))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))  # 5 tokens computed: one full block
    assert sched.kv.pool.num_cached_blocks == 1
    sched.add_request(make_request("b", p, max_tokens=2))
    done = run_to_completion(sched, runner)
    assert 4 <= done["b"].num_cached_tokens <= 12
    assert done["b"].output_token_ids == expected_output(p, 2)


def test_schedule_after_continues_a_decode_before_its_tokens_are_known():
    """Asynchronous scheduling: each step is scheduled before the one in flight is recorded; a request
    that the token in flight ends by length is left out; the outputs are the synchronous ones."""
    sched, runner = make_scheduler(), FakeRunner(32, 4)
    prompts = {"short": prompt(6), "long": prompt(7, 3)}
    requests = {"short": make_request("short", prompts["short"], max_tokens=3),
                "long": make_request("long", prompts["long"], max_tokens=6)}  # fmt: skip
    for request in requests.values():
        sched.add_request(request)
    in_flight = sched.schedule()
    computed = runner.execute(in_flight)  # the device runs it; the host schedules the next step meanwhile
    num_ahead = 0
    while (following := sched.schedule_after(in_flight)) is not None:
        num_ahead += 1
        for s in following.scheduled:  # the token in flight is computed at position num_tokens, its slot allocated
            assert s.num_new_tokens == 1 and s.start == s.request.num_tokens
            assert len(s.block_ids) * 4 >= s.start + 1 and s.block_ids == sched.kv.block_ids(s.request.request_id)
        sched.update_from_output(in_flight, computed)
        sched.check_integrity()
        in_flight, computed = following, runner.execute(following)
    sched.update_from_output(in_flight, computed)
    assert [s.request.request_id for s in runner.steps[-1].scheduled] == ["long"]  # "short" ended by length
    assert num_ahead == 5 and sched.stats.num_async_steps == 5
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == 32
    for rid, request in requests.items():
        assert request.output_token_ids == expected_output(prompts[rid], request.sampling_params.max_tokens)


@pytest.mark.parametrize("case", ["waiting", "penalties", "min_tokens", "chunk_left", "no_blocks", "aborted"])
def test_schedule_after_refuses_what_is_not_a_pure_continuation(case):
    num_blocks = 4 if case == "no_blocks" else 32  # prompts of 8 fill 2 blocks each: no block for token 9
    sched, runner = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=12 if case == "chunk_left" else 64), FakeRunner(32, 4)
    params = {"penalties": {"presence_penalty": 0.5}, "min_tokens": {"min_tokens": 2}}.get(case, {})
    sched.add_request(make_request("a", prompt(8), max_tokens=8, **params))
    sched.add_request(make_request("b", prompt(8, 5), max_tokens=8))
    in_flight = sched.schedule()
    computed = runner.execute(in_flight)
    if case == "waiting":
        sched.add_request(make_request("c", prompt(5, 9)))
    if case == "aborted":
        sched.abort_request("b")
    assert sched.schedule_after(in_flight) is None
    sched.update_from_output(in_flight, computed)
    sched.check_integrity()
    assert sched.stats.num_async_steps == 0
    run_to_completion(sched, runner)
