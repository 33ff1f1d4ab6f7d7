"""The CUDA IPC fast path's host-side parts (the GPU read itself: tests/transfer/test_endpoint.py, `gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.errors import TransferError
from kvbridge.transfer import cuda_ipc


def test_exports_round_trip_and_are_mapped_only_from_another_process_on_this_host():
    export = cuda_ipc.IpcExport(cuda_ipc.host_id(), os.getpid() + 1, b"\x01" * 64, 256, 1 << 20, "GPU-x")
    assert cuda_ipc.decode_export(cuda_ipc.encode_export(export)) == export
    same_process = cuda_ipc.IpcExport(cuda_ipc.host_id(), os.getpid(), b"\x01" * 64, 0, 1, "GPU-x")
    other_host = cuda_ipc.IpcExport("another-boot-id", os.getpid() + 1, b"\x01" * 64, 0, 1, "GPU-x")
    no_gpu = cuda_ipc.IpcExport(cuda_ipc.host_id(), os.getpid() + 1, b"\x01" * 64, 0, 1, "")
    assert not any(cuda_ipc.can_map(e) for e in (same_process, other_host, no_gpu))


def test_handles_keep_every_byte():
    raw = bytes([0, 1, 0, 2] * 16)  # NULs inside: a C-string round trip would cut them off
    assert cuda_ipc._IpcHandle.from_bytes(raw).to_bytes() == raw
    with pytest.raises(TransferError, match="64 bytes"):
        cuda_ipc._IpcHandle.from_bytes(raw[:10])


def test_malformed_export_is_a_named_error():
    with pytest.raises(TransferError, match="CUDA IPC export"):
        cuda_ipc.decode_export(b"\x93garbage")


def test_cpu_tensors_are_not_exported():
    assert cuda_ipc.export_tensor(torch.zeros(16)) is None
