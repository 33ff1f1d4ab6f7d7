"""vLLM's in-process `LLM` with KVBridgeConnector, one scenario per run, answers as JSON lines on stdout.

    python inprocess_llm.py offload-reset MODEL        # -> {"first": [...], "second": [...], "reset": true, ...}
    python inprocess_llm.py prefill-reset MODEL PROMPT_JSON
        # -> {"params": {...}} (the prefill leg's kv_transfer_params), then the reset: {"reset": ..., "reset_s": ...}
    python inprocess_llm.py cycles MODEL NUM_CYCLES    # -> one {"cycle": i, ...} per cycle

The tests (test_adapter_lifecycle.py, test_adapter_pd.py) run it with the vLLM environment's python in
a subprocess of its own, so vLLM's process-wide state (its config, the KV transfer group, the
distributed environment) never leaks into pytest. VLLM_ENABLE_V1_MULTIPROCESSING=0 puts vLLM's
engine core and its worker in this process: that is where the adapter can drain transfers before a
prefix-cache reset. Everything vLLM logs goes to stderr.

With INPROCESS_LLM_DEVICE=cuda the same scenarios run on the GPU (bf16, 16-token blocks, a small share
of the GPU's memory, eager), and each cycle also reports `torch.cuda.memory_allocated()` and the
device's used memory (test_gpu_offload_seeds.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import weakref

ON_GPU = os.environ.get("INPROCESS_LLM_DEVICE", "cpu") == "cuda"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
if not ON_GPU:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the JSON answers only

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16 if ON_GPU else 128  # vLLM's block size on CPU; the one these scenarios ask for on the GPU
GPU_MEMORY_UTILIZATION = 0.08  # of an H200: about 11 GiB, most of it KV cache
OFFLOAD_STORE_DELAY_S = 1.0  # each offload store sleeps this long: the reset comes while it is in flight
PREFILL_LEG_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def make_llm(model: str, role: str, extra: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
        kv_role=role, kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
    )  # fmt: skip
    device_args = (
        {"dtype": "bfloat16", "block_size": BLOCK_SIZE, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
        if ON_GPU else {"dtype": "float32"}
    )  # fmt: skip
    return LLM(model=model, enforce_eager=True, max_model_len=MAX_MODEL_LEN, kv_transfer_config=kv, **device_args)


def shut_down(llm) -> None:
    """vLLM 0.32's `LLM` has no shutdown(): its in-process engine client's shutdown runs EngineCore's
    (executor -> worker -> ensure_kv_transfer_shutdown -> the connector's shutdown, then the scheduler's)."""
    llm.llm_engine.engine_core.shutdown()


def greedy_params(max_tokens: int, kv_transfer_params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)


def random_prompt(seed: int, num_tokens: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [0, *(rng.randrange(3, 1024) for _ in range(num_tokens - 1))]


# ---------------------------------------------------------------------- scenarios


def offload_reset(model: str) -> None:
    """Generate, reset vLLM's prefix cache while the prompt's offload store is in flight, generate again."""
    extra = {"connector": "OffloadingConnector", "host_num_blocks": 64, "debug_store_delay_s": OFFLOAD_STORE_DELAY_S}
    llm = make_llm(model, "kv_both", extra)
    prompt = random_prompt(seed=1, num_tokens=3 * BLOCK_SIZE + 17)  # 3 full blocks and a partial one
    first = run_to_finish(llm, "first", prompt, greedy_params(8))
    start = time.monotonic()
    is_reset = llm.reset_prefix_cache()
    reset_s = time.monotonic() - start
    second = llm.generate([{"prompt_token_ids": prompt}], greedy_params(8), use_tqdm=False)[0]
    emit({
        "first": list(first.outputs[0].token_ids), "second": list(second.outputs[0].token_ids),
        "first_cached_tokens": first.num_cached_tokens, "second_cached_tokens": second.num_cached_tokens,
        "reset": is_reset, "reset_s": reset_s, "store_delay_s": OFFLOAD_STORE_DELAY_S,
        "num_prompt_tokens": len(prompt),
    })  # fmt: skip
    shut_down(llm)


def run_to_finish(llm, request_id: str, prompt: list[int], params):
    """Step the engine until the request's output is final, and not one step more: whatever the request
    left in flight (an offload store) is still in flight when this returns. `LLM.generate` steps on
    while the engine has work, which in some vLLM releases includes blocks whose free waits for a store."""
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def prefill_reset(model: str, prompt: list[int]) -> None:
    """A prefill leg (do_remote_decode) in this process, then a reset while a decode server reads its blocks."""
    extra = {"connector": "NixlConnector", "lease_s": 30.0, "flush_timeout_s": 30.0}
    llm = make_llm(model, "kv_producer", extra)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy_params(1, dict(PREFILL_LEG_PARAMS)), use_tqdm=False)[0]
    emit({"params": out.kv_transfer_params})  # the test starts the decode leg when it reads this
    start = time.monotonic()
    is_reset = llm.reset_prefix_cache()  # no step runs between the two calls: the drain grants the lease
    emit({"reset": is_reset, "reset_s": time.monotonic() - start})
    shut_down(llm)


class NixlLedger:
    """Counts NIXL agents alive and memory registrations made and undone, by wrapping NIXL's own API."""

    def __init__(self) -> None:
        from nixl._api import nixl_agent

        self.agents: weakref.WeakSet = weakref.WeakSet()
        self.num_registered = self.num_deregistered = 0
        init, register, deregister = nixl_agent.__init__, nixl_agent.register_memory, nixl_agent.deregister_memory
        ledger = self

        def counted_init(agent, *args, **kwargs):
            init(agent, *args, **kwargs)
            ledger.agents.add(agent)

        def counted_register(agent, *args, **kwargs):
            result = register(agent, *args, **kwargs)
            ledger.num_registered += 1
            return result

        def counted_deregister(agent, *args, **kwargs):
            result = deregister(agent, *args, **kwargs)
            ledger.num_deregistered += 1
            return result

        nixl_agent.__init__, nixl_agent.register_memory, nixl_agent.deregister_memory = (
            counted_init, counted_register, counted_deregister,
        )  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def device_memory() -> dict:
    """On the GPU: what torch holds allocated, and what the device has in use once torch's cache is empty."""
    if not ON_GPU:
        return {}
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"cuda_allocated": torch.cuda.memory_allocated(), "cuda_used": total - free}


