"""Scheduler half of the NixlConnector: pure bookkeeping, no torch, no nixl, no I/O.

Prefill (producer): a request sent with `do_remote_decode` keeps its prompt's full blocks when it
finishes (`delay_free_blocks`) and returns `RemotePrefillParams`; the worker holds them under a
lease until the decode side reports the read, or the lease expires. Where the worker half shares
this process (local_grants.py) it grants the lease on the spot, and the params carry its signed
grant; otherwise it grants in its next step.

Decode (consumer): a request with `do_remote_prefill` asks for the remote blocks that its own
prefix cache lacks, loaded asynchronously (the request parks in WAITING_FOR_REMOTE_KVS); the
worker reads them and tells the prefill engine to release them.

At once (transfer/offers.py): a decode request that names a hand-off key instead of the params waits
(matched as "ask again") until the prefill's offer of them is in this node's inbox; the prefill sends
that offer in the `request_finished` that makes them. The inbox and outbox are the only sockets here,
both drained or written without blocking, on the engine thread.
"""

from __future__ import annotations

import collections
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge.connectors.base import (
    ConnectorRequest,
    KVConnectorOutput,
    KVHandoff,
    MatchResult,
    RequestStatus,
    SchedulerOutput,
)
from kvbridge.connectors.nixl import local_grants
from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata, RecvJob, RemoteEngine
from kvbridge.errors import AuthenticationError, InvalidRequestError
from kvbridge.kv_transfer_params import (
    HandoffRequest,
    RemotePrefillParams,
    parse_handoff,
    parse_handoff_inbox,
    parse_handoff_key,
    parse_remote_prefill,
    wants_remote_decode,
)
from kvbridge.transfer.address_proof import SideChannelAddress, check_address, prove_address
from kvbridge.transfer.messages import HandoffOffer, LeaseRef

if TYPE_CHECKING:
    from kvbridge.block_hash import BlockHash
    from kvbridge.config import KVTransferConfig
    from kvbridge.connectors.nixl.peer_policy import PeerPolicy
    from kvbridge.transfer.offers import OfferInbox, OfferOutbox

logger = logging.getLogger(__name__)

# Key of KVConnectorOutput.stats (the worker's get_step_stats) under which it reports its side-channel port.
SIDE_CHANNEL_PORT_STAT = "nixl_side_channel_port"
# ... and the prefill engines whose side channels did not answer this step (their handshakes failed), as
# unreachable_peer_key strings: an engine restarted at the same address is another incarnation, tried at once.
UNREACHABLE_PEERS_STAT = "nixl_unreachable_peers"
# ... and, when it changed, every prefill engine (unreachable_peer_key) it can read from on its own device in
# a step (a CUDA IPC mapping, the same pages, one rank, a grant key): requests whose params name one and carry
# a grant load synchronously there (NixlConnector option sync_ipc_reads).
DEVICE_READ_PEERS_STAT = "nixl_device_read_peers"


