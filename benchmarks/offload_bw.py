"""Offload copy bandwidth: scattered KV blocks GPU -> host (store), host -> GPU (load), both at once.

    python benchmarks/offload_bw.py --json                     # CUDA if present, else CPU
    python benchmarks/offload_bw.py --json --device cpu --num-blocks 32

Blocks have the 8B-like geometry (32 layers, 8 KV heads, head dim 128, 16-token blocks, bf16:
2 MiB per block). The GPU-side block ids are a random sample of the KV cache (scattered, random
order); the host slots are contiguous, as the offload scheduler allocates them. The copies go
through the OffloadingConnector's own copy engine (`kvbridge.connectors.offload.copier`).

Baseline, same run, same bytes: one contiguous pinned-memory copy (device -> pinned host) on CUDA,
and for both directions at once both copies on two streams (`baseline_bidir`);
on CPU the fastest of three contiguous copies between the same buffers, each with every core the
process may run on: torch's `copy_` on its intra-op threads (`baseline_torch`; set to that count,
as a user's copy would have them), and on one thread per core, the bytes cut into equal parts,
numpy's SIMD copy loop (`baseline_numpy`, the copier's own primitive) and libc's memmove
(`baseline_memmove`, `np.copyto`); the copier's CPU path uses as many copy threads. Fastest by
median for the ratios, by best repetition for `best_ratios`. For comparison, on CPU, the store as the copier did it before
2026-12-01 (`store_torch_copy_per_run`: one torch `copy_` per run, on one thread). Each figure: warm-up, then median and min time of `--reps`
repetitions; the repetitions of all cases are interleaved (store, load, both, baselines, store,
...), so a shared machine's load changes hit every case alike. GB/s = 1e9 bytes per second.
Index preparation is inside the timing.

On CUDA the copier moves these blocks (each one byte range: block-major) with one DMA per run and
no kernel (`cuda_ways.is_direct`); `store_staged` / `load_staged` are the same copies through the
staging buffer's gather and scatter kernels. `*_beside_compute` times a store from its hand-over to
its end while `--compute-matmuls` large matmuls run on another stream, queued right behind it, as the
next step's forward pass follows a store inside an engine; each against one contiguous copy beside
the same matmuls (`cuda_ways.beside_compute`): a copy that needs SMs waits for them there.

Verification (the OffloadingConnector's `verify_kv_digest`, on by default): `store_verified` and
`load_verified` are the same copies by a copier that also digests the KV-cache side of each copy
(as the connector's worker does: fused into the copy on CPU, queued behind it on the GPU);
`verify_cost` is the fraction of the plain copy's bandwidth that costs, same run, interleaved.
On CPU `digest_alone` digests the store's blocks without copying them, on as many threads as the
copier, and `verified_serial_bound` is the fraction of the plain copy's bandwidth a copy that
digests after copying would keep (1 / (1 / copy + 1 / digest), over copy): below it, the fused copy
loses more than the hash's own time; above it, it hides part of the hash under the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from common import exit_if_missing, machine_info, versions

from functools import partial

from kvbridge.block_runs import paired_runs
from kvbridge.connectors.offload.copier import make_copier
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import BlockDigester, algorithm_for, region_bytes


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_interleaved(cases: dict, device: str, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per repetition of each case; repetition k of every case runs before repetition k+1 of any."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
            sync(device)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            sync(device)
            start = time.perf_counter()
            own_s = fn()  # a case that times itself returns its seconds
            sync(device)
            times[name].append(own_s if own_s is not None else time.perf_counter() - start)
    return times


def summarize(times: list[float], nbytes: int) -> dict:
    median, best = statistics.median(times), min(times)
    return {"gbps": nbytes / median / 1e9, "best_gbps": nbytes / best / 1e9, "median_s": median, "min_s": best}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per transfer (default 256 GPU, 32 CPU)")
    parser.add_argument("--kv-blocks", type=int, default=None, help="blocks in the KV cache (default 4x)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--staging-blocks", type=int, default=64)
    parser.add_argument("--compute-matmuls", type=int, default=40,
                        help="CUDA: 8192^2 bf16 matmuls queued beside the *_beside_compute copies (~1.1 ms each on an H200)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    exit_if_missing("offload_bw", args.device)

    is_cuda = args.device.startswith("cuda")
    num_cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(num_cores)  # the baseline copy gets the whole machine, like the copier
    n = args.num_blocks or (256 if is_cuda else 32)
    kv_blocks = args.kv_blocks or 4 * n
    layout = KVCacheLayout(kv_blocks, args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype)
    dtype = getattr(torch, args.dtype)
    kv = torch.zeros(layout.shape, dtype=dtype, device=args.device)  # [kv_blocks, L, 2, bs, H, D]
    host = torch.zeros((2 * n, *layout.block_shape), dtype=dtype, pin_memory=is_cuda)  # [2n, L, 2, bs, H, D]
    rng = random.Random(args.seed)
    ids = rng.sample(range(kv_blocks), 2 * n)
    store_ids, load_ids = ids[:n], ids[n:]
    copier = make_copier(kv, host, args.staging_blocks)
    copier_is_direct = getattr(copier, "is_direct", None)
    digest = BlockDigester(region_bytes(kv, layout), layout, algorithm_for(kv))  # as the connector's worker has it
    verifying = make_copier(kv, host, args.staging_blocks, digest=digest)
    nbytes = n * layout.block_nbytes

    def store() -> None:
        assert copier.store(store_ids, list(range(n))).wait(600)

    def load() -> None:
        assert copier.load(list(range(n, 2 * n)), load_ids).wait(600)

    def store_verified() -> None:
        handle = verifying.store(store_ids, list(range(n)))
        assert handle.wait(600) and len(handle.digests()) == n

    def load_verified() -> None:
        handle = verifying.load(list(range(n, 2 * n)), load_ids)
        assert handle.wait(600) and len(handle.digests()) == n

    def bidir() -> None:
        handles = [copier.store(store_ids, list(range(n))), copier.load(list(range(n, 2 * n)), load_ids)]
        assert all(h.wait(600) for h in handles)

    flat_dev = kv[:n]  # contiguous source of the same bytes
    flat_host = host[:n]

    def baseline() -> None:  # device -> pinned host, one contiguous copy: the store's physical limit
        flat_host.copy_(flat_dev, non_blocking=is_cuda)

    def baseline_load() -> None:  # pinned host -> device: the load's physical limit
        flat_dev.copy_(flat_host, non_blocking=is_cuda)

    load_before = os.getloadavg()
    cases = {"store": store, "load": load, "bidir": bidir, "baseline": baseline, "baseline_load": baseline_load,
             "store_verified": store_verified, "load_verified": load_verified}  # fmt: skip
    if not is_cuda:  # the same contiguous copies by numpy's SIMD loop, one thread per core
        split_pool = ThreadPoolExecutor(max(1, num_cores - 1))
        dev_bytes, host_bytes = (t.view(torch.uint8).numpy() for t in (flat_dev, flat_host))  # [n, L, ..] uint8

        def split_copy(dst: np.ndarray, src: np.ndarray, copy=lambda d, s: np.positive(s, out=d)) -> None:
            (d0, s0), *others = zip(np.array_split(dst, num_cores), np.array_split(src, num_cores))
            futures = [split_pool.submit(copy, d, s) for d, s in others]
            copy(d0, s0)
            for future in futures:
                future.result()

        cases["baseline_numpy"] = partial(split_copy, host_bytes, dev_bytes)
        cases["baseline_numpy_load"] = partial(split_copy, dev_bytes, host_bytes)
        cases["baseline_memmove"] = partial(split_copy, host_bytes, dev_bytes, copy=np.copyto)  # libc memmove
        cases["baseline_memmove_load"] = partial(split_copy, dev_bytes, host_bytes, copy=np.copyto)

        def digest_alone() -> None:  # the store's digests without its copy, on as many threads
            first, *others = (part.tolist() for part in np.array_split(store_ids, num_cores))
            futures = [split_pool.submit(lambda ids: digest(ids).result(), ids) for ids in others]
            assert len(digest(first).result().values) == len(first)
            for future in futures:
                future.result()

        cases["digest_alone"] = digest_alone
    if not is_cuda:  # the copier's CPU path before 2026-12-01: one torch copy_ per run, on one thread
        one_thread = ThreadPoolExecutor(1)
        store_runs = paired_runs(store_ids, list(range(n)))

        def store_torch_copy_per_run() -> None:
            def job() -> None:
                for src, dst, num in store_runs:
                    host[dst : dst + num].copy_(kv[src : src + num])

            one_thread.submit(job).result()

        cases["store_torch_copy_per_run"] = store_torch_copy_per_run
    if is_cuda:
        streams = torch.cuda.Stream(args.device), torch.cuda.Stream(args.device)
        other_dev, other_host = kv[n : 2 * n], host[n : 2 * n]

        def baseline_bidir() -> None:  # both contiguous copies at once, one stream each: both ways' limit
            with torch.cuda.stream(streams[0]):
                flat_host.copy_(flat_dev, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                other_dev.copy_(other_host, non_blocking=True)

        cases["baseline_bidir"] = baseline_bidir
        # The copier's two ways on the same blocks (the default is direct: these blocks are each one byte range)
        staged = make_copier(kv, host, args.staging_blocks, direct=False)
        cases["store_staged"] = lambda: staged.store(store_ids, list(range(n))).wait(600) or None
        cases["load_staged"] = lambda: staged.load(list(range(n, 2 * n)), load_ids).wait(600) or None
        # ... and beside a forward pass: matmuls filling every SM on another stream, queued right behind
        # the copy (as the next step's forward follows a store), for longer than the copy takes. The
        # copy's time is from its hand-over until its waiter sees it end.
        compute = torch.cuda.Stream(args.device)
        a = torch.randn((8192, 8192), dtype=torch.bfloat16, device=args.device)
        c = torch.empty_like(a)

        def beside_compute(submit):
            def case() -> float:
                start = time.perf_counter()
                handle = submit()
                with torch.cuda.stream(compute):
                    for _ in range(args.compute_matmuls):
                        torch.mm(a, a, out=c)
                assert handle.wait(600)
                return time.perf_counter() - start

            return case

        class _EventHandle:  # the baseline's copy, waited for like a copier's
            def __init__(self, event: torch.cuda.Event) -> None:
                self.event = event

            def wait(self, timeout_s: float) -> bool:
                while not self.event.query():
                    time.sleep(20e-6)
                return True

        side = torch.cuda.Stream(args.device)

        def baseline_submit() -> _EventHandle:
            with torch.cuda.stream(side):
                flat_host.copy_(flat_dev, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            return _EventHandle(done)

        cases["store_beside_compute"] = beside_compute(lambda: copier.store(store_ids, list(range(n))))
        cases["store_verified_beside_compute"] = beside_compute(lambda: verifying.store(store_ids, list(range(n))))
        cases["store_staged_beside_compute"] = beside_compute(lambda: staged.store(store_ids, list(range(n))))
        cases["baseline_beside_compute"] = beside_compute(baseline_submit)
    times = time_interleaved(cases, args.device, args.reps, args.warmup)
    results = {name: summarize(t, 2 * nbytes if "bidir" in name else nbytes) for name, t in times.items()}
    copier.close()
    verifying.close()
    if is_cuda:
        staged.close()
    if not is_cuda:  # the strongest primitive of each direction is its baseline: by median, and by best
        for way, suffix in (("baseline", ""), ("baseline_load", "_load")):
            results[f"{way}_torch"] = results[way]
            ways = [results[f"{way}_torch"], results[f"baseline_numpy{suffix}"], results[f"baseline_memmove{suffix}"]]
            results[way] = {"gbps": max(w["gbps"] for w in ways), "best_gbps": max(w["best_gbps"] for w in ways)}
    base, base_load = results["baseline"]["gbps"], results["baseline_load"]["gbps"]
    report = {
        "benchmark": "offload_bw",
        "store_gbps": results["store"]["gbps"],
        "load_gbps": results["load"]["gbps"],
        "bidir_gbps": results["bidir"]["gbps"],
        "baseline_gbps": base,  # device -> host
        "baseline_load_gbps": base_load,  # host -> device
        "store_ratio": results["store"]["gbps"] / base,
        "load_ratio": results["load"]["gbps"] / base_load,
        "bidir_ratio": results["bidir"]["gbps"] / max(base, base_load),
        "store_verified_gbps": results["store_verified"]["gbps"],
        "load_verified_gbps": results["load_verified"]["gbps"],
        # what digesting every block costs the copy (verify_kv_digest): 1 - verified / plain, same run
        "verify_cost": {d: 1 - results[f"{d}_verified"]["gbps"] / results[d]["gbps"] for d in ("store", "load")},
        # CPU: the digest's own rate on the copy threads' count of threads, and what a copy that
        # digests after copying (nothing overlapped) would reach: 1 / (1 / copy + 1 / digest)
        "digest_alone_gbps": None if is_cuda else results["digest_alone"]["gbps"],
        "verified_serial_bound": None if is_cuda else {
            d: 1 / (1 / results[d]["gbps"] + 1 / results["digest_alone"]["gbps"]) / results[d]["gbps"] for d in ("store", "load")
        },  # fmt: skip
        "store_torch_copy_per_run_ratio": (
            None if is_cuda else results["store_torch_copy_per_run"]["gbps"] / base
        ),  # the old CPU path, same run
        "baseline_bidir_gbps": results["baseline_bidir"]["gbps"] if is_cuda else None,
        # CUDA: the copier's default (direct DMAs, blocks being one byte range each) against staging
        # through gather/scatter kernels, alone and beside a forward pass's worth of matmuls, each
        # against one contiguous copy beside the same matmuls
        "cuda_ways": None if not is_cuda else {
            "is_direct": copier_is_direct,
            "store_staged_ratio": results["store_staged"]["gbps"] / base,
            "load_staged_ratio": results["load_staged"]["gbps"] / base_load,
            "beside_compute": {
                name: results[f"{name}_beside_compute"]["gbps"] / results["baseline_beside_compute"]["gbps"]
                for name in ("store", "store_verified", "store_staged")
            },
            "baseline_beside_compute_gbps": results["baseline_beside_compute"]["gbps"],
            "compute_matmuls": args.compute_matmuls,
        },  # fmt: skip
        "bidir_vs_baseline_bidir": results["bidir"]["gbps"] / results["baseline_bidir"]["gbps"] if is_cuda else None,
        # the same ratios from each case's fastest repetition: what a shared machine's load hides least
        "best_ratios": {
            "store": results["store"]["best_gbps"] / results["baseline"]["best_gbps"],
            "load": results["load"]["best_gbps"] / results["baseline_load"]["best_gbps"],
            "bidir": results["bidir"]["best_gbps"] / max(results["baseline"]["best_gbps"], results["baseline_load"]["best_gbps"]),
        },
        "details": results,
        "baseline": ("one contiguous copy of the same bytes, device->pinned host (store) and pinned host->device (load)"
                     if is_cuda else f"the fastest of torch copy_, numpy's copy loop and memmove, contiguous, same bytes, "
                     f"each way, on {num_cores} threads"),
        "copy_threads": getattr(copier, "num_threads", None),
        "load_avg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "params": {
            "num_blocks": n, "kv_blocks": kv_blocks, "block_nbytes": layout.block_nbytes, "bytes_per_transfer": nbytes,
            "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "block_size": args.block_size, "dtype": args.dtype, "staging_blocks": args.staging_blocks,
            "reps": args.reps, "warmup": args.warmup, "seed": args.seed,
        },  # fmt: skip
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key in ("store", "load", "bidir", "baseline"):
            print(f"{key:9s} {report[key + '_gbps']:8.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
