"""KV transfer bandwidth: the kvbridge path vs one raw NIXL descriptor vs a copy baseline.

Two OS processes. A child owns a block-major KV cache and serves it through a `KVEndpoint`; this
process handshakes once (not timed) and then, per repetition, pulls one request's blocks:

- kvbridge_gbps: `KVEndpoint.read_blocks` of scattered block ids (runs of adjacent ids, see
  --contiguous-fraction), from the call until `poll()` reports DONE: descriptor building,
  posting and completion are inside the timing, the handshake is not.
- raw_nixl_gbps: the same byte count as ONE NIXL descriptor (prepared lists cached, post + poll timed).
- baseline_gbps: CPU: memcpy (torch copy_) of the same bytes in one process; GPU: a raw peer copy
  cuda:1 -> cuda:0 in one process (synchronized).

    python benchmarks/transfer_bw.py --json                          # 4,096 tokens of Llama-8B geometry
    python benchmarks/transfer_bw.py --json --tokens 1024 --reps 7   # quicker on a small CPU box
    python benchmarks/transfer_bw.py --json --device cuda            # cuda:0 (reader) <- cuda:1 (owner)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from common import exit_if_missing, machine_info, versions


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the request")
    p.add_argument("--pool-factor", type=int, default=2, help="KV cache blocks = factor x request blocks")
    p.add_argument("--contiguous-fraction", type=float, default=0.5,
                   help="probability that a request block follows the previous one in both caches")
    p.add_argument("--descriptor-mode", choices=["blocks", "ranges"], default="blocks")
    p.add_argument("--max-descriptor-mib", type=float, default=None, help="split ranges above this size")
    p.add_argument("--streams", type=int, default=1, help="concurrent posts the request is split into")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cuda-ipc", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU: kvbridge reads through a CUDA IPC mapping of the peer's cache (default), "
                   "or through NIXL with --no-cuda-ipc")
    p.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                   help="NIXL backend parameter for both agents, e.g. num_workers=4 (repeatable)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # child mode: a JSON spec
    return p.parse_args(argv)


def backend_params(args) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.backend_param)


def make_layout(args):
    from kvbridge.layout import KVCacheLayout

    num_blocks = -(-args.tokens // args.block_size) * args.pool_factor
    return KVCacheLayout(num_blocks, args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype)


def scattered_ids(rng: np.random.Generator, n: int, pool: int, contiguous_fraction: float) -> np.ndarray:
    """`n` distinct ids out of `pool`, in runs whose mean length is 1 / (1 - contiguous_fraction)."""
    breaks = np.flatnonzero(rng.random(n - 1) >= contiguous_fraction) + 1
    lengths = np.diff(np.concatenate(([0], breaks, [n])))  # [R]
    gaps = rng.multinomial(pool - n, np.full(len(lengths) + 1, 1 / (len(lengths) + 1)))[:-1]  # free space
    order = rng.permutation(len(lengths))  # runs in random order, placed left to right
    starts = np.cumsum(np.concatenate(([0], lengths[order][:-1]))) + np.cumsum(gaps)
    ids = np.empty(n, dtype=np.int64)
    run_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    for run, start in zip(order, starts):  # R iterations, not per block
        ids[run_starts[run]:run_starts[run] + lengths[run]] = np.arange(start, start + lengths[run])
    return ids


def serve(spec: dict) -> int:
    """Child: own a KV cache filled with block-dependent bytes and serve it until stdin closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs to stdout
    import torch

    from kvbridge.transfer.endpoint import KVEndpoint
    from kvbridge.transfer.options import TransferOptions

    args = parse_args(spec["argv"])
    layout = make_layout(args)
    kv = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device=spec["device"])
    kv.view(layout.num_blocks, -1).view(torch.uint8).copy_(
        (torch.arange(layout.num_blocks, device=spec["device"]) % 251).to(torch.uint8)[:, None].expand(
            layout.num_blocks, layout.block_nbytes))
    options = TransferOptions(backend_params=backend_params(args), cuda_ipc=args.cuda_ipc)
    ep = KVEndpoint("bench-owner", "bench-model", kv, layout, secret=None, options=options)
    proto.write(json.dumps({"address": ep.address}) + "\n")
    sys.stdin.readline()
    ep.close()
    return 0


