"""The CUDA IPC fast path's host-side parts (the GPU read itself: tests/transfer/test_endpoint.py, `gpu`)."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from kvbridge.errors import MalformedMessageError, TransferError
from kvbridge.transfer import cuda_ipc
from kvbridge.transfer import messages as m


def export(**changes) -> m.IpcExport:
    fields = dict(host_id=cuda_ipc.host_id(), pid=os.getpid() + 1, handle=b"\x01" * 64, offset=256,
                  nbytes=1 << 20, device_uuid="GPU-x")
    return m.IpcExport(**{**fields, **changes})


def handshake_response(cuda_ipc_export) -> m.HandshakeResponse:
    region = m.KVRegion(base_addr=4096, nbytes=1 << 20)
    return m.HandshakeResponse(protocol_version=1, engine_id="e", compat_hash="h", agent_name="a",
                               agent_metadata=b"md", regions=[region], num_blocks=8, block_nbytes=1024,
                               cuda_ipc=cuda_ipc_export)


def test_the_export_travels_in_the_handshake_and_old_peers_need_not_send_it():
    assert m.decode(m.encode(handshake_response(export()))).cuda_ipc == export()
    assert m.decode(m.encode(handshake_response(None))).cuda_ipc is None
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(handshake_response(export())), "cuda_ipc": {"pid": "x"}})
    with pytest.raises(MalformedMessageError):
        m.decode(bad)


def test_exports_are_mapped_only_from_another_process_on_this_host():
    # (the GPU itself must also be visible here, which a CPU-only test cannot show)
    for other in (export(pid=os.getpid()), export(host_id="another-boot-id"), export(device_uuid="")):
        assert not cuda_ipc.can_map(other)


def test_handles_keep_every_byte():
    raw = bytes([0, 1, 0, 2] * 16)  # NULs inside: a C-string round trip would cut them off
    assert cuda_ipc._IpcHandle.from_bytes(raw).to_bytes() == raw
    with pytest.raises(TransferError, match="64 bytes"):
        cuda_ipc._IpcHandle.from_bytes(raw[:10])


def test_cpu_tensors_are_not_exported():
    assert cuda_ipc.export_tensor(torch.zeros(16)) is None
