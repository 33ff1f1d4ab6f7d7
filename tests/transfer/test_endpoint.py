"""KVEndpoint over real NIXL/UCX between two OS processes on loopback (marker `nixl`).

The peer runs tests/transfer/peer_process.py (JSON lines over stdin/stdout, no pickle); this
process runs the reading endpoint. Every child is killed in a finally block, every wait
has a timeout.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvbridge.errors import AuthenticationError, IncompatiblePeerError
from kvbridge.transfer import messages as m
from kvbridge.transfer.options import TransferOptions
from kvbridge.transfer.tracker import TransferState

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.nixl

sys.path.insert(0, str(Path(__file__).parent))
from peer_process import allocate_kv, allocate_layers, blocks_digest, fill_kv, make_layout  # noqa: E402

PEER_SCRIPT = Path(__file__).parent / "peer_process.py"
GEOMETRY = {"num_blocks": 64, "num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
MODEL = "tiny-test-model"


def _done(engine_id: str, *req_ids: str) -> m.TransferDone:
    """A side-channel message naming `req_ids` (the peer reports the request ids it received)."""
    leases = [m.LeaseRef(req_id=r, token="t", block_ids=[], block_hash="") for r in req_ids]
    return m.TransferDone(engine_id=engine_id, incarnation="i", leases=leases)


class Peer:
    """A peer endpoint in a child process."""

    def __init__(self, tmp_path: Path, env: dict | None = None, **spec):
        self.spec = {**GEOMETRY, "model_id": MODEL, "engine_id": "prefill", "seed": 7, **spec}
        self.log = tmp_path / f"peer-{self.spec['engine_id']}-{time.monotonic_ns()}.log"
        self._stderr = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env={**os.environ, **(env or {})},
        )
        hello = self._read(60)
        self.address, self.incarnation = hello["address"], hello["incarnation"]

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise AssertionError(f"peer gave no answer in {timeout_s}s; its log:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd: str, timeout_s: float = 20, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._stderr.close()

    def quit(self) -> None:
        """Close the peer's endpoint cleanly (it answers once closed), then end the process."""
        try:
            assert self.ask("quit", 20) == {"bye": True}
        finally:
            self.kill()  # interpreter teardown with NIXL loaded can take seconds; nothing left to check


def _local_endpoint(engine_id="decode", num_blocks=64, secret=None, **options):
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout({**GEOMETRY, "num_blocks": num_blocks})
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16)
    return KVEndpoint(engine_id, MODEL, kv, layout, secret=secret, options=TransferOptions(**options)), kv