def timed_interleaved(fns: dict, reps: int, warmup: int, sync=lambda: None) -> dict[str, list[float]]:
    """Time each function `reps` times, interleaved (A B C A B C ...) so that load from other
    processes on a shared machine hits every figure alike; `warmup` untimed rounds first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out[name].append(time.perf_counter() - t0)
    return out


def summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"gbps": nbytes / med / 1e9, "best_gbps": nbytes / min(times) / 1e9,
            "median_s": med, "min_s": min(times), "reps": len(times)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        return serve(json.loads(args.serve))
    out = os.fdopen(os.dup(1), "w", buffering=1)  # NIXL logs to stdout: keep it for the result only
    os.dup2(2, 1)
    import torch

    if args.device == "cuda":  # its figure is a read between two GPUs against their peer copy
        exit_if_missing("transfer_bw", num_gpus_needed=2, out=out)

    from kvbridge.transfer.agent import XferState
    from kvbridge.transfer.endpoint import KVEndpoint
    from kvbridge.transfer.options import TransferOptions
    from kvbridge.transfer.tracker import TransferState

    layout = make_layout(args)
    n = -(-args.tokens // args.block_size)
    nbytes = n * layout.block_nbytes
    local_dev, peer_dev = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    spec = {"argv": sys.argv[1:] if argv is None else list(argv), "device": peer_dev}
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", json.dumps(spec)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ep = None
    try:
        address = json.loads(child.stdout.readline())["address"]
        kv = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=local_dev)
        options = TransferOptions(
            backend_params=backend_params(args), cuda_ipc=args.cuda_ipc, descriptor_mode=args.descriptor_mode,
            max_descriptor_nbytes=int(args.max_descriptor_mib * 2**20) if args.max_descriptor_mib else None,
        )
        ep = KVEndpoint("bench-reader", "bench-model", kv, layout, secret=None, options=options)
        peer = ep.handshake(address)
        rng = np.random.default_rng(args.seed)
        local_ids = scattered_ids(rng, n, layout.num_blocks, args.contiguous_fraction)
        remote_ids = scattered_ids(rng, n, layout.num_blocks, args.contiguous_fraction)
        parts = np.array_split(np.arange(n), args.streams)
        counter = iter(range(10**9))
        last = {}

        def kvbridge_read():
            ids = [f"req-{next(counter)}" for _ in parts]
            for req_id, part in zip(ids, parts):
                ep.read_blocks(req_id, address, local_ids[part], remote_ids[part])
            pending, num_descriptors = set(ids), 0
            while pending:
                for rec in ep.poll():
                    assert rec.state is TransferState.DONE, rec.error
                    pending.discard(rec.req_id)
                    num_descriptors += rec.num_descriptors
            last["num_descriptors"] = num_descriptors

        agent, r = ep.agent, peer.region
        one_local = agent.prep_local(np.array([[kv.data_ptr(), nbytes, ep._region.device_id]]), ep._region.mem_type)
        one_remote = agent.prep_remote(peer.agent_name, np.array([[r.base_addr, nbytes, r.device_id]]), r.mem_type)

        def raw_read():
            xfer = agent.post("READ", one_local, [0], one_remote, [0])
            while (state := agent.poll(xfer)) is XferState.IN_PROGRESS:
                pass
            assert state is XferState.DONE

        src = torch.ones(nbytes, dtype=torch.uint8, device=peer_dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=local_dev)
        def sync():  # the peer copy runs between two devices: wait for both
            if args.device == "cuda":
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)

        times = timed_interleaved(
            {"kvbridge": kvbridge_read, "raw_nixl": raw_read, "baseline": lambda: dst.copy_(src)},
            args.reps, args.warmup, sync,
        )
        kv.zero_()
        sync()  # the zeroing kernel must land before NIXL writes the blocks
        kvbridge_read()
        got = kv.view(layout.num_blocks, -1).view(torch.uint8)[torch.as_tensor(local_ids, device=local_dev)][:, [0, -1]]
        want = (torch.as_tensor(remote_ids, device=local_dev) % 251).to(torch.uint8)[:, None].expand(-1, 2)
        assert torch.equal(got, want), "kvbridge read returned wrong bytes"
        last["path"] = "cuda_ipc mapping" if ep.get_stats()["num_ipc_copies"] else "nixl"
        agent.release_dlist(one_local)
        agent.release_dlist(one_remote)
    finally:
        if ep is not None:
            ep.close()
        if child.poll() is None:
            child.stdin.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    kb, raw, base = (summary(times[k], nbytes) for k in ("kvbridge", "raw_nixl", "baseline"))
    result = {
        "kvbridge_gbps": kb["gbps"], "raw_nixl_gbps": raw["gbps"], "baseline_gbps": base["gbps"],
        "kvbridge_vs_raw_nixl": kb["gbps"] / raw["gbps"], "kvbridge_vs_baseline": kb["gbps"] / base["gbps"],
        "baseline": "memcpy (torch copy_, one process)" if args.device == "cpu" else "raw peer copy cuda:1 -> cuda:0",
        "detail": {"kvbridge": kb, "raw_nixl": raw, "baseline": base},
        "bytes": nbytes, "num_blocks_read": n, "block_nbytes": layout.block_nbytes,
        "num_descriptors": last.get("num_descriptors"),  # copies (runs) on the cuda_ipc path
        "kvbridge_path": last.get("path"),
        "timing": "kvbridge: read_blocks() -> poll() DONE incl. descriptor building; handshake excluded; "
        "the three figures are timed interleaved, rep by rep",
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "serve")},
        "machine": machine_info(args.device),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write(json.dumps(result, indent=None if args.json else 2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
