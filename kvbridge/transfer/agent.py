"""A thin owner of one NIXL agent: memory registration, peers, prepared lists, transfers.

Who calls it: `KVEndpoint` (P/D transfers), through its `PeerDirectory` and `NixlPoster`.
Every method must be called from one thread, the owner's, unless the agent was created with
`thread_safe=True` (NIXL's strict sync mode).

Lifetime rules, all enforced here so callers cannot leak:
- `register_tensor` keeps the tensor's NIXL registration until `deregister` or `close`; call
  either before the tensor is freed.
- prepared lists (`prep_local` / `prep_remote`) are released by `release_dlist`, by
  `remove_peer` (the peer's lists) or by `close`.
- a transfer handle is released as soon as `poll` sees it DONE or FAILED, by `release`, or by
  `close`; `close` releases transfers, then lists, then peers, then registrations. Idempotent.

Remote descriptors are always built locally (from the handshake's region info): NIXL's
`get_serialized_descs` / `deserialize_descs` unpickle and are never used here.

NIXL comes from the `nixl` meta package, which picks nixl_cu12 / nixl_cu13 / nixl_rocm. On a
host without a GPU its UCX backend moves host memory between processes; UCX_TLS, if set, must
include `tcp` (NIXL needs an active-message transport with peer-failure detection), e.g.
`UCX_TLS=tcp,cma,self`; unset, UCX picks cma (process_vm_readv) for same-host copies.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvbridge import env
from kvbridge.errors import NixlNotAvailableError, TransferError
from kvbridge.transfer.nixl_build import nixl_api
from kvbridge.transfer.options import TransferOp

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class XferState(enum.Enum):
    """What `NixlAgent.poll` saw."""

    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class Registration(NamedTuple):
    """One registered memory region, as a peer needs to see it (see messages.KVRegion)."""

    base_addr: int
    nbytes: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM" | "FILE" ...


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) from the installed NIXL build (nixl_build.py), or NixlNotAvailableError."""
    try:
        api = nixl_api()
    except ImportError as e:
        raise NixlNotAvailableError(f"NIXL is not importable: {e}") from None
    return api.nixl_agent, api.nixl_agent_config


_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def progress_delay(delay_us: int):
    """Agents made inside get a progress thread that pauses `delay_us` between rounds.

    NIXL's Python wrapper hard-codes the delay to 0, and its UCX progress thread then spins a whole
    core even when the agent is idle (measured: 0.96 of a core; 0.02 at 100 us). The delay is a
    field of the C++ agent config that the wrapper builds; this swaps in a config type that keeps
    our value, for the duration of one construction.
    """
    api = nixl_api()
    base = api.nixlBind.nixlAgentConfig

    class _DelayedConfig(base):
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = base