def _wait_final(ep, req_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rec in ep.poll():
            if rec.req_id == req_id:
                return rec
        time.sleep(0.002)
    raise AssertionError(f"transfer {req_id} not final after {timeout_s}s")


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    p = Peer(tmp_path_factory.mktemp("peer"))
    try:
        yield p
    finally:
        p.quit()


@pytest.mark.parametrize("mode", ["blocks", "ranges"])
def test_read_scattered_blocks_verifies_every_byte(peer, mode):
    seed = 1234
    rng = random.Random(seed)
    print(f"seed={seed}")
    remote_ids = rng.sample(range(40), 12) + list(range(40, 52))  # scattered + one contiguous run
    local_ids = rng.sample(range(22, 64), 12) + list(range(10, 22))  # distinct local ids
    ep, kv = _local_endpoint(descriptor_mode=mode, max_descriptor_nbytes=3 * 512)
    try:
        rec = ep.read_blocks(f"read-{mode}", peer.address, local_ids, remote_ids)
        assert rec.state in (TransferState.HANDSHAKING, TransferState.POSTED)
        rec = _wait_final(ep, f"read-{mode}")
        assert rec.state is TransferState.DONE, rec.error
        assert rec.nbytes == 24 * 512 and rec.num_descriptors < 24
        expected = torch.empty_like(kv)
        fill_kv(expected, 7)  # the peer's content
        for lid, rid in zip(local_ids, remote_ids):
            assert torch.equal(kv[lid].view(torch.uint8), expected[rid].view(torch.uint8)), (lid, rid)
        untouched = sorted(set(range(64)) - set(local_ids))
        assert not kv[untouched].view(torch.uint8).any()
        assert ep.get_stats()["num_done"] == 1
    finally:
        ep.close()


VLLM_CPU = {**GEOMETRY, "page_format": "H2ND", "layer_major": True}  # vLLM's CPU backend: layer by layer


@pytest.fixture(scope="module")
def layer_major_peer(tmp_path_factory):
    """An owner whose KV cache is placed like vLLM's on CPU: pages [H, 2, block_size, D], layer-outermost."""
    p = Peer(tmp_path_factory.mktemp("peer-layer-major"), engine_id="prefill-vllm-cpu", seed=17, **VLLM_CPU)
    try:
        yield p
    finally:
        p.quit()


def _pages_equal(kv, local_ids, expected, remote_ids) -> None:
    for lid, rid in zip(local_ids, remote_ids):
        for layer in range(kv.shape[1]):
            assert torch.equal(kv[lid, layer].view(torch.uint8), expected[rid, layer].view(torch.uint8)), (lid, rid, layer)


# (local placement, descriptors for the pairing below: one per page, or one per layer per run)
PLACEMENTS = {"block-major": ({}, 5 * 2), "layer-major": ({"layer_major": True}, 3 * 2)}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["blocks", "ranges"])
def test_pages_move_between_a_layer_major_owner_and_a_reader_of_either_placement(layer_major_peer, placement, mode):
    from kvbridge.transfer.endpoint import KVEndpoint

    extra, num_descriptors = PLACEMENTS[placement]
    layout = make_layout({**GEOMETRY, "page_format": "H2ND", **extra})
    kv = allocate_kv(layout)
    ep = KVEndpoint(f"decode-{placement}-{mode}", MODEL, kv, layout, secret=None, options=TransferOptions(descriptor_mode=mode))
    try:
        local_ids, remote_ids = [10, 11, 12, 0, 63], [3, 4, 5, 20, 9]  # a run of three, then two lone blocks
        rec = _wait_final(ep, ep.read_blocks("lm-read", layer_major_peer.address, local_ids, remote_ids).req_id)
        assert rec.state is TransferState.DONE, rec.error
        assert rec.nbytes == 5 * layout.block_nbytes and rec.num_descriptors == num_descriptors
        assert ep.peers.get(layer_major_peer.address).layout == make_layout(VLLM_CPU)  # strides from the handshake
        expected = allocate_kv(make_layout(VLLM_CPU))
        fill_kv(expected, 17)  # the owner's pages
        _pages_equal(kv, local_ids, expected, remote_ids)
        untouched = sorted(set(range(64)) - set(local_ids))
        assert not kv[untouched].view(torch.uint8).any()
        ep.read_blocks("lm-range", layer_major_peer.address, [0], [64])  # the owner has 64 blocks
        rec = _wait_final(ep, "lm-range")
        assert rec.state is TransferState.FAILED and "IndexError" in rec.error
    finally:
        ep.close()


PER_LAYER = {**GEOMETRY, "per_layer": True}  # vLLM 0.25's V2 model runner: each layer its own allocation


@pytest.fixture(scope="module")
def per_layer_peer(tmp_path_factory):
    """An owner whose layers are separate allocations, registered with NIXL as one region each."""
    p = Peer(tmp_path_factory.mktemp("peer-per-layer"), engine_id="prefill-per-layer", seed=19, **PER_LAYER)
    try:
        yield p
    finally:
        p.quit()


# reader's placement -> descriptors for the pairing below: one per run per layer where both sides keep a
# layer's blocks adjacent, else one per page (a block-major reader's pages of one layer are a block apart)
PER_LAYER_READERS = {"per-layer": 3 * 2, "block-major": 5 * 2}


