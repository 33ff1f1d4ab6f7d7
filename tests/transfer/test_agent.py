"""NixlAgent: import errors, backend selection, handle bookkeeping (one process, loopback)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvbridge.errors import NixlNotAvailableError, TransferError
from kvbridge.transfer import agent as agent_mod
from kvbridge.transfer import nixl_build
from kvbridge.transfer.agent import NixlAgent, XferState, tensor_registration

torch = pytest.importorskip("torch")


def test_missing_nixl_says_what_to_install(monkeypatch):
    for name in ("nixl", *nixl_build.BUILDS):  # no build importable: `import_module(...)` fails for each
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(nixl_build.importlib.util, "find_spec", lambda name: None)
    assert not nixl_build.is_available()
    with pytest.raises(NixlNotAvailableError, match="pip install nixl-cu12"):
        agent_mod.import_nixl()


@pytest.mark.nixl
def test_one_nixl_build_serves_the_api():
    api = nixl_build.nixl_api()
    assert nixl_build.find_build() is not None and hasattr(api, "nixl_agent") and hasattr(api, "nixlBind")


def test_tensor_registration_of_cpu_tensor():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    reg = tensor_registration(t)
    assert reg == (t.data_ptr(), 64, 0, "DRAM")
    with pytest.raises(ValueError, match="contiguous"):
        tensor_registration(t.t())


@pytest.mark.nixl
def test_unknown_backend_is_a_named_error():
    with pytest.raises(NixlNotAvailableError, match="KVBRIDGE_NIXL_BACKEND"):
        NixlAgent("agent-bad-backend", backend="NO_SUCH_BACKEND")


@pytest.mark.nixl
def test_backend_from_env(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_NIXL_BACKEND", "NO_SUCH_BACKEND_EITHER")
    with pytest.raises(NixlNotAvailableError, match="NO_SUCH_BACKEND_EITHER"):
        NixlAgent("agent-env-backend")


@pytest.mark.nixl
def test_loopback_read_write_and_release_everything():
    """Two agents in one process: register, add peer, post READ and WRITE, re-add peer, close."""
    src = torch.arange(4096, dtype=torch.int32)  # 16 KiB
    dst = torch.zeros(4096, dtype=torch.int32)
    a, b = NixlAgent("loop-a"), NixlAgent("loop-b")
    try:
        reg_src = b.register_tensor(src)
        reg_dst = a.register_tensor(dst)
        a.add_peer("loop-b", b.metadata)
        a.add_peer("loop-b", b.metadata)  # same metadata: no-op
        assert a.has_peer("loop-b")
        with pytest.raises(TransferError, match="handshake said"):
            a.add_peer("someone-else", b.metadata)
        chunk = 1024  # bytes per descriptor
        offs = np.arange(16, dtype=np.uint64) * chunk
        local = a.prep_local(np.stack([reg_dst.base_addr + offs, np.full(16, chunk), np.zeros(16)], 1), "DRAM")
        remote = a.prep_remote("loop-b", np.stack([reg_src.base_addr + offs, np.full(16, chunk), np.zeros(16)], 1),
                               "DRAM")
        idx = np.array([3, 4, 5, 9])
        xfer = a.post("READ", local, idx, remote, idx)
        while (state := a.poll(xfer)) is XferState.IN_PROGRESS:
            pass
        assert state is XferState.DONE and a.poll(xfer) is XferState.DONE  # released: stays DONE
        ints = chunk // 4
        for i in range(16):
            want = src[i * ints:(i + 1) * ints] if i in idx else torch.zeros(ints, dtype=torch.int32)
            assert torch.equal(dst[i * ints:(i + 1) * ints], want), i
        dst[:ints] = -1
        xfer = a.post("WRITE", local, [0], remote, [15])
        while a.poll(xfer) is XferState.IN_PROGRESS:
            pass
        assert (src[15 * ints:] == -1).all()
        with pytest.raises(ValueError):
            a.post("COPY", local, [0], remote, [0])
        a.remove_peer("loop-b")  # releases the peer's prepared list too
        assert not a.has_peer("loop-b") and len(a._dlists) == 1
        with pytest.raises(TransferError, match="handshake"):
            a.prep_remote("loop-b", np.zeros((1, 3)), "DRAM")
        a.add_peer("loop-b", b.metadata)  # re-adding after removal works
        assert a.has_peer("loop-b")
    finally:
        a.close()
        b.close()
        a.close()  # idempotent
    assert not a._dlists and not a._xfers and not a._registrations and not a._peers


def test_a_cuda_torch_without_its_nixl_build_is_refused_naming_it(monkeypatch):
    fake_torch = type(sys)("torch")
    fake_torch.version = type(sys)("torch.version")
    fake_torch.version.cuda = "13.0"
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    installed = {"nixl_cu12"}  # what a plain `pip install kvbridge` brings
    monkeypatch.setattr(nixl_build.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    with pytest.raises(ImportError, match=r"CUDA 13 build .*kvbridge\[cu13\]"):
        nixl_build.find_build()
    installed.add("nixl_cu13")
    assert nixl_build.find_build() == "nixl_cu13"
    fake_torch.version.cuda = None  # a CPU torch: the first build installed
    assert nixl_build.find_build() == "nixl_cu12"
