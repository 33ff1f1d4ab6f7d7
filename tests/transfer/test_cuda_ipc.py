"""The CUDA IPC fast path's host-side parts (the GPU read itself: tests/transfer/test_endpoint.py, `gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.errors import TransferError
from kvbridge.transfer import cuda_ipc


def test_exports_round_trip_and_are_mapped_only_from_another_process_on_this_host():
    export = cuda_ipc.IpcExport(cuda_ipc.host_id(), os.getpid() + 1, b"\x01" * 64, 256, 1 << 20)
    assert cuda_ipc.decode_export(cuda_ipc.encode_export(export)) == export
    assert cuda_ipc.can_map(export)
    same_process = cuda_ipc.IpcExport(cuda_ipc.host_id(), os.getpid(), b"\x01" * 64, 0, 1)
    other_host = cuda_ipc.IpcExport("another-boot-id", os.getpid() + 1, b"\x01" * 64, 0, 1)
    assert not cuda_ipc.can_map(same_process) and not cuda_ipc.can_map(other_host)


def test_malformed_export_is_a_named_error():
    with pytest.raises(TransferError, match="CUDA IPC export"):
        cuda_ipc.decode_export(b"\x93garbage")


def test_cpu_tensors_are_not_exported():
    assert cuda_ipc.export_tensor(torch.zeros(16)) is None