@pytest.mark.parametrize("reader", sorted(PER_LAYER_READERS))
@pytest.mark.parametrize("mode", ["blocks", "ranges"])
def test_pages_move_between_per_layer_allocations_one_descriptor_per_run_per_layer(per_layer_peer, reader, mode):
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout(PER_LAYER if reader == "per-layer" else GEOMETRY)
    kv = allocate_layers(layout) if reader == "per-layer" else allocate_kv(layout)
    ep = KVEndpoint(f"decode-{reader}-{mode}", MODEL, kv, layout, secret=None, options=TransferOptions(descriptor_mode=mode))
    try:
        local_ids, remote_ids = [10, 11, 12, 0, 63], [3, 4, 5, 20, 9]  # a run of three, then two lone blocks
        rec = _wait_final(ep, ep.read_blocks("pl-read", per_layer_peer.address, local_ids, remote_ids).req_id)
        assert rec.state is TransferState.DONE, rec.error
        assert rec.num_descriptors == PER_LAYER_READERS[reader]  # per layer: 3 runs x 2 layers, not 5 blocks x 2
        region = ep.peers.get(per_layer_peer.address).region
        assert len(region.layer_addrs) == 2 and region.layer_stride == make_layout(PER_LAYER).layer_stride_bytes
        expected = allocate_kv(make_layout(GEOMETRY))
        fill_kv(expected, 19)  # the owner's pages, block-major
        got = kv.index_select(0, torch.tensor(local_ids)) if reader == "per-layer" else kv[local_ids]
        assert torch.equal(got.view(torch.uint8), expected[remote_ids].view(torch.uint8))
        untouched = sorted(set(range(64)) - set(local_ids))
        rest = kv.index_select(0, torch.tensor(untouched)) if reader == "per-layer" else kv[untouched]
        assert not rest.view(torch.uint8).any()
        # a block's digest is of its bytes in layer order, wherever its pages lie: both sides agree
        theirs = per_layer_peer.ask("block_digests", ids=remote_ids)
        ours = ep.digest_blocks(local_ids)
        assert (ours.alg, list(ours.values)) == (theirs["alg"], theirs["values"])
        # and so do a lease's digests with each KV head's, what the owner's grant carries (once raised there)
        theirs = per_layer_peer.ask("lease_digests", ids=remote_ids)
        ours = ep.digest_lease(local_ids, per_head=True)
        assert len(theirs["head_values"]) == make_layout(GEOMETRY).num_kv_heads > 1, theirs
        assert (list(ours.values), [list(h) for h in ours.head_values]) == (theirs["values"], theirs["head_values"])
    finally:
        ep.close()


