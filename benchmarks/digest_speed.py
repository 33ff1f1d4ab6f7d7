"""How fast a lease's blocks are digested (transfer/digest.py), against a copy of the same bytes.

    python3 benchmarks/digest_speed.py --json                      # GPU: wsum64, kernel and torch paths
    python3 benchmarks/digest_speed.py --json --device cpu          # host memory: xxh3-64

A KV cache of Llama-3-8B's geometry (32 layers, 8 KV heads of 128, bf16, 16-token blocks) with
`--num-blocks` blocks; the lease is `--lease-blocks` blocks (256: a 4,096-token prompt, 512 MiB),
taken every other block so that nothing coalesces. Each way is timed from the call to the digests on
the host (what a grant or a read's check waits for), median and min of `--reps` after a warm-up.
The baseline is the device's own copy of the same number of bytes (`copy_` between two buffers,
CUDA events): a digest reads each byte once, a copy reads and writes it, so a digest at memory speed
reaches at least 1x the copy's GB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, versions  # noqa: E402

from kvbridge.layout import KVCacheLayout  # noqa: E402
from kvbridge.transfer.digest import WSUM, XXH3, DigestJob, _wsum, block_digests, region_bytes  # noqa: E402

GEOMETRY = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def timed(fn, reps: int, sync) -> dict:
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def copy_gbps(nbytes: int, device: str, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device == "cpu":
        t = timed(lambda: dst.copy_(src), reps, lambda: None)
        return nbytes / t["median_s"] / 1e9
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--lease-blocks", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    layout = KVCacheLayout(**GEOMETRY, num_blocks=args.num_blocks)
    kv = torch.randint(-128, 128, (layout.region_nbytes,), dtype=torch.int8, device=args.device).view(torch.bfloat16)
    region = region_bytes(torch.as_strided(kv, layout.shape, layout.strides), layout)
    ids = np.arange(0, 2 * args.lease_blocks, 2, dtype=np.int64) % args.num_blocks
    nbytes = len(ids) * layout.block_nbytes
    ways: dict[str, dict] = {}
    if args.device == "cpu":
        ways[XXH3] = timed(lambda: block_digests(region, layout, ids, XXH3), args.reps, lambda: None)
    else:
        sync = torch.cuda.synchronize
        for name, use_kernel in (("wsum64_kernel", True), ("wsum64_torch", False)):
            ways[name] = timed(lambda u=use_kernel: DigestJob(WSUM, sums=_wsum(region, layout, ids, u)).result(),
                               args.reps, sync)  # fmt: skip
        kernel = DigestJob(WSUM, sums=_wsum(region, layout, ids, True)).result()
        assert kernel == DigestJob(WSUM, sums=_wsum(region, layout, ids, False)).result(), "the two paths disagree"
    copy = copy_gbps(nbytes, args.device, args.reps)
    for way in ways.values():
        way["gb_per_s"] = nbytes / way["median_s"] / 1e9
        way["vs_copy"] = way["gb_per_s"] / copy
    report = {
        "benchmark": "digest_speed",
        "digest_gbps": {name: w["gb_per_s"] for name, w in ways.items()},
        "digest_ms": {name: w["median_s"] * 1e3 for name, w in ways.items()},
        "copy_gbps": copy,
        "ways": ways,
        "lease_nbytes": nbytes,
        "params": vars(args) | {"geometry": GEOMETRY},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