def tensor_registration(tensor: torch.Tensor) -> Registration:
    """The region a contiguous tensor occupies: CPU -> DRAM, CUDA -> VRAM."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered with NIXL")
    is_cuda = tensor.device.type == "cuda"
    return Registration(
        tensor.data_ptr(),
        tensor.numel() * tensor.element_size(),
        (tensor.device.index or 0) if is_cuda else 0,
        "VRAM" if is_cuda else "DRAM",
    )


def _backend_hint(backend: str, error: Exception) -> str:
    """What to try when UCX cannot start: NIXL_ERR_BACKEND there means UCX found no transport that
    NIXL can use (it needs active messages with peer-failure detection), which UCX_TLS decides."""
    if backend != "UCX" or "NIXL_ERR_BACKEND" not in str(error):
        return ""
    tls = env.ucx_tls()
    setting = f"UCX_TLS={tls}" if tls else "UCX_TLS unset"
    return (
        f" ({setting}): UCX found no usable transport. Include tcp in UCX_TLS, e.g. UCX_TLS=tcp,self,sm on a "
        "machine without RDMA or CUDA (shared memory alone, UCX_TLS=sm,self, is not enough), or unset UCX_TLS"
    )


class NixlAgent:
    """One NIXL agent with one backend (UCX unless `backend` or KVBRIDGE_NIXL_BACKEND says otherwise)."""

    def __init__(
        self,
        name: str,
        backend: str | None = None,
        *,
        backend_params: dict[str, str] | None = None,
        num_threads: int = 0,
        thread_safe: bool = False,
    ) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        nixl_thread_sync_t = nixl_api().nixl_thread_sync_t

        self.name = name
        self.backend = backend or env.nixl_backend()
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
        with progress_delay(round(env.nixl_progress_delay_us())):
            self._agent = nixl_agent(name, nixl_agent_config(backends=[], num_threads=num_threads, sync_mode=sync))
        available = self._agent.get_plugin_list()
        if self.backend not in available:
            raise NixlNotAvailableError(
                f"NIXL backend {self.backend!r} is not available (plugins found: {sorted(available)}); "
                "set KVBRIDGE_NIXL_BACKEND to one of them"
            )
        params = dict(backend_params or {})
        if num_threads > 0 and self.backend == "UCX":
            params.setdefault("num_threads", str(num_threads))
        try:
            self._agent.create_backend(self.backend, params)
        except Exception as e:
            raise NixlNotAvailableError(f"NIXL backend {self.backend!r} failed to start: {e}{_backend_hint(self.backend, e)}") from None
        self._registrations: dict[int, tuple[Registration, Any]] = {}  # base_addr -> (reg, nixl reg dlist)
        self._peers: dict[str, bytes] = {}  # agent name -> metadata
        self._dlists: dict[int, tuple[str | None, Any]] = {}  # id(handle) -> (peer or None, handle)
        self._xfers: dict[int, Any] = {}  # id(handle) -> in-flight nixl_xfer_handle
        self._closed = False

    # ------------------------------------------------------------------ memory

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registrations), sent to peers in the handshake."""
        return self._agent.get_agent_metadata()

    def register_tensor(self, tensor: torch.Tensor) -> Registration:
        """Register a contiguous CPU or CUDA tensor; returns its region. Deregister before freeing it."""
        reg = tensor_registration(tensor)
        if reg.mem_type == "VRAM" and env.torch_uses_expandable_segments():
            # Such memory cannot be exported with cuIpcGetMemHandle: UCX then silently drops from
            # cuda_ipc to an emulated path that is orders of magnitude slower (still correct).
            logger.warning(
                "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: GPU-to-GPU transfers of this KV "
                "cache cannot use cuda_ipc and will be very slow; unset it for the engine process"
            )
        return self.register_region(reg)

    def register_tensors(self, tensors: list[torch.Tensor]) -> list[Registration]:
        """Register several contiguous tensors of one device in one NIXL registration (an engine's KV
        held one tensor per layer); deregister them together, through the first one's Registration."""
        regs = [tensor_registration(t) for t in tensors]
        if len({(r.device_id, r.mem_type) for r in regs}) != 1:
            raise ValueError("tensors registered together must share one device")
        descs = [(r.base_addr, r.nbytes, r.device_id, "") for r in regs]
        self._registrations[regs[0].base_addr] = (regs[0], self._agent.register_memory(descs, regs[0].mem_type))
        return regs

    def register_region(self, reg: Registration, meta: str = "") -> Registration:
        """Register raw memory (or a FILE region: base_addr = offset, device_id = fd, meta = path)."""
        dlist = self._agent.register_memory([(reg.base_addr, reg.nbytes, reg.device_id, meta)], reg.mem_type)
        self._registrations[reg.base_addr] = (reg, dlist)
        return reg

    def deregister(self, reg: Registration) -> None:
        entry = self._registrations.pop(reg.base_addr, None)
        if entry is not None:
            self._agent.deregister_memory(entry[1])

    # ------------------------------------------------------------------ peers

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Load a peer's metadata. Same name, new metadata (a restarted peer): the old one is dropped first."""
        if self._peers.get(name) == metadata:
            return
        if name in self._peers:
            self.remove_peer(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(f"NIXL rejected the metadata of peer {name!r}: {e}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            if loaded not in self._peers:  # never drop a peer we already use
                self._agent.remove_remote_agent(loaded)
            raise TransferError(f"peer metadata names agent {loaded!r}, the handshake said {name!r}")
        self._peers[name] = metadata

    def remove_peer(self, name: str) -> None:
        """Release the peer's prepared lists and forget its metadata (also disconnects). Idempotent."""
        for key, (peer, handle) in list(self._dlists.items()):
            if peer == name:
                self._release_dlist_key(key)
        if self._peers.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # already gone on NIXL's side
                logger.debug("remove_remote_agent(%s): %s", name, e)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    # ------------------------------------------------------------------ descriptor lists

    def prep_local(self, descs: np.ndarray, mem_type: str) -> Any:
        """Prepare local descriptors [N, 3] = (addr, nbytes, device_id); released by release_dlist/close."""
        return self._prep("", None, descs, mem_type)

    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: str) -> Any:
        """Prepare a peer's descriptors [N, 3]; released by release_dlist/remove_peer/close."""
        if peer not in self._peers:
            raise TransferError(f"no NIXL metadata for peer {peer!r}; handshake with it first")
        return self._prep(peer, peer, descs, mem_type)

    def _prep(self, agent_name: str, peer: str | None, descs: np.ndarray, mem_type: str) -> Any:
        descs = np.ascontiguousarray(descs, dtype=np.uint64).reshape(-1, 3)
        try:
            handle = self._agent.prep_xfer_dlist(agent_name, descs, mem_type)
        except Exception as e:
            where = f"peer {peer!r}" if peer else "local memory"
            raise TransferError(f"NIXL cannot prepare {len(descs)} descriptors of {where}: {e}") from None
        self._dlists[id(handle)] = (peer, handle)
        return handle

    def release_dlist(self, handle: Any) -> None:
        self._release_dlist_key(id(handle))

    def _release_dlist_key(self, key: int) -> None:
        entry = self._dlists.pop(key, None)
        if entry is not None:
            entry[1].release()

    # ------------------------------------------------------------------ transfers

    def post(self, op: TransferOp | str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> Any:
        """Post a READ (remote -> local) or WRITE (local -> remote) of the indexed descriptors.

        NIXL merges entries adjacent on both sides. Returns the transfer handle to `poll`. Raises
        ValueError for another `op`, TransferError if NIXL refuses.
        """
        op = TransferOp(op).value
        li = np.ascontiguousarray(local_idx, dtype=np.int32)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int32)
        try:
            handle = self._agent.make_prepped_xfer(op, local, li, remote, ri)
        except Exception as e:
            raise TransferError(f"NIXL refused a {op} of {len(li)} descriptors: {e}") from None
        self._xfers[id(handle)] = handle
        try:
            status = self._agent.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise TransferError(f"NIXL could not post a {op}: {e}") from None
        if status == "ERR":
            self.release(handle)
            raise TransferError(f"NIXL could not post a {op} (status ERR)")
        return handle

    def poll(self, handle: Any) -> XferState:
        """Non-blocking. DONE and FAILED release the handle; polling a released handle says DONE."""
        if id(handle) not in self._xfers:
            return XferState.DONE
        try:
            status = self._agent.check_xfer_state(handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
            logger.warning("NIXL transfer failed: %s", e)
            status = "ERR"
        if status == "PROC":
            return XferState.IN_PROGRESS
        self.release(handle)
        return XferState.DONE if status == "DONE" else XferState.FAILED

    def release(self, handle: Any) -> None:
        """Release a transfer handle (cancels it if still in flight). Idempotent; never raises."""
        if self._xfers.pop(id(handle), None) is None:
            return
        try:
            handle.release()
        except Exception as e:  # NIXL keeps handles it cannot cancel and frees them with the agent
            logger.warning("NIXL transfer handle could not be released now: %s", e)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Release transfers, lists, peers and registrations, in that order. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers.values()):
            self.release(handle)
        for key in list(self._dlists):
            self._release_dlist_key(key)
        for name in list(self._peers):
            self.remove_peer(name)
        for reg, dlist in list(self._registrations.values()):
            try:
                self._agent.deregister_memory(dlist)
            except Exception as e:
                logger.warning("NIXL deregistration failed: %s", e)
        self._registrations.clear()