def test_a_padded_block_major_reader_fills_pages_and_leaves_its_padding_alone(peer):
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout({**GEOMETRY, "block_padding": 96})
    kv = allocate_kv(layout, fill=0xAB)  # padding and unread blocks keep 0xAB
    ep = KVEndpoint("decode-padded", MODEL, kv, layout, secret=None, options=TransferOptions(descriptor_mode="ranges"))
    try:
        local_ids, remote_ids = [5, 6, 7, 63], [11, 12, 13, 2]  # 63: the end of the padded region
        rec = _wait_final(ep, ep.read_blocks("padded", peer.address, local_ids, remote_ids).req_id)
        assert rec.state is TransferState.DONE, rec.error
        assert rec.num_descriptors == 4  # a block is one range on both sides, but not adjacent to the next here
        expected = torch.empty(make_layout(GEOMETRY).shape, dtype=torch.bfloat16)
        fill_kv(expected, 7)
        _pages_equal(kv, local_ids, expected, remote_ids)
        buffer = kv.as_strided((layout.region_nbytes // 2,), (1,)).view(torch.uint8)
        written = np.zeros(layout.region_nbytes, dtype=bool)
        for lid in local_ids:
            start = layout.block_offset(lid)
            written[start:start + layout.block_nbytes] = True
        assert (buffer.numpy()[~written] == 0xAB).all()  # padding and other blocks untouched
    finally:
        ep.close()


def test_a_kv_tensor_that_is_not_the_layouts_view_is_refused():
    from kvbridge.errors import ConfigError
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout(VLLM_CPU)
    with pytest.raises(ConfigError, match="strides .* is not the view of layout.*torch.as_strided"):
        KVEndpoint("decode-wrong-view", MODEL, torch.zeros(layout.shape, dtype=torch.bfloat16), layout, secret=None)
    with pytest.raises(ConfigError, match="is not the view"):
        KVEndpoint("decode-wrong-shape", MODEL, allocate_kv(layout)[:32], layout, secret=None)


def test_a_side_channel_message_reaches_the_peers_handler(peer):
    ep, _ = _local_endpoint("decode-messenger")
    try:
        reply = ep.request(peer.address, _done("decode-messenger", "a", "b"))
        assert reply == m.Ack(count=2)
        assert ["TransferDone", ["a", "b"]] in peer.ask("messages")["messages"]
    finally:
        ep.close()


def test_incompatible_model_or_protocol_raises_named_error(peer, monkeypatch):
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout(GEOMETRY)
    other = KVEndpoint("decode-other-model", "another-model", torch.zeros(layout.shape, dtype=torch.bfloat16), layout,
                       secret=None)
    try:
        with pytest.raises(IncompatiblePeerError, match="compat hash"):
            other.handshake(peer.address)
        rec = other.read_blocks("r", peer.address, [0], [0])  # the non-blocking path reports it too
        rec = _wait_final(other, "r")
        assert rec.state is TransferState.FAILED and "IncompatiblePeerError" in rec.error
    finally:
        other.close()
    ep, _ = _local_endpoint("decode-future")
    try:
        monkeypatch.setattr(m, "PROTOCOL_VERSION", 9)
        monkeypatch.setattr(m, "MIN_PROTOCOL_VERSION", 9)
        with pytest.raises(IncompatiblePeerError, match="protocol"):
            ep.handshake(peer.address)
    finally:
        ep.close()


def test_wrong_or_missing_secret_is_refused():
    secure, _ = _local_endpoint("secure-prefill", secret=b"right" * 8)
    wrong, _ = _local_endpoint("decode-wrong", secret=b"wrong" * 8)
    missing, _ = _local_endpoint("decode-missing", secret=None)
    right, _ = _local_endpoint("decode-right", secret=b"right" * 8)
    try:
        for ep in (wrong, missing):
            with pytest.raises(AuthenticationError, match="KVBRIDGE_SIDE_CHANNEL_SECRET"):
                ep.handshake(secure.address)
        assert right.handshake(secure.address).engine_id == "secure-prefill"
    finally:
        for ep in (secure, wrong, missing, right):
            ep.close()


def test_out_of_range_remote_ids_fail_the_record_not_the_caller(peer):
    ep, _ = _local_endpoint("decode-range")
    try:
        ep.read_blocks("bad", peer.address, [0, 1], [3, 64])
        rec = _wait_final(ep, "bad")
        assert rec.state is TransferState.FAILED and "IndexError" in rec.error
        with pytest.raises(IndexError):
            ep.read_blocks("bad-local", peer.address, [64], [0])
    finally:
        ep.close()


BIG = {"num_blocks": 128, "num_layers": 32, "block_size": 16, "num_kv_heads": 8, "head_dim": 128}  # 2 MiB blocks


def test_peer_killed_mid_transfer_fails_within_deadline_then_restarted_peer_works(tmp_path, monkeypatch):
    # TCP only: a 256 MiB read takes long enough to kill the peer while it is in flight
    # (with UCX's default same-host transport, cma, a CPU read completes inside the post).
    env = {"UCX_TLS": "tcp"}
    monkeypatch.setenv("UCX_TLS", "tcp")
    from kvbridge.transfer.endpoint import KVEndpoint

    t_start = time.monotonic()
    victim = Peer(tmp_path, env=env, engine_id="victim", seed=None, **BIG)
    print(f"victim up {time.monotonic() - t_start:.2f}s")
    layout = make_layout(BIG)
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16)
    ep = KVEndpoint("decode-big", MODEL, kv, layout, secret=None, options=TransferOptions(transfer_timeout_s=10.0))
    restarted = None
    try:
        t0 = time.monotonic()
        ep.handshake(victim.address)
        print(f"handshake {time.monotonic() - t0:.2f}s")
        ids = list(range(128))
        rec = ep.read_blocks("doomed", victim.address, ids, ids)
        assert rec.state is TransferState.POSTED
        assert ep.poll() == [], "the read finished before the peer could be killed"
        victim.kill()
        start = time.monotonic()
        rec = _wait_final(ep, "doomed", timeout_s=15)
        assert rec.state in (TransferState.FAILED, TransferState.EXPIRED)
        print(f"{rec.state.name} after {time.monotonic() - start:.2f}s: {rec.error}")
        assert time.monotonic() - start < 11
        assert victim.address not in ep.peers  # forgotten: the next transfer handshakes again
        # the same engine (same NIXL agent name) comes back on a new port
        t0 = time.monotonic()
        restarted = Peer(tmp_path, env=env, engine_id="victim", seed=5, **{**BIG, "num_blocks": 8})
        print(f"restarted up {time.monotonic() - t0:.2f}s")
        t0 = time.monotonic()
        rec = ep.read_blocks("again", restarted.address, [9, 10], [6, 7])
        rec = _wait_final(ep, "again")
        print(f"read from the restarted peer {time.monotonic() - t0:.2f}s")
        assert rec.state is TransferState.DONE, rec.error
        expected = torch.empty(make_layout({**BIG, "num_blocks": 8}).shape, dtype=torch.bfloat16)
        fill_kv(expected, 5)
        assert torch.equal(kv[9:11].view(torch.uint8), expected[6:8].view(torch.uint8))
    finally:
        t0 = time.monotonic()
        ep.close()
        victim.kill()
        if restarted is not None:
            restarted.quit()
        print(f"teardown {time.monotonic() - t0:.2f}s, total {time.monotonic() - t_start:.2f}s")


def test_a_read_that_expires_in_flight_keeps_its_blocks_until_it_is_over(tmp_path, monkeypatch):
    """The owner stops (SIGSTOP) mid-read, past the reader's deadline and past as long again (every
    timeout the reader has), then resumes (SIGCONT): the read is not reported (its blocks not given
    back) while NIXL still runs it, and once it is, blocks refilled with a canary as if another
    request owned them never change. (Had the blocks been handed back at a timeout, the resumed owner's
    bytes would land in them: measured over UCX's TCP transport, whole 256 MiB reads did, after the
    transfer was released and the owner's agent removed.)"""
    env = {"UCX_TLS": "tcp"}  # as above: a read that is still in flight when the owner stops
    monkeypatch.setenv("UCX_TLS", "tcp")
    from kvbridge.transfer.endpoint import KVEndpoint

    owner = Peer(tmp_path, env=env, engine_id="stalled", seed=11, **BIG)
    layout = make_layout(BIG)
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16)
    ep = KVEndpoint("decode-quarantine", MODEL, kv, layout, secret=None, options=TransferOptions(transfer_timeout_s=2.0))
    stopped = False
    try:
        ep.handshake(owner.address)
        ids = list(range(BIG["num_blocks"]))
        assert ep.read_blocks("stalled", owner.address, ids, ids).state is TransferState.POSTED
        os.kill(owner.proc.pid, signal.SIGSTOP)
        stopped = True
        deadline = time.monotonic() + 30
        while ep.tracker.get("stalled") is not None:  # until it expires (2 s), the owner still stopped
            assert all(rec.req_id != "stalled" for rec in ep.poll()), "reported while NIXL may still write its blocks"
            assert time.monotonic() < deadline, "the read never expired"
            time.sleep(0.01)
        assert ep.get_stats()["num_quarantined"] == 1  # expired while NIXL still runs it: held, not reported
        # Forgetting the peer now (as another read's failure would) must not end the quarantine: NIXL
        # reports the transfers of a removed agent over while their bytes may still land.
        ep.forget_peer(owner.address)
        assert owner.address in ep.peers  # deferred until no read from it is in flight
        past_every_timeout = time.monotonic() + ep.transfer_timeout_s + 1.0  # expired + the old quarantine bound
        while time.monotonic() < past_every_timeout:
            assert all(rec.req_id != "stalled" for rec in ep.poll()), "reported while NIXL may still write its blocks"
            time.sleep(0.01)
        assert ep.get_stats()["num_quarantine_timeouts"] == 1  # logged and counted once, blocks still withheld
        os.kill(owner.proc.pid, signal.SIGCONT)
        stopped = False
        rec = _wait_final(ep, "stalled", timeout_s=30)  # NIXL finishes it now; then, and only then, it is reported
        assert rec.state is TransferState.EXPIRED  # still a failed read: its bytes are never used
        stats = ep.get_stats()
        assert stats["num_quarantined"] == 0 and stats["num_quarantined_reads"] == 1 and stats["num_quarantine_timeouts"] == 1
        assert stats["num_quarantined_first_reads"] == 1  # no read from the owner had completed before it
        assert owner.address not in ep.peers  # forgotten once the read was over
        canary = kv.view(torch.uint8)
        canary.fill_(0xA5)  # the blocks now belong to someone else
        assert "digest" in owner.ask("digest", ids=[0])  # the owner runs (and its UCX with it)
        for _ in range(100):  # give a late write every chance to land
            ep.poll()
            time.sleep(0.01)
        assert bool((canary == 0xA5).all()), "a write of the expired read changed blocks it no longer owned"
    finally:
        if stopped:
            os.kill(owner.proc.pid, signal.SIGCONT)
        ep.close()
        owner.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["cuda-ipc-mapping", "nixl"])
