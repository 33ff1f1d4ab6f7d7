"""CUDA IPC copy methods: ways to read scattered KV blocks out of a peer process's GPU memory.

Two OS processes, two GPUs of one host. A child (the owner, GPU 1) fills a pool of 2 x --blocks
blocks with block- and byte-dependent values and exports it (`export_tensor`); this process (the
reader, GPU 0) maps it in its own GPU's context (`IpcMapping`, kvbridge/transfer/cuda_ipc.py) and
reads --blocks of the owner's blocks into its own pool, one copy per run of blocks adjacent on both
sides. Patterns (seed 0): `scattered` and `pd8runs` draw local and remote ids independently with
transfer_bw.scattered_ids (contiguous fraction 0.5 and 0.97); `one_run` is one run on both sides.
Baselines, same run: `peer_copy`, torch copy_ of the same bytes cuda:1 -> cuda:0 within one process;
`one_range`, one cuMemcpyAsync of one contiguous range of the same size through the mapping.

Each method first runs once on a zeroed pool and its bytes are checked (all read blocks, nothing
else written); one that raises is reported with its error. Timed, interleaved: first enqueue until
both GPUs are synchronized; `issue_us` is the CPU time to enqueue. Mappings and address lists are outside.

    python benchmarks/ipc_copy_methods.py --json
    python benchmarks/ipc_copy_methods.py --json --isolated   # each process sees only its own GPU

--isolated gives owner and reader one GPU each (CUDA_VISIBLE_DEVICES): the mapping still works;
peer_copy and torch_copy_peer_ctx need both GPUs in one process and are skipped.

Measured on 2 x H200 (NVLink, NV18), torch 2.11+cu130, CUDA 13 driver, 512 MiB = 256 blocks of
2 MiB, medians of 15 reps, GB/s (ratio to peer_copy in the same run), 2026-11-29:

  GB/s                      scattered        pd8runs          one_run
  runs                      202              16               1
  torch_copy_peer_ctx        96.3 (0.26)     298.6 (0.79)     356.8 (0.95)  torch copy_ per run, mapping in the peer GPU's context (the first IPC path)
  cu_memcpy_1_stream        252.8 (0.67)     370.4 (0.98)     387.9 (1.03)  one cuMemcpyAsync per run
  cu_memcpy_4_streams       254.2 (0.68)     372.3 (0.99)     389.4 (1.03)  the same, round-robin over four streams
  cu_memcpy_batch_one_call  321.7 (0.86)     365.3 (0.97)     370.6 (0.98)  ONE cuMemcpyBatchAsync for all runs
  cu_memcpy_batch           372.9 (0.99)     376.8 (1.00)     381.2 (1.01)  batches of 16, 32, 64... copies: kvbridge's path (IpcCopier)
  triton_gather             332.3 (0.89)     336.9 (0.90)     338.5 (0.90)  a triton kernel copying whole blocks (uses SMs)
  torch_index               145.0 (0.39)     145.5 (0.39)     145.7 (0.39)  torch advanced indexing on a view of the mapping
  one_range (baseline)      384.8            385.7            385.8         one cuMemcpyAsync of one contiguous range
  peer_copy (baseline)      374.8            376.2            377.1

--isolated, in an earlier run (when the batch was still one call): one call 339.2, per run 254.1,
one_range 387.6 GB/s for `scattered`, against 323.9, 251.0 and 379.6 in that run's shared mode.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import statistics
import subprocess
import sys
import time

import msgspec
import numpy as np
from common import exit_if_missing, machine_info, versions
from transfer_bw import scattered_ids

from kvbridge.block_runs import run_starts
from kvbridge.transfer.cuda_driver import driver
from kvbridge.transfer.cuda_ipc import IpcMapping, export_tensor
from kvbridge.transfer.messages import IpcExport


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON object on one line")
    p.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB")
    p.add_argument("--blocks", type=int, default=256, help="blocks per read; each pool holds twice as many")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--isolated", action="store_true", help="owner and reader each see only their own GPU")
    p.add_argument("--owner", type=int, default=None, help=argparse.SUPPRESS)  # child mode: the owner's GPU
    return p.parse_args(argv)


def block_bytes(ids, block_nbytes: int, out=None):
    """The owner's contents of blocks `ids` (a CUDA tensor): [n, block_nbytes] uint8, varying per block and byte."""
    import torch

    inner = (torch.arange(block_nbytes, device=ids.device) % 251).to(torch.uint8)  # [B]
    return torch.add(inner[None, :], (ids % 251).to(torch.uint8)[:, None], out=out)  # [n, B], wraps mod 256


