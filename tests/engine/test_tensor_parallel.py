"""Tensor parallelism in the reference engine: TP 2 gives TP 1's tokens (float32, CPU, gloo), each
rank holds only its KV heads, and worker ranks never outlive rank 0."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from memory_snapshot import take_snapshot
from safetensors.torch import load_file, save_file
from test_weights import LLAMA, write_checkpoint

from kvbridge import LLM, SamplingParams
from kvbridge.cli_errors import flag_names
from kvbridge.config import EngineConfig, KVTransferConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine.attention import SeqSpan
from kvbridge.engine.faults import EngineFaultError
from kvbridge.engine.presets import get_preset, with_overrides
from kvbridge.engine.request import Request
from kvbridge.engine.step_inputs import StepInputs
from kvbridge.engine.tp_group import check_devices, decode_step, encode_step
from kvbridge.engine.tp_workers import STOP_TIMEOUT_S
from kvbridge.errors import ConfigError, TensorParallelError
from kvbridge.serve import server
from kvbridge.tp_layout import TPShard

pytestmark = pytest.mark.tp  # a step of its own in .ci/run (README)

PROMPTS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog, twice over, and then once more for luck.",
    "kvbridge",
    "P/D disaggregation moves the KV cache",
]
WORKER_EXIT_DEADLINE_S = 10.0


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children() -> set[int]:
    """Child processes of this process, zombies included."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