@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_read_between_gpus_verifies_every_byte(tmp_path, cuda_ipc, scattered):
    """VRAM -> VRAM: the peer's cache on the last GPU, ours on cuda:0; through the peer's CUDA IPC
    mapping (same host), or through NIXL (UCX picks cuda_ipc / NVLink). Few runs, or many: with the
    mapping, transfers of fewer than ipc_min_runs (16) runs still go through NIXL."""
    from kvbridge.transfer.endpoint import KVEndpoint

    peer_dev = f"cuda:{torch.cuda.device_count() - 1}"
    gpu_peer = Peer(tmp_path, engine_id="gpu-prefill", device=peer_dev, seed=11, cuda_ipc=cuda_ipc)
    layout = make_layout(GEOMETRY)
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16, device="cuda:0")
    ep = KVEndpoint("gpu-decode", MODEL, kv, layout, secret=None, options=TransferOptions(cuda_ipc=cuda_ipc))
    try:
        if scattered:  # many runs: one batched driver call on the mapping path
            rng = np.random.default_rng(5)
            local_ids = rng.permutation(layout.num_blocks)[:40].tolist()
            remote_ids = rng.permutation(64)[:40].tolist()
        else:
            local_ids, remote_ids = [3, 4, 5, 40, 9], [10, 11, 12, 0, 63]
        ep.read_blocks("gpu-read", gpu_peer.address, local_ids, remote_ids)
        rec = _wait_final(ep, "gpu-read")
        assert rec.state is TransferState.DONE, rec.error
        assert ep.get_stats()["num_ipc_copies"] == (1 if cuda_ipc and scattered else 0)
        torch.cuda.synchronize()
        expected = torch.empty(layout.shape, dtype=torch.bfloat16)
        fill_kv(expected, 11)  # generated on CPU in the peer too, then copied to its GPU
        assert torch.equal(kv[local_ids].cpu().view(torch.uint8), expected[remote_ids].view(torch.uint8))
    finally:
        ep.close()
        gpu_peer.quit()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["cuda-ipc-mapping", "nixl"])