def serve_owner(args, block_nbytes: int) -> int:
    """Child: own the pool on GPU `args.owner`, print its IPC export as one JSON line, wait for stdin to close."""
    import torch

    torch.cuda.set_device(args.owner)
    pool = torch.empty(2 * args.blocks, block_nbytes, dtype=torch.uint8, device="cuda")  # [P, B]
    block_bytes(torch.arange(len(pool), device="cuda"), block_nbytes, out=pool)
    torch.cuda.synchronize()
    if (export := export_tensor(pool)) is None:
        sys.exit("owner: no CUDA IPC export of the pool (expandable_segments in PYTORCH_CUDA_ALLOC_CONF?)")
    print(msgspec.json.encode(export).decode(), flush=True)
    sys.stdin.read()
    return 0


def isolate(isolated: bool) -> tuple[dict, int]:
    """The owner's environment and GPU. Isolated: each process sees one GPU; call before CUDA starts."""
    if not isolated:
        return dict(os.environ), 1
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    if len(visible) < 2:
        raise SystemExit("--isolated needs two GPUs in CUDA_VISIBLE_DEVICES (e.g. 0,1)")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[0]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": visible[1]}, 0


def patterns(num_blocks: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(local ids, remote ids) per pattern, drawn in the experiment's order so its runs repeat."""
    rng, pool = np.random.default_rng(0), 2 * num_blocks
    out = {name: (scattered_ids(rng, num_blocks, pool, cf), scattered_ids(rng, num_blocks, pool, cf))
           for name, cf in (("scattered", 0.5), ("pd8runs", 0.97))}
    out["one_run"] = (np.arange(num_blocks) + min(100, num_blocks), np.arange(num_blocks) + min(37, num_blocks))
    return out


class DeviceBytes:
    """`nbytes` of device memory at `addr`; torch.as_tensor(DeviceBytes(...)) views it without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2}


def make_triton_gather():
    """(launch, triton version); launch(src, dst, src_ids, dst_ids) copies whole blocks src[src_ids[b]] ->
    dst[dst_ids[b]] of [P, W] int64 tensors. Without triton, launch raises the import error."""
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - triton is optional: the method reports why it is missing
        def unavailable(*_, error=e):
            raise error
        return unavailable, f"unavailable: {e!r}"

    @triton.jit
    def gather(src, dst, src_ids, dst_ids, block_words, CHUNK: tl.constexpr):
        src_block = tl.load(src_ids + tl.program_id(0))
        dst_block = tl.load(dst_ids + tl.program_id(0))
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        tl.store(dst + dst_block * block_words + offs, tl.load(src + src_block * block_words + offs))

    def launch(src, dst, src_ids, dst_ids, chunk=4096):  # blocks of a multiple of 32 KiB
        gather[len(src_ids), src.shape[1] // chunk](src, dst, src_ids, dst_ids, src.shape[1], CHUNK=chunk, num_warps=8)
    return launch, triton.__version__


def copy_methods(local, remote_addr, remote, peer_ctx_remote, lid, rid, streams, gather) -> dict:
    """Each way to read remote blocks `rid` into local blocks `lid`, as a function that enqueues the copy.
    local: [P, B] uint8; remote, peer_ctx_remote: [P, B] uint8 views of the mappings (the second may be None)."""
    import torch

    block_nbytes = local.shape[1]
    starts = run_starts(lid, rid)
    counts = np.diff(np.append(starts, len(lid)))  # [R] blocks per run
    dsts = (local.data_ptr() + lid[starts] * block_nbytes).astype(np.uint64)  # [R]
    srcs = (remote_addr + rid[starts] * block_nbytes).astype(np.uint64)  # [R]
    sizes = (counts * block_nbytes).astype(np.uint64)  # [R]
    copies = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist()))
    block_runs = list(zip(lid[starts].tolist(), rid[starts].tolist(), counts.tolist()))
    handles = [s.cuda_stream for s in streams]
    lidt, ridt = (torch.as_tensor(ids, device=local.device) for ids in (lid, rid))
    drv = driver()  # kvbridge's libcuda wrapper

    def memcpy_per_run(num_streams):
        def run():
            for i, (dst, src, size) in enumerate(copies):
                drv.memcpy_async(dst, src, size, handles[i % num_streams])
        return run

    def torch_copy_peer_ctx():
        with torch.cuda.stream(streams[0]):
            for lo, ro, n in block_runs:
                local[lo:lo + n].copy_(peer_ctx_remote[ro:ro + n], non_blocking=True)

    def torch_index():
        if remote.device != local.device:
            raise RuntimeError(f"torch sees the mapping on {remote.device}, not {local.device}")
        local[lidt] = remote[ridt]

    methods = {"torch_copy_peer_ctx": torch_copy_peer_ctx} if peer_ctx_remote is not None else {}
    return methods | {
        "cu_memcpy_1_stream": memcpy_per_run(1),
        "cu_memcpy_4_streams": memcpy_per_run(4),
        "cu_memcpy_batch_one_call": lambda: drv.copy(dsts, srcs, sizes, handles[0], local.device.index,
                                                     first_batch=None),
        "cu_memcpy_batch": lambda: drv.copy(dsts, srcs, sizes, handles[0], local.device.index),
        "triton_gather": lambda: gather(remote.view(torch.int64), local.view(torch.int64), ridt, lidt),
        "torch_index": torch_index,
    }


def sync_all() -> None:  # copies run between two GPUs: wait for all of them
    import torch

    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def check_and_time(fns: dict, checks: dict, reset, args, nbytes: int) -> dict[str, dict]:
    """Run each function once after `reset` and check its bytes (or keep the error it raised), then
    time those that ran, interleaved so that drift hits all alike. Per function: gbps (median),
    best_gbps, issue_us (median CPU time to enqueue) and ok; or its error."""
    status = {}
    for name, fn in fns.items():
        try:
            reset()  # zeroes the destinations and waits
            fn()
            sync_all()
            status[name] = {"ok": bool(checks[name]())}
        except Exception as e:  # noqa: BLE001 - a method that fails is a result, not the end of the run
            status[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    ran = {name: fn for name, fn in fns.items() if "ok" in status[name]}
    for _ in range(args.warmup):
        for fn in ran.values():
            fn()
    total, issue = {name: [] for name in ran}, {name: [] for name in ran}
    for _ in range(args.reps):
        for name, fn in ran.items():
            sync_all()
            t0 = time.perf_counter()
            fn()
            issue[name].append(time.perf_counter() - t0)
            sync_all()
            total[name].append(time.perf_counter() - t0)
    for name in ran:
        status[name] |= {"gbps": round(nbytes / statistics.median(total[name]) / 1e9, 1),
                         "best_gbps": round(nbytes / min(total[name]) / 1e9, 1),
                         "issue_us": round(statistics.median(issue[name]) * 1e6, 1)}
    return status


def is_read(local, lid, rid) -> bool:
    """Local blocks `lid` hold the owner's blocks `rid`, and every other local block is still zero."""
    import torch

    lidt, ridt = (torch.as_tensor(ids, device=local.device) for ids in (lid, rid))
    untouched = torch.ones(len(local), dtype=torch.bool, device=local.device)
    untouched[lidt] = False
    return torch.equal(local[lidt], block_bytes(ridt, local.shape[1])) and not local[untouched].any()


def run_patterns(args, export: IpcExport, mappings: list[IpcMapping], gather) -> dict:
    """Per pattern: each method and baseline checked and timed, with ratio_vs_peer_copy. mappings[0] is
    in the reader's context (kvbridge's); mappings[1], when there, in the owner GPU's (the old path)."""
    import torch

    n, block_nbytes = args.blocks, int(args.block_mib * 2**20)
    nbytes = n * block_nbytes
    views = [torch.as_tensor(DeviceBytes(m.addr, export.nbytes)).view(-1, block_nbytes) for m in mappings]  # [P, B]
    remote, peer_ctx_remote = views[0], (views[1] if len(views) > 1 else None)
    local = torch.zeros(2 * n, block_nbytes, dtype=torch.uint8, device="cuda:0")  # [P, B]
    streams = [torch.cuda.Stream(device=0) for _ in range(4)]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")  # [n * B], for the baselines
    expected = block_bytes(torch.arange(n, device="cuda:0"), block_nbytes).view(-1)  # owner blocks 0..n-1
    baselines = {"one_range": lambda: driver().memcpy_async(dst.data_ptr(), mappings[0].addr, nbytes, streams[0].cuda_stream)}
    if not args.isolated:
        src = expected.to("cuda:1")
        baselines["peer_copy"] = lambda: dst.copy_(src)

    def reset():  # zero every destination, then wait
        local.zero_()
        dst.zero_()
        sync_all()

    results = {}
    for name, (lid, rid) in patterns(n).items():
        methods = copy_methods(local, mappings[0].addr, remote, peer_ctx_remote, lid, rid, streams, gather)
        checks = dict.fromkeys(methods, functools.partial(is_read, local, lid, rid))
        checks |= dict.fromkeys(baselines, lambda: torch.equal(dst, expected))
        summary = check_and_time(methods | baselines, checks, reset, args, nbytes)
        peer = summary.get("peer_copy", {}).get("gbps")
        for figures in summary.values():
            if "gbps" in figures:
                figures["ratio_vs_peer_copy"] = round(figures["gbps"] / peer, 3) if peer else None
        results[name] = {"runs": len(run_starts(lid, rid)), "methods": {k: summary[k] for k in methods},
                         "baselines": {k: summary[k] for k in baselines}}
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.owner is not None:
        return serve_owner(args, int(args.block_mib * 2**20))
    owner_env, owner_gpu = isolate(args.isolated)
    import torch

    exit_if_missing("ipc_copy_methods", num_gpus_needed=1 if args.isolated else 2)
    gather, triton_version = make_triton_gather()
    cmd = [sys.executable, os.path.abspath(__file__), "--owner", str(owner_gpu),
           "--blocks", str(args.blocks), "--block-mib", str(args.block_mib)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=owner_env)
    mappings = []
    try:
        if not select.select([child.stdout], [], [], 120)[0] or not (line := child.stdout.readline()):
            raise SystemExit("the owner process exported nothing within 120 s; see its error above")
        export = msgspec.json.decode(line, type=IpcExport)
        torch.cuda.set_device(0)
        mappings.append(IpcMapping(export, torch.device("cuda:0")))
        if not args.isolated:  # the old path: the same memory also mapped in the owner GPU's context
            mappings.append(IpcMapping(export, torch.device("cuda:1")))
        results = run_patterns(args, export, mappings, gather)
    finally:
        if mappings:
            sync_all()  # nothing may still read a mapping when it is closed
        for mapping in mappings:
            mapping.close()
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
    result = {
        "patterns": results,
        "kvbridge_method": "cu_memcpy_batch",
        "baselines": "peer_copy: torch copy_ of the same bytes cuda:1 -> cuda:0 in one process (not with --isolated); "
                     "one_range: one cuMemcpyAsync of one contiguous range of the same bytes through the mapping",
        "memcpy_batch_in_driver": driver().memcpy_batch is not None,  # else cu_memcpy_batch is one call per run
        "bytes": args.blocks * int(args.block_mib * 2**20), "pool_blocks": 2 * args.blocks,
        "timing": "enqueue -> all GPUs synchronized; address lists and mappings outside; reps interleaved",
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "owner")},
        "machine": machine_info("cuda"),
        "versions": versions() | {"triton": triton_version},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
