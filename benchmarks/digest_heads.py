"""What a lease's per-head digests cost beside its blocks' digests (transfer/head_digests.py).

    python3 benchmarks/digest_heads.py --json                    # CPU: wsum64 (torch path) and xxh3-64
    python3 benchmarks/digest_heads.py --json --device cuda      # GPU: wsum64, kernel and torch paths

A KV cache of Llama-3-8B's geometry (32 layers, 8 KV heads of 128, bf16, 16-token blocks); the lease
is `--lease-blocks` blocks taken every other block (nothing coalesces). For each algorithm and path,
the blocks' digests alone (what a lease costs with `digest_kv_heads` off) and the blocks' digests with
every head's (on, the default), median of `--reps` after a warm-up, each timed to the digests on the
host. `heads_vs_blocks` is the ratio: wsum64 splits its one pass by head, so it stays near 1; xxh3-64
hashes each head again through a head-major copy of the blocks.
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
from kvbridge.transfer import digest as d  # noqa: E402
from kvbridge.transfer import head_digests as hd  # noqa: E402

GEOMETRY = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def median_s(fn, reps: int, sync) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lease-blocks", type=int, default=16)  # 16 blocks: 32 MiB
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    layout = KVCacheLayout(**GEOMETRY, num_blocks=2 * args.lease_blocks)
    kv = torch.randint(-128, 128, (layout.region_nbytes,), dtype=torch.int8, device=args.device).view(torch.bfloat16)
    region = d.region_bytes(torch.as_strided(kv, layout.shape, layout.strides), layout)
    ids = np.arange(0, 2 * args.lease_blocks, 2, dtype=np.int64)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    ways = {}
    paths = [("wsum64_kernel", True), ("wsum64_torch", False)] if args.device.startswith("cuda") else [("wsum64_torch", False)]
    for name, use_kernel in paths:
        blocks = median_s(lambda u=use_kernel: d._wsum(region, layout, ids, u).tolist(), args.reps, sync)
        heads = median_s(lambda u=use_kernel: hd._wsum_heads(region, layout, ids, u).tolist(), args.reps, sync)
        split = hd._wsum_heads(region, layout, ids, use_kernel).sum(dim=1)
        assert torch.equal(split.cpu(), d._wsum(region, layout, ids, use_kernel).cpu()), "the heads do not add up"
        ways[name] = {"blocks_ms": blocks * 1e3, "blocks_and_heads_ms": heads * 1e3}
    if not args.device.startswith("cuda"):
        blocks = median_s(lambda: d.block_digests(region, layout, ids, d.XXH3), args.reps, sync)
        heads = median_s(lambda: hd.lease_digests(region, layout, ids, d.XXH3), args.reps, sync)
        ways["xxh3-64"] = {"blocks_ms": blocks * 1e3, "blocks_and_heads_ms": heads * 1e3}
    for way in ways.values():
        way["heads_vs_blocks"] = way["blocks_and_heads_ms"] / way["blocks_ms"]
    report = {
        "benchmark": "digest_heads",
        "heads_vs_blocks": {name: w["heads_vs_blocks"] for name, w in ways.items()},
        "blocks_ms": {name: w["blocks_ms"] for name, w in ways.items()},
        "blocks_and_heads_ms": {name: w["blocks_and_heads_ms"] for name, w in ways.items()},
        "lease_nbytes": len(ids) * layout.block_nbytes,
        "params": vars(args) | {"geometry": GEOMETRY, "torch_threads": torch.get_num_threads()},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
