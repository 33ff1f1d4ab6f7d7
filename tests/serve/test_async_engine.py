"""AsyncEngine: one engine thread, thread-safe add/abort/call, no busy-spin, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from serve_fakes import FakeEngineCore

from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.serve.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvbridge.transfer.progress import Wakeup

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _run(scenario, fake: FakeEngineCore | None = None, factory=None):
    fake = fake or FakeEngineCore()
    engine = AsyncEngine(factory or (lambda: fake))
    engine.start()

    async def main():
        await engine.wait_ready(10)
        return await scenario(engine, fake)

    try:
        return asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        engine.shutdown()


def test_generate_streams_cumulative_outputs_on_one_engine_thread():
    async def scenario(engine, fake):
        outs = [o async for o in engine.generate("r1", [10, 20], GREEDY)]
        return outs

    fake = FakeEngineCore()
    outs = _run(scenario, fake)
    assert [o.outputs[0].token_ids for o in outs] == [[21], [21, 22], [21, 22, 23], [21, 22, 23, 24]]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids
    assert fake.is_shut_down


def test_concurrent_requests_all_finish():
    async def scenario(engine, fake):
        async def one(i):
            return [o async for o in engine.generate(f"r{i}", [i + 1], GREEDY)][-1]

        return await asyncio.gather(*(one(i) for i in range(20)))

    finals = _run(scenario)
    assert all(f.finished and len(f.outputs[0].token_ids) == 4 for f in finals)
    assert finals[5].outputs[0].token_ids == [7, 8, 9, 10]


def test_closing_the_generator_early_aborts_the_request():
    async def scenario(engine, fake):
        gen = engine.generate("r1", [1], SamplingParams(max_tokens=10_000))
        await anext(gen)
        await gen.aclose()
        await engine.call(lambda core: None)  # the abort command ran before this one
        return fake.num_aborted, fake.has_unfinished_requests(), engine.num_running

    assert _run(scenario, FakeEngineCore(step_delay_s=0.001)) == (1, False, 0)


def test_rejected_input_raises_value_error_and_engine_lives_on():
    async def scenario(engine, fake):
        with pytest.raises(ValueError, match="vocabulary"):
            [o async for o in engine.generate("bad", [999], GREEDY)]
        return [o async for o in engine.generate("good", [1], GREEDY)][-1].finished

    assert _run(scenario) is True


def test_add_request_failing_otherwise_fails_that_request_and_the_engine_lives_on():
    class FailingAdd(FakeEngineCore):
        def add_request(self, request_id, *args, **kwargs):
            if request_id == "bad":
                raise RuntimeError("injected add_request failure")
            super().add_request(request_id, *args, **kwargs)

    async def scenario(engine, fake):
        with pytest.raises(RequestFailedError, match="bad failed in add_request: RuntimeError: injected"):
            [o async for o in engine.generate("bad", [1], GREEDY)]
        assert engine.is_ready
        return [o async for o in engine.generate("good", [1], GREEDY)][-1].finished

    assert _run(scenario, FailingAdd()) is True


def test_duplicate_running_id_is_rejected():
    async def scenario(engine, fake):
        gen = engine.generate("same", [1], SamplingParams(max_tokens=10_000))
        await anext(gen)
        with pytest.raises(ValueError, match="already running"):
            await anext(engine.generate("same", [1], GREEDY))
        await gen.aclose()

    _run(scenario, FakeEngineCore(step_delay_s=0.001))


def test_step_failure_fails_in_flight_requests_and_marks_engine_dead():
    async def scenario(engine, fake):
        gen = engine.generate("r1", [1], SamplingParams(max_tokens=10_000))
        await anext(gen)
        fake.fail_next_step = True
        with pytest.raises(EngineDeadError, match="injected"):
            async for _ in gen:
                pass
        assert not engine.is_ready and "injected" in str(engine.error)
        with pytest.raises(EngineDeadError):
            await engine.call(lambda core: 1)

    _run(scenario, FakeEngineCore(step_delay_s=0.001))


def test_startup_failure_is_reported_by_wait_ready():
    def broken():
        raise RuntimeError("no such model")

    engine = AsyncEngine(broken)
    engine.start()
    with pytest.raises(EngineDeadError, match="no such model"):
        asyncio.run(engine.wait_ready(10))
    assert not engine.is_ready
    engine.shutdown()


def test_idle_engine_does_not_step():
    async def scenario(engine, fake):
        [o async for o in engine.generate("r1", [1], GREEDY)]
        steps = fake.num_steps
        await asyncio.sleep(0.2)
        return steps, fake.num_steps

    before, after = _run(scenario)
    assert before == after


class ParkedEngine(FakeEngineCore):
    """Its requests wait (steps compute nothing) until `release()`, which rings like a connector's
    thread does when a peer's answer comes in."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeup = Wakeup()
        self.released_at: float | None = None

    @property
    def is_idle(self) -> bool:
        return self.released_at is None

    def step(self):
        return [] if self.released_at is None else super().step()

    def release(self) -> None:
        self.released_at = time.monotonic()
        self.wakeup.ring()


def test_a_connector_ring_ends_the_parked_wait_at_once():
    # A long poll period: without the ring the engine would see the release seconds late.
    fake = ParkedEngine()
    engine = AsyncEngine(lambda: fake, poll_interval_s=30.0)
    engine.start()

    async def main():
        await engine.wait_ready(10)
        # Waits double from 50 us: the one from 0.82 s to 1.64 s is under way at the release.
        threading.Timer(1.0, fake.release).start()
        outs = [o async for o in engine.generate("r1", [1], SamplingParams(max_tokens=1, temperature=0.0))]
        return outs[-1], time.monotonic()

    try:
        final, done_at = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        engine.shutdown()
    assert final.finished
    assert done_at - fake.released_at < 0.3  # not 0.64 s later, at the end of that wait


def test_shutdown_ends_in_flight_requests_and_joins():
    fake = FakeEngineCore(step_delay_s=0.001)
    engine = AsyncEngine(lambda: fake)
    engine.start()

    async def main():
        await engine.wait_ready(10)
        gen = engine.generate("r1", [1], SamplingParams(max_tokens=10_000))
        await anext(gen)
        threading.Timer(0.05, engine.shutdown).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in gen:
                pass
        return time.monotonic() - t0

    asyncio.run(asyncio.wait_for(main(), 20))
    time.sleep(0.1)
    assert fake.is_shut_down and not engine._thread.is_alive()