def _wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    """The pids still running after `deadline_s` (empty: all gone)."""
    deadline = time.monotonic() + deadline_s
    while (alive := [p for p in pids if _is_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


# ---------------------------------------------------------------------- the split, without processes


def test_shards_split_heads_and_replicate_kv_heads_when_fewer_than_ranks():
    tiny = get_preset("tiny")  # 4 query heads, 2 KV heads, MLP 256
    two = [TPShard(r, 2, tiny.num_heads, tiny.num_kv_heads, tiny.intermediate_size) for r in range(2)]
    assert [s.head_range for s in two] == [(0, 2), (2, 4)]
    assert [s.kv_head_range for s in two] == [(0, 1), (1, 2)]
    assert [s.intermediate_range for s in two] == [(0, 128), (128, 256)]
    four = [TPShard(r, 4, tiny.num_heads, tiny.num_kv_heads, tiny.intermediate_size) for r in range(4)]
    assert [s.kv_head_range for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # each rank: the head its queries read
    assert all(s.is_kv_replicated and s.num_local_kv_heads == 1 for s in four)


@pytest.mark.parametrize("size", [3, 8, 0])
def test_a_tp_size_the_model_cannot_split_is_refused_before_any_process_starts(size):
    with pytest.raises(TensorParallelError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=size)  # tiny: 4 heads


def test_tp_on_cuda_needs_one_gpu_per_rank():
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(TensorParallelError, match=f"this machine has {available}"):
        check_devices("cuda", available + 1)


def test_tp_with_a_connector_that_is_not_tp_aware_is_refused_naming_both():
    with pytest.raises(TensorParallelError) as info:
        EngineConfig(model=ModelConfig(tensor_parallel_size=2), kv_transfer=KVTransferConfig("OffloadingConnector"))
    assert "--tensor-parallel-size 2" in flag_names(str(info.value))
    assert "--kv-connector OffloadingConnector" in flag_names(str(info.value))
    config = EngineConfig(model=ModelConfig(tensor_parallel_size=2), kv_transfer=KVTransferConfig("NixlConnector"))
    assert config.kv_transfer.connector == "NixlConnector"  # TP-aware: every rank runs its worker half


def test_serve_takes_tp_with_its_default_connector_and_refuses_offload():
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    config = server.build_engine_config(parser.parse_args(["--tensor-parallel-size", "2"]))
    assert config.model.tensor_parallel_size == 2 and config.kv_transfer.connector == "NixlConnector"
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 2 with --kv-connector OffloadingConnector: .*--no-connector"):
        server.build_engine_config(parser.parse_args(["--tensor-parallel-size", "2", "--kv-connector", "OffloadingConnector"]))
    config = server.build_engine_config(parser.parse_args(["--tensor-parallel-size", "2", "--no-connector"]))
    assert config.model.tensor_parallel_size == 2 and config.kv_transfer is None


def test_step_inputs_round_trip_through_the_broadcast_encoding():
    inputs = StepInputs([5, 6, 7, 9], [SeqSpan(0, 0, 3, (4, 2)), SeqSpan(3, 20, 1, (1, 3))], [2, 3], ["a", "b"])
    assert decode_step(encode_step(inputs)) == StepInputs(inputs.token_ids, inputs.spans, [], [])


# ---------------------------------------------------------------------- TP 2 against TP 1


@pytest.fixture(scope="module")
def engines():
    """TP 1 and TP 2 engines of the tiny preset, fed the same calls in the same order (so their block
    pools evolve alike and block b holds the same tokens in both)."""
    tp1, tp2 = LLM(num_blocks=64), LLM(num_blocks=64, tensor_parallel_size=2)
    yield tp1, tp2
    tp2.shutdown()
    tp1.shutdown()


def test_tp2_greedy_tokens_equal_tp1_for_a_batch_of_concurrent_requests(engines):
    tp1, tp2 = engines
    params = SamplingParams(max_tokens=16, temperature=0)
    assert tp1.engine.runner.worker_pids == [] and len(tp2.engine.runner.worker_pids) == 1
    assert _tokens(tp2.generate(PROMPTS, params)) == _tokens(tp1.generate(PROMPTS, params))


def test_tp2_seeded_sampling_equals_tp1(engines):
    tp1, tp2 = engines
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=s) for s in range(len(PROMPTS))]
    assert _tokens(tp2.generate(PROMPTS, params)) == _tokens(tp1.generate(PROMPTS, params))


def test_prefix_caching_hits_under_tp2(engines):
    tp1, tp2 = engines
    shared = "A shared system prompt that spans several blocks of sixteen tokens each. "
    params = SamplingParams(max_tokens=8, temperature=0)
    firsts = [llm.generate(shared + "First question?", params)[0] for llm in (tp1, tp2)]
    seconds = [llm.generate(shared + "Second one!", params)[0] for llm in (tp1, tp2)]
    assert seconds[1].num_cached_tokens >= 64 and seconds[1].num_cached_tokens == seconds[0].num_cached_tokens
    assert _tokens(firsts[1:]) == _tokens(firsts[:1]) and _tokens(seconds[1:]) == _tokens(seconds[:1])


def test_rank0_cache_holds_only_its_kv_heads_with_tp1s_values(engines):
    tp1, tp2 = engines
    tp1.generate("Fill some blocks of both caches alike.", SamplingParams(max_tokens=4, temperature=0))
    tp2.generate("Fill some blocks of both caches alike.", SamplingParams(max_tokens=4, temperature=0))
    whole, mine = tp1.engine.runner, tp2.engine.runner
    assert [r.kv_head_range for r in mine.kv_layouts] == [(0, 1), (1, 2)]
    assert mine.layout.num_kv_heads == 1 and mine.kv_cache.shape[-2] == 1
    assert mine.layout.num_blocks == whole.layout.num_blocks
    start, stop = mine.kv_layouts[0].kv_head_range
    torch.testing.assert_close(mine.kv_cache, whole.kv_cache[..., start:stop, :], rtol=1e-4, atol=1e-4)
    assert mine.kv_cache.abs().sum() > 0


def _add_mlp_biases(path, args) -> None:
    """Give a written checkpoint MLP biases (config.json's `mlp_bias`): down_proj's is row-parallel's bias."""
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for i in range(args.num_layers):
        for name, size in (("gate", args.intermediate_size), ("up", args.intermediate_size), ("down", args.hidden_size)):
            tensors[f"model.layers.{i}.mlp.{name}_proj.bias"] = torch.randn(size, generator=gen) * 0.1
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))


def test_tp2_tokens_equal_tp1_on_a_hf_checkpoint_with_qkv_and_mlp_biases(tmp_path):
    args = with_overrides(LLAMA, qkv_bias=True)
    write_checkpoint(tmp_path, args, "Qwen2ForCausalLM")
    _add_mlp_biases(tmp_path, args)
    prompts = [{"prompt_token_ids": [3, 4, 17, 250, 99, 12, 7]}, {"prompt_token_ids": list(range(5, 45))}]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), num_blocks=32) as tp1:
        assert tp1.engine.runner.model.model.layers[0].mlp.down_proj.bias is not None
        want = _tokens(tp1.generate(prompts, params))
    with LLM(str(tmp_path), num_blocks=32, tensor_parallel_size=2) as tp2:
        assert _tokens(tp2.generate(prompts, params)) == want