def offer_latency_stats(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50 and max of the hand-offs' latencies from the prefill's send to the decode's take ({} before any)."""
    if not latencies_ms:
        return {}
    ordered = sorted(latencies_ms)
    return {"offer_latency_ms_p50": ordered[len(ordered) // 2], "offer_latency_ms_max": ordered[-1]}


def unreachable_peer_key(address: str, incarnation: str) -> str:
    """Names one prefill engine instance in UNREACHABLE_PEERS_STAT (plain strings: the stats cross processes)."""
    return f"{incarnation}@{address}"


class NixlScheduler:
    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        lease_s: float,
        incarnation: str,
        peer_policy: PeerPolicy,
        secret: bytes | None = None,
        wall_clock: Callable[[], float] = time.time,
        unreachable_cooldown_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sync_ipc_reads: bool = False,
        inbox: OfferInbox | None = None,
        outbox: OfferOutbox | None = None,
        handoff_wait_s: float = 30.0,
        idle_step_wait_s: float = 0.0,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.lease_s = lease_s
        self.incarnation = incarnation  # this engine instance, named in every lease it grants
        self.peer_policy = peer_policy
        # The side-channel secret (None: --insecure-side-channel): the prefill vouches for its address
        # with it, the decode connects to no address it does not vouch for (transfer/address_proof.py).
        self._secret = secret
        self._wall_clock = wall_clock
        # decode: prefill engines (incarnation@address) that did not answer, until when requests naming them
        # are computed here (refused before admission: no load error, whatever vLLM's kv_load_failure_policy)
        self._unreachable_cooldown_s, self._clock = unreachable_cooldown_s, clock
        self._unreachable_until: dict[str, float] = {}
        self.side_channel_port = config.side_channel_port  # replaced by the bound port once the worker reports it
        self._local_hits: dict[str, int] = {}  # decode: local prefix hit seen at matching
        self._handled: set[str] = set()  # decode: remote KV already asked for (never twice)
        self._vouched: set[str] = set()  # decode: requests whose prefill address was proven (checked once)
        # decode: requests whose remote blocks were refused, counted and logged once however often the
        # engine asks (vLLM asks again each step a request waits: the answer must have no side effect)
        self._refused: set[str] = set()
        self._refusals: dict[str, str] = {}  # decode: why a request's params were refused, until taken
        self._new_recvs: dict[str, RecvJob] = {}
        # decode, with sync_ipc_reads: the prefill engines the worker reads from on its device in a step (its
        # last DEVICE_READ_PEERS_STAT; it changes only between steps, so matching and allocation agree)
        self._sync_ipc_reads = sync_ipc_reads
        self._device_peers: frozenset[str] = frozenset()
        # at once: the decode's inbox, the requests' offered params until they finish, and the key and
        # deadline of each request waiting for its offer; the prefill's outbox
        self._inbox, self._outbox, self._handoff_wait_s = inbox, outbox, handoff_wait_s
        self._offered: dict[str, dict[str, Any]] = {}
        self._waiting_for_offer: dict[str, tuple[str, float]] = {}  # request id -> (its handoff key, until when)
        # at once, decode: after a step that ran no model (the engine polls again only after a sleep), the
        # next schedule may wait up to idle_step_wait_s on the inbox for one waiting request's offer, once
        self._idle_step_wait_s = idle_step_wait_s
        self._may_wait_for_offer = False
        self.num_offer_waits_ended = 0  # ... the offer came within the wait
        self.num_offer_waits_timed_out = 0
        self.offer_wait_ms_total = 0.0
        # decode: from the prefill's send of an offer to this scheduler's taking it, the last 256 (ms)
        self._offer_latencies_ms: collections.deque[float] = collections.deque(maxlen=256)
        self._wall_clock_ns = lambda: int(wall_clock() * 1e9)
        self._new_leases: dict[str, LeaseRef] = {}
        self._leased: set[str] = set()  # prefill: blocks held until finished_sending
        self.num_mismatched_params = 0  # decode: remote blocks that belonged to another prompt
        self.num_refused_peers = 0  # decode: params naming a peer outside allowed_peers
        self.num_unproven_addresses = 0  # decode: params naming an address the prefill did not vouch for
        self.num_refused_unreachable = 0  # decode: params naming a side channel that did not answer lately
        self.num_granted_at_finish = 0  # prefill: leases granted and signed as their request finished
        self.num_offers_taken = 0  # decode: requests sent at once whose prefill's offer came
        self.num_offers_missed = 0  # decode: ... whose offer did not come within handoff_wait_s
        self.num_offers_misdirected = 0  # decode: ... whose prefill leg was given another instance's inbox
        self.num_offers_refused = 0  # prefill: hand-offs to an inbox not vouched for or not allowed

    # ------------------------------------------------------------------ decode

    def _remote_params(self, request: ConnectorRequest) -> RemotePrefillParams | None:
        if not self.config.is_consumer or request.request_id in self._handled:
            return None
        try:
            params = parse_remote_prefill(self._offered.get(request.request_id, request.kv_transfer_params))
        except InvalidRequestError as e:
            self._refuse(request.request_id, str(e))
            return None
        if params is not None and not self.peer_policy.allows(params.remote_host):
            self._refuse(request.request_id, f"it names prefill host {params.remote_host!r}, which the NixlConnector "
                         f"option allowed_peers {list(self.peer_policy.allowed)} does not allow")  # fmt: skip
            self.num_refused_peers += 1
            return None
        if params is not None and params.remote_block_ids and not self._is_vouched(request.request_id, params):
            return None
        if params is not None and params.remote_block_ids and self._is_unreachable(params):
            self._refuse(request.request_id, f"the prefill side channel {params.side_channel_address} did not answer a "
                         f"handshake within the last {self._unreachable_cooldown_s:g} s (NixlConnector option "
                         "unreachable_peer_cooldown_s): PeerUnreachableError, not tried again yet")  # fmt: skip
            self.num_refused_unreachable += 1
            return None
        return params

    def _is_unreachable(self, params: RemotePrefillParams) -> bool:
        key = unreachable_peer_key(params.side_channel_address, params.remote_incarnation)
        until = self._unreachable_until.get(key)
        if until is not None and self._clock() >= until:
            del self._unreachable_until[key]
            return False
        return until is not None

    def _is_vouched(self, request_id: str, params: RemotePrefillParams) -> bool:
        """Whether the prefill vouched for the address the params name, with this node's secret: an API
        client must not point this node at a port of its choosing (transfer/address_proof.py)."""
        if self._secret is None or request_id in self._vouched:
            return True
        address = SideChannelAddress(params.remote_engine_id, params.remote_incarnation, params.remote_host, params.remote_port)
        try:
            check_address(self._secret, address, params.remote_address_expires_at, params.remote_address_mac, self._wall_clock())
        except AuthenticationError as e:
            self._refuse(request_id, f"AuthenticationError: {e}")
            self.num_unproven_addresses += 1
            return False
        self._vouched.add(request_id)
        return True

    def _refuse(self, request_id: str, reason: str) -> None:
        """Params this request will never load from: said once, in the log and to `take_refusal`."""
        logger.error("request %s: %s; computing its prompt locally", request_id, reason)
        self._handled.add(request_id)
        self._refusals[request_id] = reason

    def take_refusal(self, request_id: str) -> str | None:
        return self._refusals.pop(request_id, None)

    def external_source(self, request_id: str) -> str:
        return "peer"  # a prefill engine's KV, pulled

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult:
        if not self._has_offer_or_gave_up(request):
            return MatchResult(None, False)  # its prefill has not offered the params yet: ask again next step
        params = self._remote_params(request)
        if params is None or not params.remote_block_ids:
            return MatchResult(0, False)
        num_remote = self._num_usable_tokens(request, params)
        if num_computed_tokens % self._remote_block_size(params):
            # Our prefix hit ends inside one of the prefill's (larger) blocks: its digest could not
            # be checked against a part of it, so nothing is read and the rest is computed here.
            num_remote = 0
        self._local_hits[request.request_id] = num_computed_tokens
        num_external = max(0, num_remote - num_computed_tokens)
        if num_external and self._loads_in_step(params):
            # loaded before this step's forward pass, which must compute at least the prompt's last token:
            # its slot is rewritten after the digest of what landed was taken
            return MatchResult(min(num_external, request.num_prompt_tokens - 1 - num_computed_tokens), False)
        return MatchResult(num_external, True)

    def _has_offer_or_gave_up(self, request: ConnectorRequest) -> bool:
        """False while a request sent at once waits for its prefill's offer; True once the offered params
        replace the request's, when it waited handoff_wait_s in vain, or when it names no hand-off key."""
        request_id = request.request_id
        if not self.config.is_consumer or request_id in self._offered or request_id in self._handled:
            return True
        waiting = self._waiting_for_offer.get(request_id)
        if waiting is None:  # first look: its key and inbox are checked once, not at every step it waits
            key = self._handoff_key_to_wait_for(request)
            if key is None:
                return True
            waiting = self._waiting_for_offer[request_id] = (key, self._clock() + self._handoff_wait_s)
        key, deadline = waiting
        offer = self._inbox.take(key)
        if offer is None and self._may_wait_for_offer:
            offer = self._wait_for_offer(key, deadline)
        if offer is not None:
            del self._waiting_for_offer[request_id]
            self._offered[request_id] = offer.params
            self.num_offers_taken += 1
            if offer.sent_ns:  # the prefill's clock: meaningful on one host, or with synchronized clocks
                self._offer_latencies_ms.append((self._wall_clock_ns() - offer.sent_ns) / 1e6)
            return True
        if self._clock() < deadline:
            return False
        del self._waiting_for_offer[request_id]
        self._refuse(request_id, f"no prefill offered its KV under its handoff_key within {self._handoff_wait_s:g} s "
                     "(NixlConnector option handoff_wait_s): the prefill leg failed, was sent elsewhere, or "
                     "named another inbox")  # fmt: skip
        self.num_offers_missed += 1
        return True

    def _wait_for_offer(self, key: str, deadline: float) -> HandoffOffer | None:
        """The engine is idle but for requests waiting for their offers, and polls again only after a sleep
        and an empty step: wait on the inbox instead, so that an offer landing now is taken now."""
        self._may_wait_for_offer = False  # once per schedule: a request arriving meanwhile waits at most this
        start = self._clock()
        offer = self._inbox.wait_for(key, min(self._idle_step_wait_s, max(0.0, deadline - start)))
        self.offer_wait_ms_total += (self._clock() - start) * 1e3
        if offer is None:
            self.num_offer_waits_timed_out += 1
        else:
            self.num_offer_waits_ended += 1
        return offer

    def _handoff_key_to_wait_for(self, request: ConnectorRequest) -> str | None:
        """The hand-off key whose offer this request waits for in this node's inbox; None when it names
        none, or when it names one this node cannot take (refused, with the reason)."""
        request_id = request.request_id
        try:
            key = parse_handoff_key(request.kv_transfer_params)
            named_inbox = parse_handoff_inbox(request.kv_transfer_params)
        except InvalidRequestError as e:
            self._refuse(request_id, str(e))
            return None
        if key is None:
            return None
        if self._inbox is None:
            self._refuse(request_id, "it names a handoff_key, and this node takes no hand-off offers (NixlConnector "
                         "option handoff_inbox is off): send the prefill's kv_transfer_params instead")  # fmt: skip
            return None
        if named_inbox is not None and not self._inbox.is_mine(named_inbox):
            self.num_offers_misdirected += 1
            self._refuse(request_id, f"its prefill leg was told to offer to the inbox of engine {named_inbox.engine_id!r} "
                         f"instance {named_inbox.incarnation[:8]}, which is not this engine instance's: this node "
                         "restarted since that inbox was learnt, or the leg reached another node; this answer's "
                         "handoff_inbox names this node's inbox")  # fmt: skip
            return None
        return key

    def _loads_in_step(self, params: RemotePrefillParams) -> bool:
        """Whether the worker will read these blocks synchronously: sync_ipc_reads is on, the params carry
        the prefill's signed grant, and the worker said it reads from that engine on its device."""
        return (
            self._sync_ipc_reads
            and bool(params.remote_grant)
            and unreachable_peer_key(params.side_channel_address, params.remote_incarnation) in self._device_peers
        )

    def _remote_block_size(self, params: RemotePrefillParams) -> int:
        return params.remote_block_size or self.block_size  # 0: an older prefill, whose blocks are ours

    def _num_usable_tokens(self, request: ConnectorRequest, params: RemotePrefillParams) -> int:
        """The prompt tokens the remote blocks hold: all of them, or none when they do not match.

        The last block's chained hash names every token before it, so one comparison proves that the
        blocks the params name (if they hold what the prefill's lease says) are this prompt's. With
        another block size on the prefill (read through a plan, transfer/layout_plan.py) the hash is
        computed at its block size, and the tokens are cut to a multiple of both block sizes: every
        block read on either side is then whole, and its digest checkable.
        """
        num_blocks = len(params.remote_block_ids)
        remote_block_size = self._remote_block_size(params)
        if num_blocks * remote_block_size > request.num_prompt_tokens:
            reason = f"{num_blocks} remote blocks are more than this prompt fills"
        elif self._prompt_hashes(request, remote_block_size)[num_blocks - 1].hex() != params.remote_block_hash:
            reason = "they hold other tokens (block hash mismatch); send each decode request its prefill's prompt"
        else:
            step = math.lcm(remote_block_size, self.block_size)
            return num_blocks * remote_block_size // step * step
        if request.request_id not in self._refused:
            self._refused.add(request.request_id)
            self._refusals[request.request_id] = reason = f"the remote prefill's blocks are not this prompt's: {reason}"
            logger.error("request %s: %s; computing it locally", request.request_id, reason)
            self.num_mismatched_params += 1
        return 0

    def _prompt_hashes(self, request: ConnectorRequest, block_size: int) -> list[BlockHash]:
        """The prompt's chained block hashes at `block_size` tokens per block (the prefill's)."""
        if block_size == self.block_size:
            return request.block_hashes
        return request.prompt_block_hashes(block_size)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = self._remote_params(request)
        if params is None or not params.remote_block_ids:
            return
        self._handled.add(request.request_id)
        num_hits = self._local_hits.pop(request.request_id, request.num_computed_tokens)
        sync = bool(num_external_tokens) and self._loads_in_step(params)  # as get_num_new_matched_tokens answered
        # a synchronous load leaves the prompt's last token to compute, in the last block it reads
        first, count = num_hits // self.block_size, -(-num_external_tokens // self.block_size)
        remote_block_size = self._remote_block_size(params)
        remote_first = num_hits // remote_block_size
        remote_count = -(-num_external_tokens // remote_block_size)  # the same tokens, in the prefill's blocks
        self._new_recvs[request.request_id] = RecvJob(
            request_id=request.request_id,
            remote=RemoteEngine(params.remote_engine_id, params.remote_host, params.remote_port, params.remote_incarnation),
            lease=LeaseRef.of(params),
            local_block_ids=tuple(block_ids[first : first + count]),
            remote_block_ids=tuple(params.remote_block_ids[remote_first : remote_first + remote_count]),
            lease_offset=remote_first,
            lease_s=params.lease_s,
            grant=params.remote_grant,
            sync=sync,
        )

    def _release_unread(self, request: ConnectorRequest) -> None:
        """A decode request that ends before it was admitted (aborted, refused by the engine) never
        reads its remote blocks: tell the prefill engine to release them now, not at lease expiry."""
        params = self._remote_params(request)
        if params is None or not params.remote_block_ids:
            return
        self._new_recvs[request.request_id] = RecvJob(
            request_id=request.request_id,
            remote=RemoteEngine(params.remote_engine_id, params.remote_host, params.remote_port, params.remote_incarnation),
            lease=LeaseRef.of(params),
            local_block_ids=(),
            remote_block_ids=(),
        )

    # ------------------------------------------------------------------ both

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(recvs=self._new_recvs, leases=self._new_leases,
                                     idle_step=scheduler_output.runs_model is False)  # fmt: skip
        self._may_wait_for_offer = scheduler_output.runs_model is False and self._idle_step_wait_s > 0
        self._new_recvs, self._new_leases = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        port = output.stats.get(SIDE_CHANNEL_PORT_STAT)
        if port:
            self.side_channel_port = int(port)
        device_peers = output.stats.get(DEVICE_READ_PEERS_STAT)
        if device_peers is not None:
            self._device_peers = frozenset(str(key) for key in device_peers)
        if self._unreachable_cooldown_s:
            for key in output.stats.get(UNREACHABLE_PEERS_STAT) or ():
                self._unreachable_until[str(key)] = self._clock() + self._unreachable_cooldown_s
        self._leased -= output.finished_sending

    def has_pending_transfers(self) -> bool:
        return bool(self._leased or self._new_leases or self._new_recvs)

    # ------------------------------------------------------------------ prefill

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        if request.request_id not in self._handled:
            self._release_unread(request)
        self._handled.discard(request.request_id)
        self._vouched.discard(request.request_id)
        self._refused.discard(request.request_id)
        self._refusals.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self._waiting_for_offer.pop(request.request_id, None)
        was_offered = self._offered.pop(request.request_id, None) is not None
        if not (self.config.is_producer and wants_remote_decode(request.kv_transfer_params)):
            return KVHandoff(False, self._inbox_answer(request, was_offered))
        handoff = self._handoff(request)
        if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            # aborted or failed: there is nothing worth reading; a decode waiting at once computes it now
            self._offer(handoff, self._params(request, []).to_dict())
            return KVHandoff(False, None)
        handoff_answer = self._finish_remote_decode(request, block_ids)
        self._offer(handoff, handoff_answer.kv_transfer_params)
        return handoff_answer

    def _finish_remote_decode(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        """A prefill request's blocks held under a lease (granted now where the worker half shares this process)."""
        num_full = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
        if not num_full:  # not one full block: nothing is held, the decode side computes the prompt
            return KVHandoff(False, self._params(request, []).to_dict())
        params = self._params(request, block_ids[:num_full])
        lease = LeaseRef.of(params)
        granter = local_grants.granter_for(self.incarnation)
        grant = granter.grant_now(lease, self.lease_s) if granter is not None else None
        if grant is not None:  # granted now: the params carry the signed grant
            params = msgspec.structs.replace(params, remote_grant=grant)
            self.num_granted_at_finish += 1
        else:  # granted by the worker in its next step
            self._new_leases[request.request_id] = lease
        self._leased.add(request.request_id)
        return KVHandoff(True, params.to_dict())

    def _inbox_answer(self, request: ConnectorRequest, was_offered: bool) -> dict[str, Any] | None:
        """A decode answer to a remote-prefill request names this node's inbox, so that its client can
        send the next requests at once."""
        if self._inbox is None or not (was_offered or (request.kv_transfer_params or {}).get("do_remote_prefill")):
            return None
        return {"handoff_inbox": self._inbox.address().to_dict()}

    def _handoff(self, request: ConnectorRequest) -> HandoffRequest | None:
        """The hand-off a prefill request asks for, if its inbox may be sent to (else None, said once)."""
        try:
            handoff = parse_handoff(request.kv_transfer_params)
        except InvalidRequestError as e:
            logger.error("request %s: %s; its params are returned to its client only", request.request_id, e)
            self.num_offers_refused += 1
            return None
        if handoff is not None and not self.peer_policy.allows(handoff.inbox.host):
            logger.error("request %s: its hand-off names decode host %r, which the NixlConnector option allowed_peers "
                         "does not allow; its params are returned to its client only", request.request_id,
                         handoff.inbox.host)  # fmt: skip
            self.num_offers_refused += 1
            return None
        return handoff

    def _offer(self, handoff: HandoffRequest | None, params: dict[str, Any] | None) -> None:
        if handoff is None or params is None or self._outbox is None:
            return
        try:
            self._outbox.offer(handoff, params)
        except AuthenticationError as e:
            logger.error("hand-off refused: %s; the params are returned to the client only", e)
            self.num_offers_refused += 1

    def shutdown(self) -> None:
        """Close the inbox and outbox sockets. Idempotent."""
        if self._inbox is not None:
            self._inbox.close()
        if self._outbox is not None:
            self._outbox.close()

    def _params(self, request: ConnectorRequest, held: list[int]) -> RemotePrefillParams:
        """What the decode side needs to read `held` and to prove it read this request's blocks."""
        return RemotePrefillParams(
            remote_engine_id=self.config.engine_id,
            remote_host=self.config.side_channel_host,
            remote_port=self.side_channel_port,
            remote_block_ids=list(held),
            remote_request_id=request.request_id,
            remote_num_tokens=len(held) * self.block_size,
            remote_block_hash=request.block_hashes[len(held) - 1].hex() if held else "",
            remote_block_size=self.block_size,
            lease_s=self.lease_s,
            remote_incarnation=self.incarnation,
            remote_lease_token=secrets.token_hex(32) if held else "",  # 256 bits: only this request's client learns it
            **self._address_proof(),
        )

    def _address_proof(self) -> dict[str, Any]:
        """This engine's side-channel address vouched for until its leases' term ends ({} without a secret)."""
        if self._secret is None:
            return {}
        address = SideChannelAddress(self.config.engine_id, self.incarnation, self.config.side_channel_host, self.side_channel_port)
        # whole seconds: an integer crosses any JSON proxy unchanged, where a fraction may not (vllm-router's
        # parser may round a float's last bit, and the MAC covers every bit)
        expires_at = float(math.ceil(self._wall_clock() + self.lease_s))
        return {"remote_address_mac": prove_address(self._secret, address, expires_at), "remote_address_expires_at": expires_at}

    def get_stats(self) -> dict[str, Any]:
        return {
            "num_leased_requests": len(self._leased),
            "num_mismatched_params": self.num_mismatched_params,
            "num_refused_peers": self.num_refused_peers,
            "num_unproven_addresses": self.num_unproven_addresses,
            "num_refused_unreachable": self.num_refused_unreachable,
            "num_granted_at_finish": self.num_granted_at_finish,
            "num_offers_taken": self.num_offers_taken,
            "num_offers_missed": self.num_offers_missed,
            "num_offers_misdirected": self.num_offers_misdirected,
            "num_offers_refused": self.num_offers_refused,
            "num_offer_waits_ended": self.num_offer_waits_ended,
            "num_offer_waits_timed_out": self.num_offer_waits_timed_out,
            "offer_wait_ms_total": self.offer_wait_ms_total,
            **offer_latency_stats(self._offer_latencies_ms),
        }