def test_pages_between_gpus_from_a_layer_major_owner(tmp_path, cuda_ipc):
    """A vLLM-like layer-outermost owner on a GPU, a block-major reader on another: its export spans
    its region, so the mapping is used (one copy per page here), or NIXL moves the pages."""
    from kvbridge.transfer.endpoint import KVEndpoint

    peer_dev = f"cuda:{torch.cuda.device_count() - 1}"
    owner = Peer(tmp_path, engine_id="gpu-vllm-like", device=peer_dev, seed=13, cuda_ipc=cuda_ipc, **VLLM_CPU)
    layout = make_layout({**GEOMETRY, "page_format": "H2ND"})
    kv = allocate_kv(layout, "cuda:0")
    options = TransferOptions(cuda_ipc=cuda_ipc, ipc_min_runs=1)
    ep = KVEndpoint("gpu-reader-h2nd", MODEL, kv, layout, secret=None, options=options)
    try:
        local_ids, remote_ids = [3, 4, 5, 40, 9], [10, 11, 12, 0, 63]
        rec = _wait_final(ep, ep.read_blocks("gpu-lm", owner.address, local_ids, remote_ids).req_id)
        assert rec.state is TransferState.DONE, rec.error
        assert rec.num_descriptors == 5 * 2
        assert ep.get_stats()["num_ipc_copies"] == (1 if cuda_ipc else 0)
        torch.cuda.synchronize()
        expected = allocate_kv(make_layout(VLLM_CPU))
        fill_kv(expected, 13)
        _pages_equal(kv.cpu(), local_ids, expected, remote_ids)
    finally:
        ep.close()
        owner.quit()


