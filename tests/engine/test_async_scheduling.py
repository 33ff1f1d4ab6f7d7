"""Asynchronous scheduling (`SchedulerConfig.async_scheduling`): the same requests, driven the same way,
stream the same outputs as with synchronous steps, one step() later. Each scenario runs both engines
and compares every output each request streamed: token ids, text, finish reason, logprobs, cached
tokens. The block pool's integrity is checked after every step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbridge.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from kvbridge.engine.core import EngineCore
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import ConfigError

PROMPTS = [list(range(40, 60)), list(range(100, 137)), [7] * 18, list(range(200, 211)), list(range(3, 30, 2))]
SAMPLINGS = {
    "greedy": dict(temperature=0.0, logprobs=2),
    "seeded": dict(temperature=1.0, top_k=50, logprobs=1),
}

Requests = dict[str, tuple[list[int], SamplingParams]]
React = Callable[[EngineCore, RequestOutput], None]


def make_engine(is_async: bool | None, num_blocks: int = 64, block_size: int = 16, device: str = "cpu", **scheduler) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(device=device),
            cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
            scheduler=SchedulerConfig(async_scheduling=is_async, **scheduler),
        )
    )


def params(sampling: str, index: int, **kw) -> SamplingParams:
    values = SAMPLINGS[sampling] | kw
    if values["temperature"] > 0:
        values.setdefault("seed", 1000 + index)
    return SamplingParams(**values)


def run(engine: EngineCore, requests: Requests, react: React | None = None, max_steps: int = 500) -> dict:
    """Add `requests`, step until none is unfinished; `react` sees every output as it comes. Returns
    every output each request streamed."""
    for request_id, (prompt, sampling_params) in requests.items():
        engine.add_request(request_id, prompt, sampling_params)
    streamed = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return dict(streamed)
        for out in engine.step():
            c = out.outputs[0]
            streamed[out.request_id].append(
                (c.token_ids, c.text, c.finish_reason, c.logprobs, out.finished, out.num_cached_tokens, out.error)
            )
            if react is not None:
                react(engine, out)
        engine.check_integrity()
    raise AssertionError("the engine did not finish")


def run_both(
    requests: Requests, react: React | None = None, setup=None, exact: bool = True, logprobs_abs: float = 1e-5,
    **engine_kw,
) -> tuple[dict, dict]:
    """`run` on a synchronous and an asynchronous engine; asserts they streamed the same. Returns both
    engines' stats.

    `exact=False` where the batches differ: a request ends by a token (EOS, a stop token), and the
    step launched before that was known computes its row too (then dropped); or a request arrives
    after outputs came, which is one step later with asynchronous scheduling. A batch of another
    shape rounds the other rows' matmuls differently on the CPU, so logprobs agree to float32
    rounding there, and tokens, texts and finish reasons exactly."""
    results, stats = [], []
    for is_async in (False, True):
        engine = make_engine(is_async, **engine_kw)
        try:
            if setup is not None:
                setup(engine)
            results.append(run(engine, requests, react))
            stats.append(engine.get_stats())
            engine.check_integrity()
        finally:
            engine.shutdown()
    sync, async_ = results
    assert sync.keys() == async_.keys()
    for request_id in sync:
        if exact:
            assert async_[request_id] == sync[request_id], request_id
        else:
            assert without_logprobs(async_[request_id]) == without_logprobs(sync[request_id]), request_id
            for got, want in zip(async_[request_id], sync[request_id]):
                assert_logprobs_close(got[3], want[3], logprobs_abs)
    assert stats[0]["num_async_steps"] == 0
    return stats[0], stats[1]


def without_logprobs(streamed: list[tuple]) -> list[tuple]:
    return [(*out[:3], *out[4:]) for out in streamed]


def assert_logprobs_close(got, want, abs_tol: float) -> None:
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
        assert g.logprob == pytest.approx(w.logprob, abs=abs_tol)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=abs_tol)


def reference(prompt: list[int], sampling_params: SamplingParams, device: str = "cpu") -> list[int]:
    engine = make_engine(False, device=device)
    try:
        return run(engine, {"ref": (prompt, sampling_params)})["ref"][-1][0]
    finally:
        engine.shutdown()


def first_new_token(tokens: list[int], at_least: int) -> tuple[int, int]:
    """(index, token) of the first token at or past `at_least` that does not occur before it."""
    return next((i, t) for i, t in enumerate(tokens) if i >= at_least and t not in tokens[:i])


def test_config_is_validated():
    with pytest.raises(ConfigError, match="async_scheduling"):
        SchedulerConfig(async_scheduling="yes")
    assert SchedulerConfig().async_scheduling is None  # on where it can run on a CUDA device


def test_by_default_it_is_off_on_the_cpu_and_asked_for_it_runs_there_too(caplog):
    engines = [make_engine(is_async=None), make_engine(is_async=True), make_engine(is_async=False)]
    try:
        assert [e.is_async for e in engines] == [False, True, False]
        assert "async_scheduling is off" not in caplog.text
    finally:
        for e in engines:
            e.shutdown()


def test_a_steady_decode_is_scheduled_ahead_every_step():
    max_tokens = 8
    sync, async_ = run_both({"a": (PROMPTS[0], SamplingParams(max_tokens=max_tokens, temperature=0.0))})
    # The prefill runs first; every later token is computed by a step launched while the one before
    # was in flight. The last token ends the request by length: no step is launched after it.
    assert async_["num_async_steps"] == max_tokens - 1
    assert async_["num_computed_tokens"] == sync["num_computed_tokens"]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_requests_ending_at_different_steps_in_one_batch(sampling):
    """max_tokens, a stop token and EOS end requests of one batch at different steps; the steps after
    each end still compute a row for a request ended by a token (it is dropped)."""
    length = params(sampling, 0, max_tokens=4, ignore_eos=True)
    stop_params = params(sampling, 1, max_tokens=20, ignore_eos=True)
    i_stop, stop_token = first_new_token(reference(PROMPTS[1], stop_params), 3)
    eos_params = params(sampling, 2, max_tokens=20)
    i_eos, eos_token = first_new_token(reference(PROMPTS[2], params(sampling, 2, max_tokens=20, ignore_eos=True)), 6)
    requests = {
        "length": (PROMPTS[0], length),
        "stop": (PROMPTS[1], params(sampling, 1, max_tokens=20, ignore_eos=True, stop_token_ids=(stop_token,))),
        "eos": (PROMPTS[2], eos_params),
        "long": (PROMPTS[3], params(sampling, 3, max_tokens=14, ignore_eos=True)),
    }

    def eos_is(engine):
        engine.scheduler.eos_token_ids = frozenset({eos_token})  # the preset's EOS is never greedy's choice

    sync, async_ = run_both(requests, setup=eos_is, exact=False)
    assert async_["num_async_steps"] > 0
    assert async_["num_finished_requests"] == 4


def test_the_outputs_end_as_each_request_asked():
    stop_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    i_stop, stop_token = first_new_token(reference(PROMPTS[1], stop_params), 3)
    engine = make_engine(True)
    try:
        requests = {
            "length": (PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0)),
            "stop": (PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_token,))),
        }
        finals = {rid: outs[-1] for rid, outs in run(engine, requests).items()}
    finally:
        engine.shutdown()
    assert len(finals["length"][0]) == 4 and finals["length"][2] == "length"
    assert len(finals["stop"][0]) == i_stop + 1 and finals["stop"][0][-1] == stop_token and finals["stop"][2] == "stop"


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_an_abort_mid_stream_drops_the_token_in_flight(sampling):
    requests = {f"r{i}": (PROMPTS[i], params(sampling, i, max_tokens=12, ignore_eos=True)) for i in range(3)}

    def abort_at_three(engine, out):
        if out.request_id == "r1" and len(out.outputs[0].token_ids) == 3 and not out.finished:
            engine.abort_request("r1")

    sync, async_ = run_both(requests, abort_at_three)
    assert async_["num_async_steps"] > 0


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_arrivals_fall_back_then_the_continuation_resumes(sampling):
    requests = {"r0": (PROMPTS[0], params(sampling, 0, max_tokens=16, ignore_eos=True))}
    at_arrival = {}

    def arrive(engine, out):
        if out.request_id == "r0" and len(out.outputs[0].token_ids) in (3, 7):
            index = len(out.outputs[0].token_ids)
            engine.add_request(f"late{index}", PROMPTS[index % 5], params(sampling, index, max_tokens=5, ignore_eos=True))
            at_arrival[index] = engine.get_stats()["num_async_steps"]

    sync, async_ = run_both(requests, arrive, exact=False)
    assert 0 < at_arrival[3] < at_arrival[7] < async_["num_async_steps"]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_batch_larger_than_max_num_seqs_queues(sampling):
    requests = {f"r{i}": (PROMPTS[i], params(sampling, i, max_tokens=6 + i, ignore_eos=True)) for i in range(5)}
    sync, async_ = run_both(requests, max_num_seqs=2)
    assert async_["num_async_steps"] > 0


def test_preemption_under_a_tiny_kv_cache():
    requests = {
        f"r{i}": (PROMPTS[i], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1))
        for i in range(4)
    }
    sync, async_ = run_both(requests, num_blocks=10)
    assert sync["num_preemptions"] > 0 and async_["num_preemptions"] == sync["num_preemptions"]
    assert async_["num_async_steps"] > 0


def test_the_dropped_row_of_a_stopped_request_is_never_served_from_the_prefix_cache():
    """A request stopped by a token whose last block is full: the step after its stop wrote that
    block's last slot. Its prompt and output, asked again, hit exactly the blocks they hit without
    asynchronous scheduling (the last block is not cached), and give the same tokens."""
    block_size = 4
    prompt = PROMPTS[0]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = reference(prompt, greedy)
    i_stop, stop_token = next(
        (i, t) for i, t in enumerate(ref) if i >= 2 and t not in ref[:i] and (len(prompt) + i + 1) % block_size == 0
    )
    requests = {"a": (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,)))}

    def ask_again(engine, out):
        if out.request_id == "a" and out.finished:
            again = out.prompt_token_ids + out.outputs[0].token_ids
            engine.add_request("again", again + [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1))

    sync, async_ = run_both(requests, ask_again, exact=False, block_size=block_size)
    assert async_["num_computed_tokens"] == sync["num_computed_tokens"] + 1  # the dropped row
    assert async_["num_prefix_hit_tokens"] == sync["num_prefix_hit_tokens"] > 0

    # ... and the same as a fresh engine, whose cache holds nothing of `a`.
    engine = make_engine(True, block_size=block_size)
    try:
        fresh = run(engine, {"again": (prompt + ref[: i_stop + 1] + [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0))})
    finally:
        engine.shutdown()
    engine = make_engine(True, block_size=block_size)
    try:
        cached = run(engine, requests, ask_again)
    finally:
        engine.shutdown()
    assert cached["again"][-1][0] == fresh["again"][-1][0]


def test_reset_prefix_cache_with_a_step_in_flight():
    requests = {f"r{i}": (PROMPTS[i], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i in range(3)}

    def reset(engine, out):
        if out.request_id == "r0" and len(out.outputs[0].token_ids) == 4:
            assert engine.reset_prefix_cache()
            engine.check_integrity()

    sync, async_ = run_both(requests, reset)
    assert async_["num_async_steps"] > 0


def test_shutdown_with_a_step_in_flight():
    engine = make_engine(True)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    stats = engine.get_stats()
    assert stats["num_async_steps"] == 3 and stats["num_generated_tokens"] == 3 and engine.has_unfinished_requests()
    engine.shutdown()
    assert engine.is_shut_down
    assert engine.get_stats()["num_generated_tokens"] == 4  # the step in flight was read, then the KV freed
    engine.check_integrity()


def test_with_a_kv_connector_every_step_runs_synchronously(monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "connectors"))  # fault_connector
    engine = EngineCore(
        EngineConfig(
            cache=CacheConfig(num_blocks=32),
            scheduler=SchedulerConfig(async_scheduling=True),
            kv_transfer=KVTransferConfig(connector="fault_connector:FaultConnector"),
        )
    )
    try:
        assert not engine.is_async and "async_scheduling is off" in caplog.text
        streamed = run(engine, {"a": (PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))})
        assert [len(out[0]) for out in streamed["a"]] == [1, 2, 3, 4] and streamed["a"][-1][2] == "length"
        assert engine.get_stats()["num_async_steps"] == 0
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_on_a_cuda_device_it_is_on_unless_turned_off():
    engines = [make_engine(is_async=None, device="cuda"), make_engine(is_async=False, device="cuda")]
    try:
        assert [e.is_async for e in engines] == [True, False]
    finally:
        for e in engines:
            e.shutdown()


@pytest.mark.gpu
def test_cuda_graph_steps_take_their_tokens_on_the_device():
    """On CUDA the decode steps replay graphs (3 requests pad to the bucket of 4, then 2 to 2): each
    step's input tokens are the step before's samples, copied into the graph's input buffer."""
    greedy = dict(temperature=0.0, ignore_eos=True, logprobs=2)
    i_stop, stop_token = first_new_token(reference(PROMPTS[1], SamplingParams(max_tokens=20, **greedy), "cuda"), 3)
    requests = {
        "length": (PROMPTS[0], SamplingParams(max_tokens=5, **greedy)),
        "stop": (PROMPTS[1], SamplingParams(max_tokens=20, stop_token_ids=(stop_token,), **greedy)),
        "seeded": (PROMPTS[2], SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, logprobs=1)),
    }
    sync, async_ = run_both(requests, exact=False, logprobs_abs=1e-3, device="cuda", num_blocks=256)
    assert async_["num_async_steps"] >= 20


def test_penalties_and_min_tokens_run_every_step_synchronously():
    """They read the request's tokens, the one in flight too: no step is scheduled ahead of them."""
    requests = {
        "penalized": (PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=1.0, logprobs=1)),
        "min_tokens": (PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, seed=3, min_tokens=4)),
        "plain": (PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0)),
    }
    sync, async_ = run_both(requests)
    assert async_["num_async_steps"] == 0