def cycles(model: str, num_cycles: int) -> None:
    """Create -> generate -> shut down, NixlConnector and OffloadingConnector in turn; the process's
    threads, RSS and NIXL registrations after each cycle."""
    from kvbridge.integrations.vllm import KVBridgeConnector

    ledger = NixlLedger()
    num_shutdowns = 0
    shutdown = KVBridgeConnector.shutdown

    def counted_shutdown(connector):  # vLLM calls it on both instances (worker, then scheduler)
        nonlocal num_shutdowns
        num_shutdowns += 1
        shutdown(connector)

    KVBridgeConnector.shutdown = counted_shutdown
    prompt = random_prompt(seed=2, num_tokens=2 * BLOCK_SIZE + 5)
    emit({"cycle": -1, "rss": rss_bytes(), "num_os_threads": len(os.listdir("/proc/self/task")),
          "threads": sorted(t.name for t in threading.enumerate()), **device_memory()})  # fmt: skip
    for cycle in range(num_cycles):
        connector = ("NixlConnector", "OffloadingConnector")[cycle % 2]
        extra = {"connector": connector, **({"host_num_blocks": 16} if connector == "OffloadingConnector" else {})}
        llm = make_llm(model, "kv_both", extra)
        out = llm.generate([{"prompt_token_ids": prompt}], greedy_params(4), use_tqdm=False)[0]
        threads_running = sorted(t.name for t in threading.enumerate())
        shut_down(llm)
        del llm
        gc.collect()
        emit({
            "cycle": cycle, "connector": connector, "tokens": list(out.outputs[0].token_ids),
            "rss": rss_bytes(), "num_os_threads": len(os.listdir("/proc/self/task")),
            "threads": sorted(t.name for t in threading.enumerate()), "threads_running": threads_running,
            "nixl_agents_alive": len(ledger.agents), "nixl_registered": ledger.num_registered,
            "nixl_deregistered": ledger.num_deregistered, "connector_shutdowns": num_shutdowns, **device_memory(),
        })  # fmt: skip


def main(argv: list[str]) -> int:
    match argv:
        case ["offload-reset", model]:
            offload_reset(model)
        case ["prefill-reset", model, prompt]:
            prefill_reset(model, json.loads(prompt))
        case ["cycles", model, num_cycles]:
            cycles(model, int(num_cycles))
        case _:
            print(__doc__, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