@pytest.mark.slow
def test_tp4_replicates_kv_heads_and_gives_tp1s_tokens():
    params = SamplingParams(max_tokens=12, temperature=0)
    with LLM(num_blocks=32) as tp1:
        want = _tokens(tp1.generate(PROMPTS, params))
    with LLM(num_blocks=32, tensor_parallel_size=4) as tp4:  # 2 KV heads over 4 ranks
        assert [r.kv_head_range for r in tp4.engine.runner.kv_layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
        assert _tokens(tp4.generate(PROMPTS, params)) == want


# ---------------------------------------------------------------------- processes


def _run_and_shut_down_tp2() -> None:
    llm = LLM(num_blocks=16, tensor_parallel_size=2)
    pids = llm.engine.runner.worker_pids
    llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))
    llm.shutdown()
    assert llm.engine.runner.worker_pids == []
    assert _wait_gone(pids, 0.0) == []  # shutdown waited for them


@pytest.mark.slow
def test_engines_built_and_shut_down_in_a_loop_leave_no_process_or_memory_behind():
    _run_and_shut_down_tp2()  # warm-up: torch's and gloo's one-time allocations
    baseline, children = take_snapshot(), _children()
    for _ in range(3):
        _run_and_shut_down_tp2()
    after = take_snapshot()
    assert _children() <= children  # other tests' engines may still hold theirs
    assert after.num_live_tensors == baseline.num_live_tensors
    assert after.rss_bytes - baseline.rss_bytes < 32 * 2**20, (baseline, after)


def test_a_dead_worker_is_an_engine_fault_not_a_hang():
    llm = LLM(num_blocks=16, tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone([pid], WORKER_EXIT_DEADLINE_S) == []
        with pytest.raises(EngineFaultError, match="rank 1 .* exited"):
            llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))
    finally:
        llm.shutdown()


def test_an_engine_dropped_without_shutdown_takes_its_workers_along():
    llm = LLM(num_blocks=16, tensor_parallel_size=2)
    pids = llm.engine.runner.worker_pids
    del llm
    gc.collect()
    assert _wait_gone(pids, WORKER_EXIT_DEADLINE_S) == []


def test_rank0_failing_midway_through_a_step_is_an_engine_fault_and_shutdown_does_not_hang():
    llm = LLM(num_blocks=16, tensor_parallel_size=2)
    runner = llm.engine.runner
    pids = runner.worker_pids
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0), 16)

    def fail_at_layer_2(layer: int) -> None:
        if layer == 2:  # the worker has joined layers 0 and 1's all-reduces and waits in layer 2's
            raise ValueError("boom")

    with pytest.raises(EngineFaultError, match="out of step"):
        runner.forward(SchedulerOutput([ScheduledRequest(request, 0, 3, [0])]), before_layer=fail_at_layer_2)
    with pytest.raises(EngineFaultError, match="earlier tensor-parallel step failed"):
        runner.forward(SchedulerOutput([ScheduledRequest(request, 0, 3, [0])]))
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < STOP_TIMEOUT_S  # killed, not waited for
    assert _wait_gone(pids, 0.0) == []


def test_an_engine_whose_start_fails_after_its_workers_started_leaves_none_behind():
    children = _children()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds"):
        LLM(num_blocks=16, tensor_parallel_size=2, max_model_len=100_000)  # refused once the weights are loaded
    assert time.monotonic() - started < 60
    assert _wait_gone(list(_children() - children), WORKER_EXIT_DEADLINE_S) == []


RANK0_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from kvbridge import LLM, SamplingParams
    llm = LLM(num_blocks=16, tensor_parallel_size=2)
    llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))
    print(json.dumps(llm.engine.runner.worker_pids), flush=True)
    time.sleep(600)
    """
)


def test_workers_exit_when_rank0_is_killed():
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        worker_pids = json.loads(rank0.stdout.readline())
        assert worker_pids and all(_is_running(p) for p in worker_pids)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(timeout=10)
        assert _wait_gone(worker_pids, WORKER_EXIT_DEADLINE_S) == []
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
