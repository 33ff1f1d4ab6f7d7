"""How long the layout translator takes to plan one engine-to-engine read (transfer/layout_plan.py).

    python benchmarks/plan_time.py                       # Llama-8B shapes, 4,096 tokens, every format pair
    python benchmarks/plan_time.py --tokens 128 --pairs 2NHD:H2ND-KT

Shapes default to Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16) with 16-token blocks
on both sides: the prefill block-major (kvbridge's engine), the decode layer-major (vLLM's CPU
placement). Each pair prints the best of `--reps` plans (a shared machine slows some), the plan's
summary and, for a staged plan, how many token chunks its gather indexes; a plan over
`layout_plan.MAX_PLAN_ENTRIES` prints the refusal instead.
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


if __name__ == "__main__":
    main()
