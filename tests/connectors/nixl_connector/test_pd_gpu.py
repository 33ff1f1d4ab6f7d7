"""P/D on CUDA: prefill on one GPU, decode on another (NVLink / cuda_ipc through UCX), and engine
cycles that must give back every byte of device memory. Run on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import gc

import pytest
import torch
from memory_snapshot import take_snapshot, wait_for_device_memory
from prefill_node import engine_kwargs, prefill_node

from kvbridge import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.nixl]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(i * 7 + n) % 250 + 3 for i in range(n)]} for n in (40, 64, 300, 1000)]
MiB = 2**20


def devices() -> tuple[str, str]:
    """(prefill, decode): two GPUs when there are two, else both on cuda:0."""
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pd_across_gpus_matches_colocated(dtype: str):
    prefill_dev, decode_dev = devices()
    with LLM(device=decode_dev, dtype=dtype, num_blocks=256) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
    with prefill_node(**engine_kwargs(f"gpu-prefill-{dtype}", "kv_producer", device=prefill_dev, dtype=dtype, num_blocks=256)) as node:
        params = node.prefill(PROMPTS)
        with LLM(**engine_kwargs(f"gpu-decode-{dtype}", "kv_consumer", device=decode_dev, dtype=dtype, num_blocks=256)) as dec:
            outs = dec.generate(PROMPTS, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            worker = dec.get_stats()["connector"]["worker"]
            print(f"{prefill_dev} -> {decode_dev} {dtype}: {worker}")
            assert worker["num_failures"] == 0
            assert worker["bytes_transferred"] == sum(len(p["remote_block_ids"]) for p in params) * dec.engine.layout.block_nbytes
        node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


@pytest.mark.parametrize("with_nixl", [False, True], ids=["plain", "nixl"])
def test_cuda_engine_cycles_return_device_memory(with_nixl: bool):
    prefill_dev, decode_dev = devices()
    device = torch.device(decode_dev)

    def cycle(node, i: int) -> None:
        if with_nixl:
            llm = LLM(**engine_kwargs(f"gpu-cycle-{i}", "kv_consumer", device=decode_dev, num_blocks=512))
            outs = llm.generate(PROMPTS, GREEDY, kv_transfer_params=node.prefill(PROMPTS))
            assert llm.get_stats()["connector"]["worker"]["num_transfers"] == len(PROMPTS)
        else:
            llm = LLM(device=decode_dev, num_blocks=512)
            outs = llm.generate(PROMPTS, GREEDY)
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
        llm.shutdown()

    kwargs = engine_kwargs("gpu-cycle-prefill", "kv_producer", device=prefill_dev, num_blocks=512)
    with prefill_node(**kwargs) as node:
        cycle(node, -1)  # warm-up: CUDA context, allocator, UCX's own device state
        gc.collect()
        torch.cuda.empty_cache()
        before = take_snapshot(device)
        for i in range(10):
            cycle(node, i)
            gc.collect()
        after = take_snapshot(device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        print(f"with_nixl={with_nixl}: before {before}, after {after}, reserved after empty_cache {reserved}")
        assert after.cuda_allocated == before.cuda_allocated, after.diff(before)
        assert reserved == before.cuda_reserved, (reserved, before.cuda_reserved)
        # Device memory in use (every process): back within a few MiB once shutdown released it.
        if prefill_dev != decode_dev:
            used = wait_for_device_memory(before.cuda_used + 8 * MiB, timeout_s=10, device=device)
            print(f"device used: before {before.cuda_used / MiB:.1f} MiB, after {used / MiB:.1f} MiB")


def test_a_restarted_gpu_prefill_is_never_read_for_its_predecessors_leases():
    """The decode engine mapped the first prefill's KV through CUDA IPC; the prefill is killed and a
    new one starts on the same side-channel address with other prompts in its blocks. Params of the
    dead instance are never served (the completion is recomputed), and the new instance is pulled from."""
    from kvbridge.serve.launcher import free_ports

    prefill_dev, decode_dev = devices()
    (port,) = free_ports(1)
    prefill = dict(device=prefill_dev, num_blocks=256, kv={"side_channel_port": port})
    other = [{"prompt_token_ids": [(i * 13 + n) % 250 + 3 for i in range(n)]} for n in (1000, 300, 64, 40)]
    with LLM(device=decode_dev, num_blocks=256) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
        want_other = [o.outputs[0].token_ids for o in ref.generate(other, GREEDY)]
    decode = engine_kwargs("gpu-decode-restart", "kv_consumer", device=decode_dev, num_blocks=256,
                           kv={"extra": {"ipc_min_runs": 1, "handshake_timeout_s": 2.0, "transfer_timeout_s": 10.0}})
    with LLM(**decode) as dec:
        with prefill_node(**engine_kwargs("gpu-prefill-restart", "kv_producer", **prefill)) as first:
            outs = dec.generate(PROMPTS, GREEDY, kv_transfer_params=first.prefill(PROMPTS))
            assert [o.outputs[0].token_ids for o in outs] == want
            assert dec.get_stats()["connector"]["worker"]["num_failures"] == 0
            stale = first.prefill(PROMPTS)  # leased, never read: the process dies holding them
            first.kill()
        with prefill_node(**engine_kwargs("gpu-prefill-restart", "kv_producer", **prefill)) as second:
            second.prefill(other)  # the new instance's blocks hold other prompts now
            second.wait_until(lambda s: s["num_used_blocks"] > 0, timeout_s=5)
            outs = dec.generate(PROMPTS, GREEDY, kv_transfer_params=stale)
            assert [o.outputs[0].token_ids for o in outs] == want  # recomputed, never the other prompts' KV
            worker = dec.get_stats()["connector"]["worker"]
            assert worker["num_failures"] >= 1 and worker["num_load_errors"] > 0, worker
            fresh = dec.generate(other, GREEDY, kv_transfer_params=second.prefill(other))  # not cached here yet
            assert [o.outputs[0].token_ids for o in fresh] == want_other
            assert all(o.num_external_tokens > 0 for o in fresh)  # pulled from the new instance again
            second.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=30)


@pytest.mark.parametrize("flip", [False, True], ids=["clean", "bit_flipped"])
def test_sync_ipc_reads_load_in_their_step_and_never_serve_a_flipped_bit(flip: bool, monkeypatch):
    """NixlConnector option sync_ipc_reads: once the decode knows the prefill (its first read loads
    asynchronously, with the handshake), granted reads through CUDA IPC load in the step that
    schedules them. A bit flipped after the copy, before the digest, is a load error in that very
    step: the token computed on it is dropped, the prompt recomputed, and the output equals colocated."""
    if flip:
        monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT", "1")
    prefill_dev, decode_dev = devices()
    with LLM(device=decode_dev, dtype="bfloat16", num_blocks=256) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
    decode = engine_kwargs(f"gpu-sync-decode-{flip}", "kv_consumer", device=decode_dev, dtype="bfloat16", num_blocks=256,
                           kv={"extra": {"sync_ipc_reads": True, "ipc_min_runs": 1}})
    with prefill_node(**engine_kwargs(f"gpu-sync-prefill-{flip}", "kv_producer", device=prefill_dev, dtype="bfloat16",
                                      num_blocks=256)) as node:  # fmt: skip
        with LLM(**decode) as dec:
            first = [{"prompt_token_ids": [5] * 48}]
            dec.generate(first, GREEDY, kv_transfer_params=node.prefill(first))  # the handshake, asynchronously
            before = dec.get_stats()["connector"]["worker"]
            outs = dec.generate(PROMPTS, GREEDY, kv_transfer_params=node.prefill(PROMPTS))
            assert [o.outputs[0].token_ids for o in outs] == want
            worker = dec.get_stats()["connector"]["worker"]
            print(f"sync_ipc_reads flip={flip}: {worker}")
            num_sync = worker["num_sync_reads"] - before["num_sync_reads"]
            mismatches = worker["num_digest_mismatches"] - before["num_digest_mismatches"]
            if flip:
                assert num_sync == 0 and mismatches == len(PROMPTS), worker
            else:
                assert num_sync == len(PROMPTS) and mismatches == 0 and worker["num_failures"] == before["num_failures"], worker
        node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=30)
