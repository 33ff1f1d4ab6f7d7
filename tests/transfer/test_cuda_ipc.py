"""The CUDA IPC fast path's host-side parts (the GPU read itself: tests/transfer/test_endpoint.py, `gpu`)."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.errors import MalformedMessageError, TransferError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import cuda_ipc
from kvbridge.transfer import messages as m
from kvbridge.transfer.cuda_driver import IpcHandle
from kvbridge.transfer.digest import WSUM, block_digests, region_bytes


def export(**changes) -> m.IpcExport:
    fields = dict(host_id=cuda_ipc.host_id(), pid=os.getpid() + 1, handle=b"\x01" * 64, offset=256,
                  nbytes=1 << 20, device_uuid="GPU-x")
    return m.IpcExport(**{**fields, **changes})


def handshake_response(cuda_ipc_export) -> m.HandshakeResponse:
    region = m.KVRegion(base_addr=4096, nbytes=1 << 20)
    return m.HandshakeResponse(protocol_version=2, engine_id="e", incarnation="i", compat_hash="h", agent_name="a",
                               agent_metadata=b"md", regions=[region], num_blocks=8, block_nbytes=1024,
                               cuda_ipc=cuda_ipc_export)


def test_the_export_travels_in_the_handshake_and_old_peers_need_not_send_it():
    assert m.decode(m.encode(handshake_response(export()))).cuda_ipc == export()
    assert m.decode(m.encode(handshake_response(None))).cuda_ipc is None
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(handshake_response(export())), "cuda_ipc": {"pid": "x"}})
    with pytest.raises(MalformedMessageError):
        m.decode(bad)


def test_exports_are_mapped_only_from_another_process_on_this_host():
    # the owner's GPU need not be visible here: the mapping is opened in the local GPU's context
    assert cuda_ipc.can_map(export()) and cuda_ipc.can_map(export(device_uuid=""))
    for other in (export(pid=os.getpid()), export(host_id="another-boot-id"), None):
        assert not cuda_ipc.can_map(other)


def test_copy_plan_is_one_copy_per_run_adjacent_on_both_sides():
    local_layout, remote_layout = KVCacheLayout(16, 2, 4, 2, 8, "float16"), KVCacheLayout(32, 2, 4, 2, 8, "float16")
    b = local_layout.block_nbytes
    local_ids, remote_ids = np.array([3, 4, 5, 9, 10, 0]), np.array([7, 8, 20, 21, 22, 31])
    dsts, srcs, sizes = cuda_ipc.copy_plan("READ", 1 << 20, local_layout, local_ids, 1 << 30, remote_layout, remote_ids)
    # runs: (3,4)<-(7,8), 5<-20, (9,10)<-(21,22), 0<-31
    assert dsts.tolist() == [(1 << 20) + i * b for i in (3, 5, 9, 0)]
    assert srcs.tolist() == [(1 << 30) + i * b for i in (7, 20, 21, 31)]
    assert sizes.tolist() == [2 * b, b, 2 * b, b] and dsts.dtype == np.uint64
    wd, ws, wsizes = cuda_ipc.copy_plan("WRITE", 1 << 20, local_layout, local_ids, 1 << 30, remote_layout, remote_ids)
    assert (wd == srcs).all() and (ws == dsts).all() and (wsizes == sizes).all()
    with pytest.raises(IndexError):
        cuda_ipc.copy_plan("READ", 0, local_layout, np.array([16]), 0, remote_layout, np.array([0]))
    with pytest.raises(ValueError):
        cuda_ipc.copy_plan("MOVE", 0, local_layout, local_ids, 0, remote_layout, remote_ids)


def test_copy_plan_with_a_layer_major_peer_copies_layer_runs_or_pages():
    """vLLM-like layer-outermost caches: a run of blocks is one copy per layer between two of them,
    one copy per page against a block-major cache."""
    block_major = KVCacheLayout(16, 2, 4, 2, 8, "float16")
    page = block_major.page_nbytes
    layer_major = KVCacheLayout(32, 2, 4, 2, 8, "float16", layer_stride=32 * page, block_stride=page)
    local_ids, remote_ids = np.array([3, 4, 9]), np.array([7, 8, 20])
    dsts, srcs, sizes = cuda_ipc.copy_plan("READ", 0, layer_major, local_ids, 1 << 30, layer_major, remote_ids)
    assert sorted(zip(dsts.tolist(), srcs.tolist(), sizes.tolist())) == sorted([
        (3 * page, (1 << 30) + 7 * page, 2 * page), (32 * page + 3 * page, (1 << 30) + 32 * page + 7 * page, 2 * page),
        (9 * page, (1 << 30) + 20 * page, page), (32 * page + 9 * page, (1 << 30) + 32 * page + 20 * page, page),
    ])
    dsts, srcs, sizes = cuda_ipc.copy_plan("READ", 0, block_major, local_ids, 1 << 30, layer_major, remote_ids)
    assert len(sizes) == 3 * 2 and (sizes == page).all()
    assert sorted(dsts.tolist()) == sorted(b * 2 * page + layer * page for b in (3, 4, 9) for layer in (0, 1))
    with pytest.raises(IndexError, match="block id 32"):
        cuda_ipc.copy_plan("READ", 0, block_major, np.array([0]), 0, layer_major, np.array([32]))


@pytest.mark.gpu
def test_driver_copies_move_pages_between_a_layer_major_and_a_block_major_cache():
    """The batched driver copies of the mapping path follow copy_plan's page ranges; a tensor of
    this process stands in for the peer's mapped cache (same device pointers, no IPC handle)."""
    block_major = KVCacheLayout(16, 2, 4, 2, 8, "float16")
    page = block_major.page_nbytes
    layer_major = KVCacheLayout(32, 2, 4, 2, 8, "float16", layer_stride=32 * page, block_stride=page)
    owner_buffer = torch.randn(layer_major.region_nbytes // 2, device="cuda").half()
    owner = owner_buffer.as_strided(layer_major.shape, layer_major.strides)
    kv = torch.zeros(block_major.shape, dtype=torch.float16, device="cuda")
    copier = cuda_ipc.IpcCopier(kv, block_major, min_runs=1, sm_reads=False)

    class Mapped:
        addr = owner.data_ptr()

    local_ids, remote_ids = np.array([3, 4, 5, 9]), np.array([7, 8, 9, 30])
    copy = copier.start("READ", Mapped(), layer_major, local_ids, remote_ids)
    assert copy.num_runs == 4 * 2  # one copy per page: the owner's blocks are not one range
    copy.event.synchronize()
    for lid, rid in zip(local_ids.tolist(), remote_ids.tolist()):
        for layer in range(2):
            assert torch.equal(kv[lid, layer], owner[rid, layer]), (lid, rid, layer)
    assert not kv[[0, 1, 2, 6, 7, 8, 10, 11, 12, 13, 14, 15]].any()
    before = owner_buffer.clone()
    copy = copier.start("WRITE", Mapped(), layer_major, np.array([3, 4]), np.array([0, 1]))
    copy.event.synchronize()
    assert torch.equal(owner[0], kv[3]) and torch.equal(owner[1], kv[4])
    changed = (owner_buffer != before).nonzero().flatten().cpu()
    written = set(((layer_major.page_offsets([0, 1]).reshape(-1) // 2)[:, None] + np.arange(page // 2)).reshape(-1).tolist())
    assert set(changed.tolist()) <= written


def test_handles_keep_every_byte():
    raw = bytes([0, 1, 0, 2] * 16)  # NULs inside: a C-string round trip would cut them off
    assert IpcHandle.from_bytes(raw).to_bytes() == raw
    with pytest.raises(TransferError, match="64 bytes"):
        IpcHandle.from_bytes(raw[:10])


def test_cpu_tensors_are_not_exported():
    assert cuda_ipc.export_tensor(torch.zeros(16)) is None


def test_transfers_of_fewer_runs_than_min_runs_are_declined_before_touching_the_gpu():
    """KVEndpoint then moves them through NIXL (measured faster for P/D's few-run reads)."""
    layout = KVCacheLayout(16, 2, 4, 2, 8, "float16")
    copier = cuda_ipc.IpcCopier(torch.zeros(layout.shape, dtype=torch.float16), layout, min_runs=3)

    class Mapped:  # only its address and device are read before the decision
        addr = 1 << 30
        same_device = False

    two_runs = np.array([1, 2, 3, 8]), np.array([5, 6, 7, 0])
    assert copier.start("READ", Mapped(), layout, *two_runs) is None
    assert copier.num_copies == 0


class _SameGpuPeer:
    """A tensor of this process standing in for a mapped peer cache on this very GPU."""

    same_device = True

    def __init__(self, owner: torch.Tensor, nbytes: int | None = None) -> None:
        self.addr, self.nbytes = owner.data_ptr(), nbytes or owner.numel() * owner.element_size()
        self._bytes = owner.view(-1).view(torch.uint8)[: self.nbytes]

    def region_bytes(self) -> torch.Tensor:
        return self._bytes


@pytest.mark.gpu
@pytest.mark.parametrize("sm_reads", [True, False], ids=["on the SMs", "by the copy engines"])
def test_a_peer_on_this_very_gpu_is_read_through_the_mapping_whatever_the_runs(sm_reads):
    """NIXL/UCX stages a same-GPU read through the host (~0.4 GB/s on an H200): one run goes
    through the mapping too. On the SMs (the default with Triton), one kernel, which also digests the
    blocks it wrote: wsum64 digests equal to those of the local blocks afterwards."""
    layout = KVCacheLayout(16, 2, 4, 2, 8, "float16")
    owner = torch.randn(layout.shape, device="cuda").half()
    kv = torch.zeros(layout.shape, dtype=torch.float16, device="cuda")
    copier = cuda_ipc.IpcCopier(kv, layout, min_runs=16, sm_reads=sm_reads)
    assert copier.sm_reads is sm_reads
    local, remote = np.array([0, 1, 2, 9]), np.array([5, 6, 7, 1])
    copy = copier.start("READ", _SameGpuPeer(owner), layout, local, remote)
    assert copy is not None and copy.num_runs == (1 if sm_reads else 2)
    copy.event.synchronize()
    assert torch.equal(kv[[0, 1, 2, 9]], owner[[5, 6, 7, 1]])
    assert not kv[[3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]].any()
    if sm_reads:
        expected = block_digests(region_bytes(kv, layout), layout, local, WSUM)
        assert copy.digests.result() == expected
        assert expected == block_digests(region_bytes(owner, layout), layout, remote, WSUM)
        assert copier.num_sm_reads == 1
    else:
        assert copy.digests is None


@pytest.mark.gpu
def test_a_read_on_the_sms_refuses_a_peer_layout_that_reaches_past_its_mapping():
    """The peer's layout is its own claim: one that spans more than the bytes it exported would send
    the kernel outside the mapping (a device fault: the node down). Refused; nothing is written."""
    layout = KVCacheLayout(16, 2, 4, 2, 8, "float16")
    owner = torch.randn(layout.shape, device="cuda").half()
    kv = torch.zeros(layout.shape, dtype=torch.float16, device="cuda")
    copier = cuda_ipc.IpcCopier(kv, layout, min_runs=1)
    bigger = KVCacheLayout(64, 2, 4, 2, 8, "float16")  # claims 4x the exported bytes
    with pytest.raises(TransferError, match="past"):
        copier.start("READ", _SameGpuPeer(owner), bigger, np.array([0]), np.array([40]))
    with pytest.raises(IndexError):
        copier.start("READ", _SameGpuPeer(owner), layout, np.array([0]), np.array([16]))
    torch.cuda.synchronize()
    assert not kv.any()
