"""The KV connector under tensor parallelism: one worker half per rank, driven by rank 0.

Every rank's process holds a worker half of the connector over its own KV heads' cache (a NIXL agent
of its own, its own reads and digests). Rank 0's scheduler allocates the same block ids on every rank,
so a block id means the same tokens on every rank, each rank holding its own heads of them: whatever
the scheduler side decides per block (a lease, a load) holds for every rank's copy.

Per step, around the forward (the order of `connectors/base.py`):

    rank 0                                         ranks 1..N-1
    begin: KV_BEGIN(metadata bytes, finished ids) -> bind, start_load_kv
    (STEP: the forward, as without a connector)   -> the forward on their shard
    wait_for_save; collect: KV_END                 -> wait_for_save, get_finished, load errors
                 gather_bytes  <---------------------- RankOutput (msgspec)
    apply_tp_step_reports(their reports); get_finished ...; merge

The metadata and the reports are msgspec, carried as uint8 tensors over the rank group (no pickle).
`merge` makes the node's answer: a request is finished (sending or receiving) only once every rank
has reported it, and a load error on any rank is a load error for the request, reported with it.
"""

from __future__ import annotations

import msgspec

from kvbridge.connectors.base import KVConnectorBase, KVConnectorOutput
from kvbridge.engine.tp_group import ControlOp, TPGroup


class StepBegin(msgspec.Struct, frozen=True):
    """Rank 0 -> every rank, KV_BEGIN: the step's connector metadata (connector-encoded; empty: none)."""

    metadata: bytes
    finished_req_ids: list[str]


class RankOutput(msgspec.Struct, frozen=True):
    """A rank > 0 -> rank 0 after each step: its worker half's answers, and its connector-specific report."""

    finished_sending: list[str]
    finished_recving: list[str]
    invalid_block_ids: list[int]
    load_errors: dict[str, str]
    report: bytes


def join(group: TPGroup, connector: KVConnectorBase) -> None:
    """Every rank, once its KV cache is registered with `connector`: rank 0 learns the others' rank info."""
    infos = group.gather_bytes(connector.tp_rank_info())
    if group.rank == 0:
        connector.set_tp_rank_infos(infos[1:])


class RankDriver:
    """Rank 0: tells the other ranks' worker halves what to do each step and merges their answers."""

    def __init__(self, group: TPGroup, connector: KVConnectorBase) -> None:
        self._group, self._connector = group, connector
        self._sending: dict[str, set[int]] = {}  # request id -> ranks that finished sending it
        self._recving: dict[str, set[int]] = {}  # request id -> ranks that finished receiving it
        self._load_errors: dict[str, str] = {}  # request id -> the first rank's reason, until reported
        self._invalid_block_ids: set[int] = set()  # held while a request with a load error is unfinished

    def begin(self, metadata, finished_req_ids: set[str]) -> None:
        data = self._connector.encode_metadata(metadata) if metadata is not None else b""
        self._group.send_bytes(ControlOp.KV_BEGIN, msgspec.msgpack.encode(StepBegin(data, sorted(finished_req_ids))))

    def collect(self) -> list[RankOutput]:
        """After rank 0's wait_for_save: the other ranks' answers; their reports go to rank 0's half."""
        self._group.send(ControlOp.KV_END)
        outputs = [msgspec.msgpack.decode(b, type=RankOutput) for b in self._group.gather_bytes(b"")[1:]]
        self._connector.apply_tp_step_reports([o.report for o in outputs])
        return outputs

    def merge(self, own: KVConnectorOutput, others: list[RankOutput]) -> KVConnectorOutput:
        """The node's output: rank 0's (`own`, its stats included) merged with the other ranks'.

        It names no landed reads (`landed_recving`): rank 0 does not know when every rank's read
        has landed, so a tensor-parallel node computes on loaded KV only once it is confirmed."""
        world = 1 + len(others)
        ranks = [(own.finished_sending, own.finished_recving, own.invalid_block_ids, own.load_errors)]
        ranks += [(o.finished_sending, o.finished_recving, o.invalid_block_ids, o.load_errors) for o in others]
        for rank, (sending, recving, invalid, errors) in enumerate(ranks):
            for req_id in sending:
                self._sending.setdefault(req_id, set()).add(rank)
            for req_id in recving:
                self._recving.setdefault(req_id, set()).add(rank)
            for req_id, error in errors.items():
                self._load_errors.setdefault(req_id, f"tensor-parallel rank {rank}: {error}" if rank else error)
            self._invalid_block_ids.update(invalid)
        sending = _take_complete(self._sending, world)
        recving = _take_complete(self._recving, world)
        errors = {r: self._load_errors.pop(r) for r in recving if r in self._load_errors}
        invalid: set[int] = set()
        if not any(r in self._recving for r in self._load_errors):  # no failed request is still reading elsewhere
            invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return KVConnectorOutput(sending, recving, invalid, errors, own.stats)


def _take_complete(reported: dict[str, set[int]], world: int) -> set[str]:
    done = {req_id for req_id, ranks in reported.items() if len(ranks) == world}
    for req_id in done:
        del reported[req_id]
    return done


class RankFollower:
    """Ranks > 0: rank 0's KV_BEGIN / KV_END on this rank's worker half."""

    def __init__(self, group: TPGroup, connector: KVConnectorBase) -> None:
        self._group, self.connector = group, connector
        self._finished_req_ids: set[str] = set()

    def begin(self, data: bytes) -> None:
        step = msgspec.msgpack.decode(data, type=StepBegin)
        self._finished_req_ids = set(step.finished_req_ids)
        if step.metadata:
            self.connector.bind_connector_metadata(self.connector.decode_metadata(step.metadata))
        self.connector.start_load_kv()

    def end(self) -> None:
        connector = self.connector
        try:
            connector.wait_for_save()
            sending, recving = connector.get_finished(self._finished_req_ids)
            output = RankOutput(
                sorted(sending), sorted(recving), sorted(connector.get_block_ids_with_load_errors()),
                dict(connector.get_load_errors()), connector.tp_step_report(),
            )  # fmt: skip
        finally:
            connector.clear_connector_metadata()
        self._group.gather_bytes(msgspec.msgpack.encode(output))
