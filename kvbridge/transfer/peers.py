"""`PeerDirectory`: the remote engines one `KVEndpoint` talks to, by side-channel address.

It runs handshakes (blocking, or on a helper thread that touches only the network), loads a
peer's NIXL metadata and caches its prepared descriptor list (one entry per block, or per page
when either side's blocks are not one byte range) on the owner's thread,
maps a same-host GPU peer's KV tensor through CUDA IPC when it offers one (see cuda_ipc.py),
forgets peers (releasing what was cached), and keeps one side-channel client per address for
`request`. Only `request` may be called from other threads.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from kvbridge.errors import HandshakeError, TransferError
from kvbridge.transfer import messages as m
from kvbridge.transfer.agent import NixlAgent
from kvbridge.transfer.auth import audience_of
from kvbridge.transfer.cuda_ipc import IpcMapping, can_map
from kvbridge.transfer.descriptors import block_descs, transfer_unit
from kvbridge.transfer.handshake import LocalIdentity, PeerInfo, make_request, peer_from_response
from kvbridge.transfer.side_channel import SideChannelClient

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class PeerDirectory:
    def __init__(
        self,
        agent: NixlAgent,
        me: LocalIdentity,
        *,
        secret: bytes | None,
        timeout_s: float,
        retries: int,
        cache_block_lists: bool,
        ipc_device: torch.device | None = None,
        before_unmap: Callable[[], None] = lambda: None,
    ) -> None:
        self._agent, self._me = agent, me
        self._before_unmap = before_unmap  # waits for the copies in flight through any mapping
        self._secret, self._timeout_s, self._retries = secret, timeout_s, retries
        self._cache_block_lists = cache_block_lists
        self._ipc_device = ipc_device  # the GPU of a local KV cache that maps same-host peers' caches
        self._mappings: dict[str, IpcMapping] = {}  # address -> the peer's KV mapped through CUDA IPC
        self._peers: dict[str, PeerInfo] = {}
        self._block_lists: dict[str, object] = {}  # address -> prepared per-unit remote list
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"kvbridge-handshake-{me.engine_id}")
        self._clients: dict[str, SideChannelClient] = {}  # guarded by _clients_lock
        self._clients_lock = threading.Lock()
        self._closed = False

    def __contains__(self, address: str) -> bool:
        return address in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, address: str) -> PeerInfo:
        return self._peers[address]

    def addresses(self) -> list[str]:
        """The known peers' addresses (handshake answered)."""
        return list(self._peers)

    def mapping(self, address: str) -> IpcMapping | None:
        """The peer's KV tensor mapped through CUDA IPC (same host, GPU to GPU), or None: use NIXL."""
        return self._mappings.get(address)

    def block_list(self, address: str) -> object:
        """The peer's prepared list with one descriptor per `transfer_unit(ours, its)` (only with
        cache_block_lists), entries named by `descriptors.unit_indices`."""
        return self._block_lists[address]

    def handshake(self, address: str) -> PeerInfo:
        """Blocking handshake (or wait for the one in flight), then connect. Raises the named errors."""
        if address not in self._peers:
            future = self._pending.pop(address, None)
            self._connect(future.result() if future is not None else self._fetch(address))
        return self._peers[address]

    def start_handshake(self, address: str, *, refresh: bool = False) -> None:
        """Begin a handshake on the helper thread unless one is in flight or the peer is known.

        `refresh`: handshake a known peer again (it may have restarted); the cached peer is kept if
        the answer comes from the same engine instance, replaced otherwise.
        """
        if address not in self._pending and (refresh or address not in self._peers):
            self._pending[address] = self._pool.submit(self._fetch, address)

    def is_handshaking(self, address: str) -> bool:
        return address in self._pending

    def drop_handshakes(self, wanted: set[str]) -> None:
        """Cancel queued handshakes with addresses no transfer waits for any more: requests naming
        many silent addresses must not leave a queue of doomed handshakes ahead of a real peer's."""
        for address, future in list(self._pending.items()):
            if address not in wanted and future.cancel():
                del self._pending[address]

    def finish_handshakes(self) -> dict[str, Exception]:
        """Connect every peer whose handshake completed; return the failures by address."""
        failures = {}
        for address, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[address]
            try:
                self._connect(future.result())
            except Exception as e:
                failures[address] = e
        return failures

    def forget(self, address: str) -> None:
        """Drop the peer's metadata, cached list, mapping and socket; the next transfer handshakes again."""
        with self._clients_lock:
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()
        info = self._peers.pop(address, None)
        self._block_lists.pop(address, None)  # released by remove_peer below
        mapping = self._mappings.pop(address, None)
        if mapping is not None:  # forgotten after a failure, at close, or replaced by a restarted peer
            self._before_unmap()
            mapping.close()
        if info is not None:
            for rank in info.ranks:  # a tensor-parallel node's other ranks: one agent each
                self._agent.remove_peer(rank.agent_name)
            self._agent.remove_peer(info.agent_name)

    def request(self, address: str, msg: m.Message, audience: bytes = b"") -> m.Message:
        """Side-channel request/reply with `address`; any thread. Raises SideChannelClient's errors."""
        with self._clients_lock:
            if self._closed:
                raise TransferError("the endpoint is closed")
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = self._new_client(address)
        return client.request(msg, audience=audience)

    def close(self) -> None:
        """Stop handshakes, close clients (waiting for a request in flight), forget every peer."""
        with self._clients_lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            client.close()
        for address in list(self._peers):
            self.forget(address)

    def _new_client(self, address: str) -> SideChannelClient:
        return SideChannelClient(address, self._secret, self._timeout_s, self._retries)

    def _fetch(self, address: str) -> PeerInfo:  # may run on the helper thread: no NIXL here
        """Ping (who answers there now?), then a handshake addressed to that very instance.

        Addressed, a signed handshake captured on the network cannot be replayed to another node or
        to a restarted one; the ping it costs is a millisecond on a handshake done once per peer.
        """
        client = self._new_client(address)
        try:
            pong = client.request(m.Ping(engine_id=self._me.engine_id))
            if not isinstance(pong, m.Pong) or not pong.incarnation:
                raise HandshakeError(f"peer {address} answered a ping with {type(pong).__name__} and no incarnation")
            resp = client.request(make_request(self._me), audience=audience_of(pong.engine_id, pong.incarnation))
        finally:
            client.close()
        info = peer_from_response(resp, address, self._me.compat_hash, self._me.layout, self._me.model_hash)
        if (info.engine_id, info.incarnation) != (pong.engine_id, pong.incarnation):
            raise HandshakeError(f"peer {address} changed between its ping and its handshake (it restarted)")
        return info

    def _connect(self, info: PeerInfo) -> None:
        known = self._peers.get(info.address)
        if known is not None:
            if (known.engine_id, known.incarnation, known.agent_name) == (info.engine_id, info.incarnation, info.agent_name):
                return  # a refresh found the same instance
            logger.info(
                "peer %s is a new instance (engine %s, incarnation %s); forgetting the previous one",
                info.address, info.engine_id, info.incarnation,
            )  # fmt: skip
            self.forget(info.address)
        self._agent.add_peer(info.agent_name, info.agent_metadata)
        for rank in info.ranks:
            self._agent.add_peer(rank.agent_name, rank.agent_metadata)
        self._peers[info.address] = info
        is_translated = info.is_read_through_plan(self._me.shard)  # read through plans only
        if self._cache_block_lists and not is_translated:
            r = info.region
            descs = block_descs(info.layout, r.base_addr, r.device_id, transfer_unit(self._me.layout, info.layout), r.layer_addrs)
            self._block_lists[info.address] = self._agent.prep_remote(info.agent_name, descs, r.mem_type)
        if self._ipc_device is not None and can_map(info.cuda_ipc) and not is_translated:
            self._map(info)

    def _map(self, info: PeerInfo) -> None:
        export = info.cuda_ipc
        if export.nbytes != info.layout.region_nbytes or not 0 <= export.offset < 1 << 56 or len(export.handle) != 64:
            logger.warning(
                "peer %s exports %d bytes at offset %d through CUDA IPC, but its layout spans %d bytes; its transfers "
                "go through NIXL", info.address, export.nbytes, export.offset, info.layout.region_nbytes,
            )  # fmt: skip
            return
        try:
            self._mappings[info.address] = IpcMapping(info.cuda_ipc, self._ipc_device)
            logger.info("transfers with peer %s go through a CUDA IPC mapping", info.address)
        except (TransferError, OSError) as e:  # no driver, refused handle, other host: NIXL does it
            logger.warning("CUDA IPC mapping of peer %s failed (%s); its transfers go through NIXL", info.address, e)
