"""EngineCore: the step API the server codes against, stats, gc.freeze, the exit-time registry."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
from dense_reference import dense_greedy

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine import core as core_module
from kvbridge.engine.core import EngineCore
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import EngineShutdownError, InvalidRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(**scheduler) -> EngineCore:
    return EngineCore(EngineConfig(cache=CacheConfig(num_blocks=32), scheduler=SchedulerConfig(**scheduler)))


@pytest.fixture
def engine():
    engine = make_engine()
    yield engine
    engine.shutdown()


def drain(engine: EngineCore, max_steps: int = 1000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        outputs.extend(engine.step())
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def test_step_returns_cumulative_outputs(engine):
    prompt = list(range(40, 60))
    engine.add_request("a", prompt, GREEDY)
    outputs = drain(engine)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in outputs] == [False] * 5 + [True]
    final = outputs[-1]
    assert final.outputs[0].token_ids == dense_greedy(engine.runner.model, prompt, 6)
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)
    assert final.outputs[0].finish_reason == "length" and final.error is None
    assert outputs[0].outputs[0].token_ids is not outputs[1].outputs[0].token_ids  # snapshots, not views
    assert engine.is_idle is False
    engine.step()
    assert engine.is_idle is True


def test_abort_gives_a_final_output(engine):
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    engine.abort_request("unknown")
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [("a", True, "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == 32


def test_duplicate_ids_and_bad_prompts(engine):
    engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("b", [], GREEDY)
    drain(engine)
    engine.add_request("a", [1, 2], GREEDY)  # a finished id may be reused


def test_add_request_refuses_what_the_model_cannot_serve_and_the_engine_serves_on(engine):
    vocab_size = engine.runner.model.args.vocab_size
    for prompt, params, param in [
        ([1, vocab_size], GREEDY, "prompt"),  # once an IndexError in the embedding that killed the engine
        ([1, 2**64], GREEDY, "prompt"),  # once an overflow building the input tensor
        ([1], SamplingParams(max_tokens=engine.scheduler.max_model_len + 1), "max_tokens"),
        ([1], SamplingParams(stop_token_ids=(vocab_size,)), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == param
    assert not engine.has_unfinished_requests()
    engine.add_request("a", [1, 2], GREEDY)
    assert drain(engine)[-1].outputs[0].token_ids == dense_greedy(engine.runner.model, [1, 2], 6)


def test_chunked_prefill_off_rejects_prompts_over_the_budget():
    engine = make_engine(max_num_batched_tokens=16, enable_chunked_prefill=False)
    try:
        with pytest.raises(InvalidRequestError, match="chunked prefill"):
            engine.add_request("a", list(range(20)), GREEDY)
        engine.add_request("b", list(range(16)), GREEDY)
        assert drain(engine)[-1].finished
    finally:
        engine.shutdown()


def test_stats_count_tokens(engine):
    prompt = list(range(100, 140))
    engine.add_request("a", prompt, GREEDY)
    drain(engine)
    engine.add_request("b", prompt, GREEDY)
    drain(engine)
    stats = engine.get_stats()
    assert stats["num_computed_tokens"] == (40 + 5) + (40 - 32 + 5)
    assert stats["num_prefix_hit_tokens"] == 32 and stats["num_generated_tokens"] == 12
    assert stats["num_cached_blocks"] >= 2 and "connector" not in stats


def test_gc_freeze_is_undone_at_shutdown(monkeypatch):
    monkeypatch.delenv("KVBRIDGE_DISABLE_GC_FREEZE", raising=False)
    engine = make_engine()
    assert gc.get_freeze_count() > 0
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv("KVBRIDGE_DISABLE_GC_FREEZE", "1")
    engine = make_engine()
    assert gc.get_freeze_count() == 0
    engine.shutdown()


def test_shutdown_is_idempotent_and_final(engine):
    engine.shutdown()
    engine.shutdown()
    assert engine.runner.kv_cache is None and engine.runner.model is None
    with pytest.raises(EngineShutdownError):
        engine.add_request("a", [1], GREEDY)
    with pytest.raises(EngineShutdownError):
        engine.step()


def test_registry_does_not_keep_engines_alive():
    engine = make_engine()
    assert engine in core_module._LIVE_ENGINES
    ref = weakref.ref(engine)
    engine.shutdown()
    assert engine not in core_module._LIVE_ENGINES
    del engine
    gc.collect()
    assert ref() is None
    unshut = make_engine()
    ref = weakref.ref(unshut)
    del unshut
    gc.unfreeze()  # what shutdown would do; the registry itself must hold no strong reference
    gc.collect()
    assert ref() is None


def test_engines_alive_at_exit_are_shut_down():
    script = textwrap.dedent(
        """
        import atexit
        state = {}
        atexit.register(lambda: print("shut down at exit:", state["engine"].is_shut_down, flush=True))
        from kvbridge.config import CacheConfig, EngineConfig
        from kvbridge.engine.core import EngineCore
        state["engine"] = EngineCore(EngineConfig(cache=CacheConfig(num_blocks=8)))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "shut down at exit: True" in result.stdout
