"""A KVEndpoint in its own OS process, driven by JSON lines on stdin/stdout (no pickle).

Started by tests/transfer/test_endpoint.py and benchmarks/transfer_bw.py:

    python peer_process.py '{"engine_id": "p", "model_id": "m", "num_blocks": 64, ..., "seed": 1}'

(optional layout keys: "page_format", "layer_major": true for vLLM's CPU placement, "block_padding": bytes,
"per_layer": true for one allocation per layer, as vLLM 0.25's V2 model runner allocates)

prints {"address": ..., "engine_id": ..., "incarnation": ...} once serving, then answers one JSON line per command line:
    {"cmd": "messages"}               -> {"messages": [[type, req_ids], ...]}  (side-channel handler)
    {"cmd": "digest", "ids": [...]}   -> {"digest": sha256 hex of those blocks' bytes, in order}
    {"cmd": "block_digests", "ids": [...]} -> {"alg": ..., "values": [...]}  (the endpoint's lease digests)
    {"cmd": "lease_digests", "ids": [...]} -> {"alg": ..., "values": [...], "head_values": [[...], ...]}  (with each head's)
    {"cmd": "stats"}                  -> the endpoint's get_stats()
    {"cmd": "quit"}                   -> exits 0 after closing the endpoint
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading


def fill_kv(kv, seed: int) -> None:
    """Deterministic bytes for a KV tensor: the test side recomputes them to verify every byte.

    They follow the logical [block, layer, *page] order, so a strided cache filled with a seed holds
    the same pages as a block-major one filled with it."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    raw = kv.view(torch.uint8)  # [..., head_dim * element size]: the strides stay, in bytes
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def make_layout(spec: dict):
    import dataclasses

    from kvbridge.layout import KVCacheLayout

    layout = KVCacheLayout(
        spec["num_blocks"], spec["num_layers"], spec["block_size"], spec["num_kv_heads"], spec["head_dim"],
        spec.get("dtype", "bfloat16"), page_format=spec.get("page_format", "2NHD"),
    )
    page = layout.page_nbytes
    if spec.get("per_layer"):  # each layer its own allocation (kvbridge.layer_tensors)
        return KVCacheLayout.per_layer(page, **{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)
                                                if f.name not in ("layer_stride", "block_stride")})  # fmt: skip
    if spec.get("layer_major"):  # vLLM's CPU backend: layer by layer, every block's page in each
        return dataclasses.replace(layout, layer_stride=layout.num_blocks * page, block_stride=page)
    if spec.get("block_padding"):  # block-outermost with a gap after each block
        return dataclasses.replace(layout, layer_stride=page, block_stride=layout.block_nbytes + spec["block_padding"])
    return layout


def allocate_kv(layout, device="cpu", fill: int = 0):
    """A KV tensor of `layout`: the [num_blocks, num_layers, *page_shape] view of a buffer of
    `region_nbytes` bytes set to `fill` (its padding keeps that value)."""
    import torch

    buffer = torch.full((layout.region_nbytes,), fill, dtype=torch.uint8, device=device).view(getattr(torch, layout.dtype))
    return buffer.as_strided(layout.shape, layout.strides)


def allocate_layers(layout, device="cpu", seed: int | None = None):
    """`LayerTensors` of a per-layer layout, each layer a separate allocation; with `seed`, the pages a
    block-major cache filled with that seed holds (`fill_kv`)."""
    import torch

    from kvbridge.layer_tensors import LayerTensors

    dtype = getattr(torch, layout.dtype)
    page_shape = layout.page_shape
    layers = [torch.zeros((layout.num_blocks, *page_shape), dtype=dtype, device=device) for _ in range(layout.num_layers)]
    if seed is not None:
        full = torch.empty(layout.block_major(layout.num_blocks).shape, dtype=dtype)
        fill_kv(full, seed)
        for i, layer in enumerate(layers):
            layer.copy_(full[:, i])
    return LayerTensors(layers, layout)


def blocks_digest(kv, ids) -> str:
    import torch

    h = hashlib.sha256()
    for i in ids:
        block = kv.index_select(0, torch.tensor([i], device=kv.device))[0] if hasattr(kv, "layers") else kv[i]
        h.update(block.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    # NIXL logs to stdout: keep the real stdout for the protocol and send everything else to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def lease_ids(msg) -> list[str]:
        return [lease.req_id for lease in getattr(msg, "leases", [])]

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import torch

    from kvbridge.transfer import messages as m
    from kvbridge.transfer.endpoint import KVEndpoint
    from kvbridge.transfer.options import TransferOptions

    spec = json.loads(sys.argv[1])
    layout = make_layout(spec)
    device = spec.get("device", "cpu")
    kv = allocate_layers(layout, device, spec.get("seed")) if spec.get("per_layer") else allocate_kv(layout, device)
    if spec.get("seed") is not None and not spec.get("per_layer"):
        filled = kv if device == "cpu" else allocate_kv(layout)
        fill_kv(filled, spec["seed"])  # on CPU, so that a GPU peer holds the same bytes
        if filled is not kv:
            kv.copy_(filled)
    received: list[list] = []
    lock = threading.Lock()

    def on_message(msg):
        with lock:
            received.append([type(msg).__name__, lease_ids(msg)])
        return m.Ack(count=len(lease_ids(msg)))

    secret = spec.get("secret")
    ep = KVEndpoint(
        spec["engine_id"], spec["model_id"], kv, layout, message_handler=on_message,
        secret=secret.encode() if secret else None,
        port=spec.get("port", 0),
        options=TransferOptions(descriptor_mode=spec.get("descriptor_mode", "blocks"), cuda_ipc=spec.get("cuda_ipc", True)),
    )
    reply({"address": ep.address, "engine_id": ep.engine_id, "incarnation": ep.incarnation})
    for line in sys.stdin:
        cmd = json.loads(line)
        match cmd["cmd"]:
            case "messages":
                with lock:
                    out = {"messages": list(received)}
            case "digest":
                out = {"digest": blocks_digest(kv, cmd["ids"])}
            case "block_digests":  # what a lease on those blocks would carry
                got = ep.digest_blocks(cmd["ids"])
                out = {"alg": got.alg, "values": list(got.values)}
            case "lease_digests":  # what a grant carries: the blocks' digests and each KV head's
                got = ep.digest_lease(cmd["ids"], per_head=True)
                out = {"alg": got.alg, "values": list(got.values), "head_values": [list(h) for h in got.head_values]}
            case "stats":
                out = ep.get_stats()
            case "quit":
                ep.close()
                reply({"bye": True})
                return 0
            case other:
                out = {"error": f"unknown command {other!r}"}
        reply(out)
    ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