@pytest.mark.gpu
def test_read_through_the_mapping_from_a_peer_that_sees_only_its_own_gpu(tmp_path):
    """Per-process CUDA_VISIBLE_DEVICES: the peer's GPU is its cuda:0. The mapping is opened in our
    GPU's context, so the read still goes through it."""
    from kvbridge.transfer.endpoint import KVEndpoint

    last = torch.cuda.device_count() - 1
    gpu_peer = Peer(tmp_path, env={"CUDA_VISIBLE_DEVICES": str(last)}, engine_id="gpu-isolated",
                    device="cuda:0", seed=11)
    layout = make_layout(GEOMETRY)
    kv = allocate_kv(layout, device="cuda:0")
    ep = KVEndpoint("gpu-reader", MODEL, kv, layout, secret=None, options=TransferOptions(ipc_min_runs=1))
    try:
        local_ids, remote_ids = [1, 2, 3, 17, 30], [40, 41, 50, 51, 7]
        ep.read_blocks("gpu-read", gpu_peer.address, local_ids, remote_ids)
        rec = _wait_final(ep, "gpu-read")
        assert rec.state is TransferState.DONE, rec.error
        assert ep.get_stats()["num_ipc_copies"] == 1
        assert gpu_peer.ask("digest", ids=remote_ids)["digest"] == blocks_digest(kv, local_ids)
    finally:
        ep.close()
        gpu_peer.quit()


def test_close_is_idempotent():
    ep, _ = _local_endpoint("decode-close")
    ep.close()
    ep.close()


def test_an_unknown_descriptor_mode_is_refused_before_anything_is_registered():
    from kvbridge.errors import ConfigError

    with pytest.raises(ConfigError, match="descriptor_mode='bogus'"):
        _local_endpoint("decode-bogus", descriptor_mode="bogus")


def _restart_on_the_same_port(tmp_path, device: str):
    """An owner killed and restarted on its address with other bytes: the reader, which cached the
    first instance (and, on GPUs, mapped its memory), never serves the new instance's blocks for the
    old instance's lease, and reads the new instance through a fresh handshake (and mapping)."""
    from kvbridge.transfer.endpoint import KVEndpoint

    spec = {"engine_id": "owner", "device": device, "cuda_ipc": True}
    first = Peer(tmp_path, seed=7, **spec)
    port = int(first.address.rsplit(":", 1)[1])
    layout = make_layout(GEOMETRY)
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16, device=device)
    options = TransferOptions(ipc_min_runs=1, transfer_timeout_s=10)
    ep = KVEndpoint("reader", MODEL, kv, layout, secret=None, options=options)
    second = None
    rng = np.random.default_rng(3)
    local_ids = rng.permutation(64)[:20].tolist()  # scattered: the mapping path on GPUs
    remote_ids = rng.permutation(64)[:20].tolist()
    expected = {seed: torch.empty(layout.shape, dtype=torch.bfloat16) for seed in (7, 9)}
    for seed, t in expected.items():
        fill_kv(t, seed)
    try:
        old = ("owner", first.incarnation)
        assert _wait_final(ep, _read(ep, "one", first.address, local_ids, remote_ids, old)).is_ok
        assert torch.equal(kv[local_ids].cpu().view(torch.uint8), expected[7][remote_ids].view(torch.uint8))
        first.kill()
        second = Peer(tmp_path, seed=9, port=port, **spec)
        assert second.address == first.address and second.incarnation != first.incarnation
        new = ("owner", second.incarnation)  # params the new instance returned: a fresh handshake (and mapping)
        assert _wait_final(ep, _read(ep, "fresh", first.address, local_ids, remote_ids, new)).is_ok
        assert torch.equal(kv[local_ids].cpu().view(torch.uint8), expected[9][remote_ids].view(torch.uint8))
        kv.zero_()
        rec = _wait_final(ep, _read(ep, "stale", first.address, local_ids, remote_ids, old))  # the dead one's params
        assert rec.state is TransferState.FAILED and "not the instance" in rec.error, rec.error
        assert not kv.view(torch.uint8).any(), "a read meant for the dead instance wrote the new instance's blocks"
        forged = ("someone-else", second.incarnation)  # params naming another engine at that address
        assert _wait_final(ep, _read(ep, "forged", first.address, local_ids, remote_ids, forged)).state is TransferState.FAILED
        return ep.get_stats()
    finally:
        ep.close()
        first.kill()
        if second is not None:
            second.quit()


