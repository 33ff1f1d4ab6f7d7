"""How long the layout translator takes to plan one engine-to-engine read (transfer/layout_plan.py).

    python benchmarks/plan_time.py                       # Llama-8B shapes, 4,096 tokens, every format pair
    python benchmarks/plan_time.py --tokens 128 --pairs 2NHD:H2ND-KT
    python benchmarks/plan_time.py --gather cuda         # and the staged plans' gather pass, on a device

Shapes default to Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16) with 16-token blocks
on both sides: the prefill block-major (kvbridge's engine), the decode layer-major (vLLM's CPU
placement). Each pair prints the best of `--reps` plans (a shared machine slows some), the plan's
summary and, for a staged plan, how many token chunks its gather indexes; a plan over
`layout_plan.MAX_PLAN_ENTRIES` prints the refusal instead. `--gather DEVICE` also times the staged
plans' gather (`layout_gather.apply_gather`, best of `--reps`) from a staging buffer into a decode
region on that device, and prints GB/s of staged bytes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvbridge.errors import PlanTooLargeError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.layout_plan import plan_engine_read

PAIRS = ("2NHD:2NHD", "2NHD:H2ND", "H2ND:2NHD", "2NHD:2HND", "2NHD:H2ND-KT", "H2ND-KT:2NHD")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="PREFILL:DECODE page formats")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gather", metavar="DEVICE", help="time the gather pass too, on this torch device")
    args = parser.parse_args()
    num_blocks = -(-args.tokens // args.block_size)
    ids = np.arange(num_blocks)
    for pair in args.pairs:
        prefill_format, decode_format = pair.split(":")
        geometry = dict(num_blocks=num_blocks, num_layers=args.layers, block_size=args.block_size,
                        num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")  # fmt: skip
        prefill = KVCacheLayout(**geometry, page_format=prefill_format)
        page = prefill.page_nbytes
        decode = KVCacheLayout(**geometry, page_format=decode_format, layer_stride=num_blocks * page, block_stride=page)
        times = []
        try:
            for _ in range(args.reps):
                start = time.perf_counter()
                plan = plan_engine_read(decode, prefill, ids, ids)
                times.append(time.perf_counter() - start)
        except PlanTooLargeError as exc:
            print(f"{pair}: refused: {str(exc)[:160]}...")
            continue
        chunks = f", {plan.gather.num_indices} token chunks indexed" if plan.gather is not None else ""
        print(f"{pair}: {min(times) * 1e3:.2f} ms (best of {args.reps}); {plan.summary()}{chunks}")
        if args.gather and plan.gather is not None:
            seconds = _gather_seconds(plan, decode, args.gather, args.reps)
            print(f"{pair}: gather {seconds * 1e3:.1f} ms on {args.gather} ({plan.staging_nbytes / seconds / 1e9:.1f} GB/s)")


def _gather_seconds(plan, decode: KVCacheLayout, device: str, reps: int) -> float:
    """Best of `reps` gathers of the plan from a random staging buffer into a zeroed decode region."""
    import torch

    from kvbridge.transfer.layout_gather import GatherIndex, apply_gather

    staging = torch.randint(0, 256, (plan.staging_nbytes,), dtype=torch.uint8).to(device)
    region = torch.zeros(decode.region_nbytes, dtype=torch.uint8, device=device)
    index = GatherIndex.of(plan.gather, device)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        apply_gather(index, staging, region)
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    main()
