"""P/D disaggregation: KV transfer throughput and time to first token, against baselines in the same run.

A prefill engine runs in a child process (on --prefill-device), the decode engine in this one
(on --decode-device), both with the NixlConnector. For each repetition a fresh random prompt of
--prompt-len tokens is

  1. computed by the decode engine itself, no connector involved: the colocated TTFT (baseline);
  2. prefilled remotely, then pulled by the decode engine over NIXL: the P/D TTFT is the prefill's
     time plus the decode's time from admission to first token (read + the last token's forward).

Digest cost: with verify_kv_digest (the default; --no-verify-kv-digest turns it off on both engines)
the decode engine digests every block it read before using it (transfer/digest.py); `digest_ms` is
that time per read, beside `transfer_ms`, and `digest_vs_transfer` their ratio. The prefill digests
the same bytes with the same function when it grants the lease (inside `prefill_s`). To tell the hash
from the read path apart, `digest_alone_gbps` is the same digest of as many blocks of a KV cache of
the decode's layout, on the decode device, with nothing else running in this process (caches
flushed first on CPU: the bytes of a read arrive from another process); `digest_vs_transfer` cannot
fall below `kvbridge_transfer_gbps / digest_alone_gbps` on this machine.

Transfer throughput is the NixlConnector's own per-read figure (bytes / time from posting the read
to its completion; the handshake is done during warm-up and is not inside). Its baseline is a raw
copy of the same bytes: cuda:0 -> cuda:1 peer copy on GPUs, a memcpy on CPU.

Block sizes: --prefill-block-size and --decode-block-size (default 16 both). When they differ the
decode reads through a read plan (kvbridge/transfer/layout_plan.py): a STAGED read into a staging
buffer and one gather pass into its pages, both inside `transfer_ms`; `plan` says which plan kind
the reads took and their descriptors per read.

Tensor parallelism: --prefill-tp N and --decode-tp M (default 1 both) run each engine with that many
ranks, each rank registering its own KV heads; a decode rank reads the heads it needs from the
prefill ranks that hold them (one NIXL transfer per prefill rank under one read). The transfer
figures, bytes and descriptors are the decode's rank 0's (at --decode-tp 1: the whole read);
`descriptors_per_request` is what one request's read posted on that rank.

    python benchmarks/pd_transfer.py --json                                   # CPU, tiny model
    python benchmarks/pd_transfer.py --json --prefill-tp 2 --prompt-len 4096  # CPU, TP 2 -> 1
    python benchmarks/pd_transfer.py --json --decode-block-size 32            # CPU, through a staged plan
    python benchmarks/pd_transfer.py --json --model kv8b --dtype bfloat16 \\
        --prefill-device cuda:0 --decode-device cuda:1 --prompt-len 4096       # 2 GPUs, 512 MiB of KV
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time

from common import exit_if_missing, machine_info, versions

from kvbridge.transfer.progress import Backoff


def _engine_kwargs(args, device: str, role: str, engine_id: str) -> dict:
    block_size = args.prefill_block_size if role == "kv_producer" else args.decode_block_size
    tp = args.prefill_tp if role == "kv_producer" else args.decode_tp
    num_blocks = 2 * (args.prompt_len // block_size + 2) * (args.reps + 2)
    return dict(
        model=args.model, dtype=args.dtype, device=device, num_blocks=num_blocks, block_size=block_size,
        tensor_parallel_size=tp,
        max_num_batched_tokens=max(2048, args.prompt_len), max_model_len=args.prompt_len + 64,
        kv_transfer_config=dict(connector="NixlConnector", role=role, engine_id=engine_id,
                                extra={"descriptor_mode": args.descriptor_mode, "cuda_ipc": args.cuda_ipc,
                                       "ipc_min_runs": args.ipc_min_runs, "verify_kv_digest": args.verify_kv_digest,
                                       "sign_grants": args.sign_grants,
                                       "backend_params": dict(kv.split("=", 1) for kv in args.backend_param)}),
    )


def _prefill_main(conn, kwargs: dict) -> None:
    from kvbridge import LLM, SamplingParams

    llm = LLM(**kwargs)
    conn.send("ready")
    while True:
        if conn.poll(0.0005):
            msg = conn.recv()
            if msg is None:
                break
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": msg}], SamplingParams(max_tokens=1, temperature=0),
                               kv_transfer_params=[{"do_remote_decode": True}])[0]
            conn.send((time.perf_counter() - start, out.kv_transfer_params))
        elif llm.engine.has_pending_transfers():
            llm.engine.step()
    llm.shutdown()


def _ttft(llm, prompt: list[int], params: dict | None) -> tuple[float, float, int]:
    """Admission to first token: (admitted, first token) on time.monotonic (the connector's clock)
    and the request's external tokens. The engine is driven as the serving loop drives it: a step
    that computed nothing is followed by the engine's idle wait (a backoff up to 2 ms that a
    connector's answer cuts short). Stepping back to back instead would hold the GIL, and the
    side-channel threads that confirm the read would wait 5 ms (the interpreter's switch interval)
    for it twice per read."""
    from kvbridge import SamplingParams

    engine = llm.engine
    req_id = f"ttft-{time.perf_counter_ns()}"
    start = time.monotonic()
    engine.add_request(req_id, prompt, SamplingParams(max_tokens=1, temperature=0), params)
    backoff = Backoff()
    while True:
        for out in engine.step():
            if out.request_id == req_id and out.finished:
                assert out.error is None, out.error
                return start, time.monotonic(), out.num_external_tokens
        if engine.is_idle:
            engine.wait_for_work(backoff.next_s())
        else:
            backoff.reset()


def _copy_baseline_gbps(nbytes: int, src_device: str, dst_device: str, reps: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=src_device)  # touched: no page faults inside the clock
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_device)
    times = []
    for _ in range(reps + 2):
        if dst.is_cuda:
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
        start = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
            torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - start)
    return nbytes / min(times[2:]) / 1e9


def _plan_summary(worker_stats: dict) -> dict:
    direct, staged = worker_stats.get("num_direct_plan_reads", 0), worker_stats.get("num_staged_plan_reads", 0)
    if not direct + staged:
        return {"kind": "none (same pages on both sides)"}
    kind = "staged" if staged and not direct else "direct" if direct and not staged else "mixed"
    return {"kind": kind, "descriptors_per_read": worker_stats["num_plan_descriptors"] / (direct + staged)}


def _digest_alone_gbps(layout, num_blocks: int, device: str, reps: int) -> float:
    """transfer/digest.py's digest of `num_blocks` adjacent blocks, alone: bytes / median time."""
    import numpy as np
    import torch

    from kvbridge.transfer.digest import algorithm_for, block_digests, region_bytes

    kv = torch.ones(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
    region, alg = region_bytes(kv, layout), algorithm_for(kv)
    flush = None if kv.is_cuda else np.ones(256 << 20, dtype=np.uint8)  # larger than any CPU cache
    times = []
    for rep in range(reps + 2):
        first = rep * num_blocks % max(1, layout.num_blocks - num_blocks)
        if flush is not None:
            flush[:] = rep
        else:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        block_digests(region, layout, range(first, first + num_blocks), alg)  # waits for the device
        times.append(time.perf_counter() - start)
    return num_blocks * layout.block_nbytes / statistics.median(times[2:]) / 1e9


def run(args) -> dict:
    from kvbridge import LLM

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(child, _engine_kwargs(args, args.prefill_device, "kv_producer", "bench-prefill")), daemon=True)
    proc.start()
    rng = random.Random(args.seed)
    try:
        if not conn.poll(600):
            raise TimeoutError("prefill process did not start within 600 s")
        conn.recv()
        dec = LLM(**_engine_kwargs(args, args.decode_device, "kv_consumer", "bench-decode"))
        block_nbytes = dec.engine.layout.block_nbytes
        transfers = dec.engine.worker_connector.worker.stats
        rows = []
        for rep in range(args.warmup + args.reps):
            prompt = [rng.randrange(3, 250) for _ in range(args.prompt_len)]
            start, end, _ = _ttft(dec, prompt, None)
            colocated_s = end - start
            start, end, _ = _ttft(dec, prompt, None)  # every block cached: one token's forward
            cached_s = end - start
            dec.reset_prefix_cache()
            conn.send(prompt)
            prefill_s, params = conn.recv()
            params = dict(params, do_remote_prefill=True)
            admitted, first_token, num_external = _ttft(dec, prompt, params)
            read = transfers.last_read  # this request's read: posted -> landed -> lease confirmed
            digest_s, transfers.last_digest_s = transfers.last_digest_s, None  # this read's digest, if verified
            nbytes = transfers.recent()[-1][2]
            dec.reset_prefix_cache()
            if rep < args.warmup:
                continue
            assert nbytes == num_external // args.decode_block_size * block_nbytes
            if args.prefill_block_size == args.decode_block_size:
                assert nbytes == len(params["remote_block_ids"]) * block_nbytes
            assert admitted <= read.posted <= read.landed <= read.confirmed <= first_token
            rows.append({
                "colocated_ttft_s": colocated_s, "cached_ttft_s": cached_s, "prefill_s": prefill_s,
                "decode_ttft_s": first_token - admitted, "transfer_s": read.landed - read.posted, "nbytes": nbytes,
                "digest_s": digest_s or 0.0,
                # where the decode node's time to first token goes
                "until_posted_s": read.posted - admitted, "confirm_s": read.confirmed - read.landed,
                "after_confirmed_s": first_token - read.confirmed,
            })  # fmt: skip
        worker_stats = dec.get_stats()["connector"]["worker"]
        early_steps_used = dec.get_stats().get("num_early_steps_used", 0)
        layout = dec.engine.layout
        dec.shutdown()
    finally:
        conn.send(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()

    nbytes = rows[0]["nbytes"]
    baseline = _copy_baseline_gbps(nbytes, args.prefill_device, args.decode_device, args.reps)
    digest_alone = _digest_alone_gbps(layout, nbytes // layout.block_nbytes, args.decode_device, args.reps)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    transfer_gbps = nbytes / med("transfer_s") / 1e9
    pd_ttft = [r["prefill_s"] + r["decode_ttft_s"] for r in rows]
    return {
        "benchmark": "pd_transfer",
        "kvbridge_transfer_gbps": transfer_gbps,
        "baseline_gbps": baseline,
        "baseline": "raw peer copy of the same bytes" if args.decode_device.startswith("cuda") else "memcpy of the same bytes",
        "ratio": transfer_gbps / baseline,
        "kvbridge_transfer_gbps_best": nbytes / min(r["transfer_s"] for r in rows) / 1e9,
        "transfer_ms": {"median": med("transfer_s") * 1e3, "min": min(r["transfer_s"] for r in rows) * 1e3},
        "bytes_per_request": nbytes,
        # reads between different block sizes go through a read plan: its kind and descriptors per read
        "plan": _plan_summary(worker_stats),
        # descriptors one request's read posted (decode rank 0), warm-up reads included
        "descriptors_per_request": worker_stats["num_descriptors"] / max(1, worker_stats["num_transfers"]),
        # the decode's digest of the bytes it read (0 with --no-verify-kv-digest), beside the transfer
        "digest_ms": {"median": med("digest_s") * 1e3, "min": min(r["digest_s"] for r in rows) * 1e3},
        "digest_vs_transfer": med("digest_s") / med("transfer_s"),
        "digest_gbps": nbytes / med("digest_s") / 1e9 if med("digest_s") > 0 else 0.0,
        "digest_alone_gbps": digest_alone,  # the same digest with nothing else running (see the docstring)
        "pd_ttft_s": {"median": statistics.median(pd_ttft), "min": min(pd_ttft)},
        "prefill_s": {"median": med("prefill_s"), "min": min(r["prefill_s"] for r in rows)},
        "decode_ttft_s": {"median": med("decode_ttft_s"), "min": min(r["decode_ttft_s"] for r in rows)},
        "colocated_ttft_s": {"median": med("colocated_ttft_s"), "min": min(r["colocated_ttft_s"] for r in rows)},
        # the decode node's TTFT, step by step (medians): admission -> read posted -> bytes landed ->
        # lease confirmed -> first token. Its floor: the transfer plus `cached_ttft_s`, the TTFT of the
        # same prompt with every block already cached (one token's forward and the engine's step).
        # With the first step computed early (engine/unconfirmed_loads.py), `confirm` holds that step:
        # the confirmation is collected when it ends, and its held token comes out then.
        "decode_ttft_breakdown_ms": {
            "until_posted": med("until_posted_s") * 1e3, "transfer": med("transfer_s") * 1e3,
            "confirm": med("confirm_s") * 1e3, "after_confirmed": med("after_confirmed_s") * 1e3,
        },
        "cached_ttft_s": {"median": med("cached_ttft_s"), "min": min(r["cached_ttft_s"] for r in rows)},
        "decode_ttft_over_floor_ms": (med("decode_ttft_s") - med("transfer_s") - med("cached_ttft_s")) * 1e3,
        # reads whose request's first step ran before the read was confirmed, and whose token was used
        "early_steps_used": early_steps_used,
        "decode_ttft_vs_colocated": med("decode_ttft_s") / med("colocated_ttft_s"),
        "reps": [{k: round(v * 1e3, 3) if k.endswith("_s") else v for k, v in r.items()} for r in rows],  # in ms
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": machine_info(args.prefill_device, args.decode_device),
        "versions": versions(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefill-device", default="cpu")
    parser.add_argument("--decode-device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--prefill-block-size", type=int, default=16, help="tokens per block of the prefill engine")
    parser.add_argument("--decode-block-size", type=int, default=16,
                        help="tokens per block of the decode engine; another size than the prefill's reads through a read plan")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of the prefill engine")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of the decode engine")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--descriptor-mode", choices=["blocks", "ranges"], default="blocks")
    parser.add_argument("--cuda-ipc", action=argparse.BooleanOptionalAction, default=True,
                        help="GPU: read through CUDA IPC mappings (default), or through NIXL with --no-cuda-ipc")
    parser.add_argument("--ipc-min-runs", type=int, default=16,
                        help="with --cuda-ipc: transfers of fewer runs of blocks go through NIXL")
    parser.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                        help="NIXL backend parameter of both engines' agents, e.g. num_workers=4 (repeatable)")
    parser.add_argument("--verify-kv-digest", action=argparse.BooleanOptionalAction, default=True,
                        help="digest leased blocks and verify every read (default), or not")
    parser.add_argument("--sign-grants", action=argparse.BooleanOptionalAction, default=True,
                        help="the prefill signs its lease grants into the params (default): reads are verified as they "
                             "land; --no-sign-grants: every read is confirmed with the prefill")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    exit_if_missing("pd_transfer", args.prefill_device, args.decode_device)
    out = os.fdopen(os.dup(1), "w", buffering=1)  # NIXL logs to stdout: keep stdout for the result
    os.dup2(2, 1)
    result = run(args)
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            out.write(f"{key}: {value}\n")


if __name__ == "__main__":
    main()