def _read(ep, req_id, address, local_ids, remote_ids, expect) -> str:
    ep.read_blocks(req_id, address, local_ids, remote_ids, expect=expect)
    return req_id


def test_a_restarted_owner_is_never_read_for_its_predecessors_lease(tmp_path):
    _restart_on_the_same_port(tmp_path, "cpu")


@pytest.mark.gpu
def test_a_restarted_gpu_owner_is_never_read_through_its_predecessors_mapping(tmp_path):
    stats = _restart_on_the_same_port(tmp_path, "cuda:0")
    assert stats["num_ipc_copies"] == 2  # both good reads went through a CUDA IPC mapping, the second a fresh one


def test_handshakes_nobody_waits_for_are_dropped_not_queued_ahead_of_a_real_peer(peer):
    """Reads naming silent addresses expire; their queued handshakes must not delay a real peer's."""
    ep, kv = _local_endpoint("decode-queue", handshake_timeout_s=1.0, handshake_retries=0)
    silent = [f"tcp://127.0.0.1:{port}" for port in _closed_ports(40)]
    try:
        for i, address in enumerate(silent):  # 40 x 1 s of handshakes on a pool of two threads
            ep.read_blocks(f"silent-{i}", address, [i], [i], timeout_s=0.5)
        finals, deadline = {}, time.monotonic() + 30
        while len(finals) < len(silent) and time.monotonic() < deadline:
            finals.update((rec.req_id, rec) for rec in ep.poll())
            time.sleep(0.01)
        assert len(finals) == len(silent)
        assert all(rec.state in (TransferState.EXPIRED, TransferState.FAILED) for rec in finals.values())
        rec = _wait_final(ep, _read(ep, "real", peer.address, [50], [5], None), timeout_s=30)
        assert rec.is_ok, rec.error
        assert rec.finished_at - rec.created_at < 5.0, "the real peer's handshake waited behind the doomed ones"
    finally:
        ep.close()


def _closed_ports(count: int) -> list[int]:
    """Ports that were free a moment ago: nobody answers there."""
    import socket

    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_a_frozen_owner_delays_a_read_without_spoiling_it_and_its_log_names_the_freeze(tmp_path):
    """The owner is stopped (SIGSTOP) for 2.5 s between its handshake and the first read from it: the
    read ends once it runs again, with the owner's bytes, and the owner's log and gauges say how long
    it did not run (what a peer's timed-out read or handshake is matched against)."""
    owner = Peer(tmp_path, engine_id="frozen-owner", seed=23)
    ep, kv = _local_endpoint()
    try:
        ep.handshake(owner.address)
        os.kill(owner.proc.pid, signal.SIGSTOP)
        try:
            ep.read_blocks("while-frozen", owner.address, [0, 1, 2], [5, 6, 7])
            time.sleep(2.5)
        finally:
            os.kill(owner.proc.pid, signal.SIGCONT)
        rec = _wait_final(ep, "while-frozen")
        assert rec.state is TransferState.DONE, rec.error
        expected = torch.empty_like(kv)
        fill_kv(expected, 23)
        assert torch.equal(kv[[0, 1, 2]].view(torch.uint8), expected[[5, 6, 7]].view(torch.uint8))

        stats = owner.ask("stats")
        assert stats["num_process_stalls"] >= 1, stats  # a loaded machine may add stalls of its own
        assert 2.0 <= stats["max_process_stall_s"] < 60, stats
        assert "this process did not run for" in owner.log.read_text()
    finally:
        ep.close()
        owner.quit()
