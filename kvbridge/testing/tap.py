"""`Tap`: watches one engine's two connector halves while the kit drives the engine, and records
every break of a rule it sees (`rules.Violation`).

It wraps methods on the two connector *instances* (never their class), so the engine calls the
connector exactly as it would without the kit. The wrappers observe; they intervene only where a
correct connector cannot tell the difference:

* the metadata the scheduler half returns is encoded with msgspec, and the decoded copy is what
  the worker half gets, as if the halves lived in two processes;
* the blocks a load will fill are set to NaN before `start_load_kv`, so a load reported finished
  before its bytes landed is seen (stale bytes of an earlier identical prompt would otherwise pass);
* blocks the connector reports released are set to a sentinel: blocks held for a store, once
  `finished_sending` names it (a store still reading them then stores the sentinel, which the load
  back finds); every block, once `reset_prefix_cache` returned (nothing may be in flight then);
  the blocks of a watched aborted load, once `finished_recving` names it (a write still landing
  changes the sentinel, `check_released`); a preempted request's blocks, once `start_load_kv`
  returned for the step that preempted it (`preemption.PreemptionWatch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvbridge.connectors.base import KVHandoff, MatchResult
from kvbridge.testing.ledger import Ledger, Load
from kvbridge.testing.metadata_trip import round_trip
from kvbridge.testing.preemption import PreemptionWatch
from kvbridge.testing.rules import Rule, Violation

if TYPE_CHECKING:
    from kvbridge.block_hash import BlockHash
    from kvbridge.engine.llm import LLM

STORE_SENTINEL = 7777.0  # written into blocks whose store was reported finished
RESET_SENTINEL = -5555.0  # written into every block once reset_prefix_cache returned
ABORT_SENTINEL = 3333.0  # written into the blocks of a watched aborted load once it was reported finished
# Loaded KV is compared with an engine's own, computed in another batch: equal up to float rounding.
RTOL, ATOL = 1e-3, 1e-4


class Tap:
    """Wraps `llm.engine`'s connector halves. `reference` maps a block hash to its KV (block-major,
    `[num_layers, *page_shape]`), from an engine without a connector."""

    def __init__(self, llm: LLM, reference: dict[BlockHash, torch.Tensor]) -> None:
        engine = llm.engine
        self.scheduler_half = engine.scheduler_connector
        self.worker_half = engine.worker_connector
        self.kv: torch.Tensor = engine.runner.kv_cache
        self.block_size = engine.layout.block_size
        self.reference = reference
        self.ledger = Ledger()
        self.violations: list[Violation] = []
        self.num_metadata = 0
        self._matched: dict[str, tuple[int, MatchResult]] = {}
        self._to_poison: list[Load] = []
        self._sync_loads: list[Load] = []  # this step's
        self._async_loads: dict[str, Load] = {}
        self._recv_to_check: list[Load] = []
        self._send_blocks: dict[str, list[int]] = {}  # request id -> blocks held for its store
        self._sent_to_fill: list[int] = []  # blocks whose store finished this step
        self._watched: set[str] = set()
        self._released: dict[int, str] = {}  # block id -> aborted request whose load released it
        self.preemption = PreemptionWatch(self.kv, engine.scheduler.kv.pool)
        self._wrap()

    def of(self, rule: Rule) -> list[str]:
        return [v.detail for v in self.violations if v.rule is rule]

    def violate(self, rule: Rule, detail: str) -> None:
        self.violations.append(Violation(rule, detail))

    def _wrap(self) -> None:
        for half, names in (
            (self.scheduler_half, ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                                   "request_finished")),
            (self.worker_half, ("start_load_kv", "wait_for_layer_load", "get_finished",
                                "get_block_ids_with_load_errors", "clear_connector_metadata")),
        ):  # fmt: skip
            for name in names:
                setattr(half, name, getattr(self, f"_{name}")(getattr(half, name)))

    # ------------------------------------------------------------------ scheduler half

    def _get_num_new_matched_tokens(self, inner):
        def wrapper(request, num_computed_tokens):
            result = inner(request, num_computed_tokens)
            self._matched[request.request_id] = (num_computed_tokens, MatchResult(*result))
            return result

        return wrapper

    def _update_state_after_alloc(self, inner):
        def wrapper(request, block_ids, num_external_tokens):
            inner(request, block_ids, num_external_tokens)
            num_local, match = self._matched.pop(request.request_id, (0, MatchResult(0, False)))
            if not num_external_tokens:
                return
            first = num_local // self.block_size
            last = min((num_local + num_external_tokens) // self.block_size, len(request.block_hashes))
            targets = [(block_ids[i], request.block_hashes[i]) for i in range(first, last)]
            load = Load(request.request_id, targets, bool(match.load_async))
            self.ledger.num_loaded_blocks[load.request_id] += len(targets)
            self._to_poison.append(load)
            if load.is_async:
                self.ledger.recv_started[load.request_id] += 1
                self._async_loads[load.request_id] = load
            else:
                self.ledger.num_sync_loads += 1

        return wrapper

    def _build_connector_meta(self, inner):
        def wrapper(scheduler_output):
            self.preemption.note_step(scheduler_output)
            return self._round_trip(inner(scheduler_output))

        return wrapper

    def _round_trip(self, meta: Any) -> Any:
        self.num_metadata += 1
        copy, finding = round_trip(meta, self.scheduler_half, self.worker_half)
        if finding is not None:
            self.violate(Rule.PLAIN_METADATA, finding)
        return copy

    def _request_finished(self, inner):
        def wrapper(request, block_ids):
            result = KVHandoff(*inner(request, block_ids))
            if result.delay_free_blocks:
                self.ledger.send_started[request.request_id] += 1
                self._send_blocks[request.request_id] = list(block_ids)
            return result

        return wrapper

    # ------------------------------------------------------------------ worker half

    def _start_load_kv(self, inner):
        def wrapper():
            for load in self._to_poison:
                for block_id, _ in load.targets:
                    self.kv[block_id].fill_(float("nan"))
                if not load.is_async:
                    self._sync_loads.append(load)
            self._to_poison = []
            inner()
            self.preemption.overwrite_released()

        return wrapper

    def _wait_for_layer_load(self, inner):
        def wrapper(layer):
            inner(layer)
            for load in self._sync_loads:
                self._check_landed(load, layer, "wait_for_layer_load returned for this synchronous load")

        return wrapper

    def _get_finished(self, inner):
        def wrapper(finished_req_ids):
            sending, recving = inner(finished_req_ids)
            for request_id in sending:
                self.ledger.send_finished[request_id] += 1
                if self.ledger.send_finished[request_id] > self.ledger.send_started[request_id]:
                    self.violate(Rule.FINISH_ONCE, self._extra_finish("finished_sending", request_id,
                                  self.ledger.send_started[request_id], "request_finished delayed its free"))  # fmt: skip
                self._sent_to_fill.extend(self._send_blocks.pop(request_id, []))
            for request_id in recving:
                self.ledger.recv_finished[request_id] += 1
                if self.ledger.recv_finished[request_id] > self.ledger.recv_started[request_id]:
                    self.violate(Rule.FINISH_ONCE, self._extra_finish("finished_recving", request_id,
                                  self.ledger.recv_started[request_id], "an asynchronous load started"))  # fmt: skip
                elif (load := self._async_loads.pop(request_id, None)) is not None:
                    self._recv_to_check.append(load)  # once this step's load errors are known
            return sending, recving

        return wrapper

    @staticmethod
    def _extra_finish(where: str, request_id: str, num_started: int, what: str) -> str:
        return f"{where} named request {request_id!r} more often than {what} for it ({num_started} time(s))"

    def _get_block_ids_with_load_errors(self, inner):
        def wrapper():
            errors = set(inner())
            self.ledger.num_load_errors += len(errors)
            for load in [*self._async_loads.values(), *self._recv_to_check, *self._sync_loads]:
                load.error_blocks |= errors & {b for b, _ in load.targets}
            return errors

        return wrapper

    def _clear_connector_metadata(self, inner):
        def wrapper():
            inner()
            for load in self._recv_to_check:
                self._check_landed(load, None, "finished_recving named it")
                if load.request_id in self._watched:
                    for block_id, _ in load.targets:
                        self.kv[block_id].fill_(ABORT_SENTINEL)
                        self._released[block_id] = load.request_id
            for block_id in self._sent_to_fill:  # freed now: a store still reading one stores the sentinel
                if block_id not in self._released:
                    self.kv[block_id].fill_(STORE_SENTINEL)
            self._recv_to_check, self._sync_loads, self._sent_to_fill = [], [], []

        return wrapper

    # ------------------------------------------------------------------ checks

    def _check_landed(self, load: Load, layer: int | None, when: str) -> None:
        failed = [i for i, (block_id, _) in enumerate(load.targets) if block_id in load.error_blocks]
        # From its first failed block on, the engine recomputes the request: those bytes claim nothing.
        for block_id, block_hash in load.targets[: failed[0] if failed else None]:
            want = self.reference.get(block_hash)
            if want is None:
                continue
            got = self.kv[block_id] if layer is None else self.kv[block_id, layer]
            want = want if layer is None else want[layer]
            if torch.allclose(got, want.to(got.device), rtol=RTOL, atol=ATOL):
                continue
            where = f"block {block_id}" + ("" if layer is None else f", layer {layer}")
            if preempted := self.preemption.describe(got, where, load.request_id):
                self.violate(Rule.RELEASE_AFTER_TRANSFER, preempted)
            elif (got == STORE_SENTINEL).any():
                self.violate(Rule.RELEASE_AFTER_TRANSFER, f"request {load.request_id!r} loaded ({where}) the sentinel the "
                              "kit wrote into a block once finished_sending named the request that stored it: that "
                              "store was still reading its blocks after it reported them free")  # fmt: skip
            elif (got == RESET_SENTINEL).any():
                self.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"request {load.request_id!r} loaded ({where}) the "
                              "sentinel the kit wrote into every block once reset_prefix_cache returned: a store was "
                              "still reading blocks after reset_prefix_cache (and flush) said nothing was in flight")  # fmt: skip
            else:
                state = "NaN (nothing was written)" if got.isnan().all() else "wrong bytes"
                self.violate(Rule.LANDED_BEFORE_FINISHED, f"request {load.request_id!r}: {where} held {state} when "
                              f"{when}; the kit poisoned it with NaN before start_load_kv")  # fmt: skip
            return

    def check_flush_report(self, report, when: str) -> None:
        """A request that `flush` still reports in flight must not have been reported finished already."""
        unfinished = set(self.ledger.unfinished())
        ledger = self.ledger
        early = sorted(r for r in report.pending_req_ids
                       if r not in unfinished and (ledger.send_finished[r] or ledger.recv_finished[r]))  # fmt: skip
        if early:
            self.violate(Rule.RELEASE_AFTER_TRANSFER, f"{when}, flush() reports the transfers of {early} in flight, "
                         "but get_finished already reported them finished (their blocks were freed under them)")  # fmt: skip

    def after_reset(self) -> None:
        """Called once reset_prefix_cache returned True: nothing is in flight, so no block is read or written."""
        self.kv.fill_(RESET_SENTINEL)

    def watch_release(self, request_id: str) -> None:
        """The blocks of this request's load get ABORT_SENTINEL once finished_recving names it."""
        self._watched.add(request_id)

    def check_released(self) -> None:
        """After the engine shut down: blocks released by a watched load still hold the sentinel."""
        for block_id, request_id in sorted(self._released.items()):
            if not (self.kv[block_id] == ABORT_SENTINEL).all():
                self.violate(Rule.RELEASE_AFTER_TRANSFER, f"aborted request {request_id!r}: block {block_id} was "
                              "written after finished_recving reported its load ended (a transfer wrote into "
                              "a released block)")  # fmt: skip
