"""The scenarios the conformance kit runs a connector through, on the reference engine. Each
returns what it saw; `conformance.py` turns that into one test per rule."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbridge.engine.request import RequestStatus
from kvbridge.errors import EngineStalledError
from kvbridge.testing.memory_snapshot import Census, rss_bytes
from kvbridge.testing.rules import Rule
from kvbridge.testing.tap import Tap
from kvbridge.testing.target import GREEDY, PREEMPT_NUM_BLOCKS, ConnectorUnderTest, Reference
from kvbridge.transfer.progress import drive_until

MiB = 2**20
ABORTED_REQUEST_ID = "kvbridge-kit-aborted"


class DeadlineOverrun(Exception):
    """A call the kit made did not return by its deadline (the engine is left as it is)."""


def call_with_deadline(fn: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """`fn()`, on a thread; raises DeadlineOverrun naming `what` if it has not returned after `deadline_s`."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="kvbridge-kit-deadline", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise DeadlineOverrun(f"{what} had not returned after {deadline_s:g} s")
    if error:
        raise error[0]
    return result[0]


def generate(llm, prompts: list[list[int]], kv_params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, kv_transfer_params=kv_params)


@dataclass
class Served:
    """The main scenario's findings: one tap per engine (the engine under test, or a pair's producer
    and consumer), and the tokens the connector loaded."""

    taps: list[Tap]
    num_external_tokens: int = 0

    def of(self, rule: Rule) -> list[str]:
        return [detail for tap in self.taps for detail in tap.of(rule)]

    @property
    def num_loads(self) -> int:
        """Loads the scheduler halves asked for, asynchronous and synchronous."""
        return sum(sum(t.ledger.recv_started.values()) + t.ledger.num_sync_loads for t in self.taps)


def serve_twice(target: ConnectorUnderTest, reference: Reference, prompts: list[list[int]],
                options: dict[str, Any] | None = None) -> Served:  # fmt: skip
    """Pass 1 computes (and lets the connector store) every prompt; `reset_prefix_cache` must wait for
    the transfers in flight; pass 2 serves the same prompts, loading what the connector offers. The
    tap records every break of a rule; both passes' completions must equal `reference.outputs`."""
    llm = target.engine(options)
    tap = Tap(llm, reference.kv)
    served = Served([tap])
    grace = target.deadline_grace_s
    flush_timeout_s = llm.config.kv_transfer.flush_timeout_s
    try:
        first = generate(llm, prompts, target.first_params)
        check_outputs(tap, "first", first, reference)
        llm.engine.step()  # computes nothing: hands the stores decided as requests finished to the worker
        check_flush_deadline(tap, grace)
        try:
            reset = call_with_deadline(llm.reset_prefix_cache, flush_timeout_s + grace, "reset_prefix_cache()")
        except DeadlineOverrun:
            raise
        except Exception as exc:  # noqa: BLE001 - a FlushTimeoutError, a crash: the finding
            tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"reset_prefix_cache() with transfers in flight raised "
                        f"{type(exc).__name__}: {exc}")  # fmt: skip
            return served
        if reset is not True:
            tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"reset_prefix_cache() returned {reset!r}, not True")
        check_nothing_in_flight(tap, llm, "reset_prefix_cache() returned True", grace)
        tap.after_reset()
        second = generate(llm, prompts, [o.kv_transfer_params for o in first])
        served.num_external_tokens = sum(o.num_external_tokens for o in second)
        check_outputs(tap, "second", second, reference)
        drain(llm, tap, flush_timeout_s + grace)
    except DeadlineOverrun as exc:
        # A call still runs on the kit's thread inside the engine: the engine is left to it, not shut down.
        tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{exc}: a wait without a deadline (the engine was abandoned)")
        return served
    except EngineStalledError as exc:
        tap.violate(Rule.FINISH_ONCE, f"a pass stalled: {exc} (started transfers never reported finished: "
                    f"{tap.ledger.unfinished()})")  # fmt: skip
    except BaseException:
        llm.shutdown()
        raise
    llm.shutdown()
    return served


def check_outputs(tap: Tap, which: str, outputs: list, reference: Reference) -> None:
    for i, (out, want) in enumerate(zip(outputs, reference.outputs)):
        got = out.outputs[0].token_ids
        if out.error or got != want:
            tap.violate(Rule.NEVER_WRONG_OUTPUT, f"{which} pass, prompt {i} ({out.num_external_tokens} tokens loaded "
                        f"by the connector): {got} != {want} without a connector" + (f"; error: {out.error}"
                        if out.error else ""))  # fmt: skip


def check_flush_deadline(tap: Tap, grace_s: float) -> None:
    """flush() with the first pass's stores possibly in flight, with a deadline of a millisecond."""
    report = call_with_deadline(lambda: tap.worker_half.flush(0.001), grace_s, "flush(timeout_s=0.001)")
    tap.check_flush_report(report, "right after the first pass")


def check_nothing_in_flight(tap: Tap, llm, when: str, grace_s: float) -> None:
    if unfinished := tap.ledger.unfinished():
        tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{when} while the transfers of {unfinished} had not been "
                    "reported finished")  # fmt: skip
    report = call_with_deadline(lambda: tap.worker_half.flush(0.0), grace_s, "flush(timeout_s=0)")
    tap.check_flush_report(report, f"once {when}")
    if not report.is_complete:
        tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{when} while flush() still reports "
                    f"{sorted(report.pending_req_ids)} in flight")  # fmt: skip
    if (used := llm.engine.scheduler.kv.pool.num_used_blocks) != 0:
        tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{when} while {used} blocks were still held")


def drain(llm, tap: Tap, deadline_s: float) -> None:
    """Step until no transfer is pending; what the connector never reported finished is a finding."""
    engine = llm.engine
    end = time.monotonic() + deadline_s

    def idle() -> bool:
        engine.step()
        return not engine.has_pending_transfers()

    if not drive_until(idle, end, first_wait_s=0.001, max_wait_s=0.02):
        tap.violate(Rule.FINISH_ONCE, f"transfers of {sorted(engine.scheduler.pending_transfer_req_ids())} still "
                    f"pending {deadline_s:g} s after the last request finished")  # fmt: skip
    if unfinished := tap.ledger.unfinished():
        tap.violate(Rule.FINISH_ONCE, f"started transfers of {unfinished} were never reported finished")


def abort_while_loading(target: ConnectorUnderTest, reference: Reference, prompt: list[int]) -> tuple[Tap, str | None]:
    """Serve `prompt`, reset, admit it again and abort it while its asynchronous load is in flight.
    Returns the tap and, when no asynchronous load was started to abort, why the check cannot run."""
    llm = target.engine()
    tap = Tap(llm, reference.kv)
    grace = target.deadline_grace_s
    engine = llm.engine
    skip = None
    try:
        first = generate(llm, [prompt], target.first_params)[0]
        llm.reset_prefix_cache()
        tap.after_reset()
        tap.watch_release(ABORTED_REQUEST_ID)
        engine.add_request(ABORTED_REQUEST_ID, list(prompt), GREEDY, first.kv_transfer_params)
        request = engine.scheduler.requests[ABORTED_REQUEST_ID]
        for _ in range(100):  # admission takes a step or two
            engine.step()
            if tap.ledger.recv_started[ABORTED_REQUEST_ID] or request.status.is_finished:
                break
        if not tap.ledger.recv_started[ABORTED_REQUEST_ID]:
            skip = (f"the connector started no asynchronous load for a prompt it served before (status "
                    f"{request.status.name}, {tap.ledger.num_sync_loads} synchronous loads): nothing to abort")
        elif request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            skip = "the asynchronous load ended within its first step: nothing in flight to abort"
        engine.abort_request(ABORTED_REQUEST_ID)
        drain(llm, tap, llm.config.kv_transfer.flush_timeout_s + grace)
    finally:
        llm.shutdown()  # stops the connector's threads: a late write has landed by now
    tap.check_released()
    return tap, skip


PREEMPTED_REQUEST_ID = "kvbridge-kit-preempted"


def preempt_while_storing(target: ConnectorUnderTest, reference: Reference,
                          prompts: list[list[int]]) -> tuple[Tap, str | None]:  # fmt: skip
    """Serve two prompts (`target.preempt_prompts`) on an engine of PREEMPT_NUM_BLOCKS blocks: the
    second is preempted at the first one's first decode (the tap then overwrites its blocks) and
    aborted, so that nothing reads its blocks back early. Once the first finished and the prefix
    cache was reset, the second prompt is served again: what the connector stored of it while it
    ran is loaded back. Returns the tap and, when the check saw nothing it could judge, why."""
    llm = target.engine(num_blocks=PREEMPT_NUM_BLOCKS)
    engine = llm.engine
    tap = Tap(llm, reference.kv)
    grace = target.deadline_grace_s
    flush_timeout_s = llm.config.kv_transfer.flush_timeout_s
    first_id = "kvbridge-kit-preempting"
    finished: dict[str, Any] = {}

    def first_finished() -> bool:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if tap.preemption.preempted and engine.scheduler.requests.get(PREEMPTED_REQUEST_ID) is not None:
            engine.abort_request(PREEMPTED_REQUEST_ID)  # admitted again, it would read its blocks back at once
        return first_id in finished

    try:
        engine.add_request(first_id, list(prompts[0]), GREEDY, target.first_params)
        engine.add_request(PREEMPTED_REQUEST_ID, list(prompts[1]), GREEDY, target.first_params)
        if not drive_until(first_finished, time.monotonic() + flush_timeout_s + grace, first_wait_s=0.001,
                           max_wait_s=0.02):  # fmt: skip
            unfinished = tap.ledger.unfinished()
            tap.violate(Rule.FINISH_ONCE, f"the preempting request had not finished {flush_timeout_s + grace:g} s "
                        f"after it was added (transfers never reported finished: {unfinished})")  # fmt: skip
            llm.shutdown()
            return tap, None
        check_outputs(tap, "preempting", [finished[first_id]], reference)
        drain(llm, tap, flush_timeout_s + grace)
        call_with_deadline(llm.reset_prefix_cache, flush_timeout_s + grace, "reset_prefix_cache()")
        tap.after_reset()
        again = generate(llm, [prompts[1]], None)
        check_outputs(tap, "preempted prompt, served again", again, Reference(reference.outputs[1:], reference.kv))
        drain(llm, tap, flush_timeout_s + grace)
    except DeadlineOverrun as exc:  # a call still runs inside the engine: it is left to it, not shut down
        tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{exc}: a wait without a deadline (the engine was abandoned)")
        return tap, None
    except EngineStalledError as exc:
        tap.violate(Rule.FINISH_ONCE, f"the preemption scenario stalled: {exc}")
    except BaseException:
        llm.shutdown()
        raise
    llm.shutdown()
    if PREEMPTED_REQUEST_ID not in tap.preemption.preempted:
        return tap, f"the engine preempted no request in {PREEMPT_NUM_BLOCKS} blocks (it should have): nothing to check"
    if not sum(tap.ledger.num_loaded_blocks.values()):
        return tap, ("the connector loaded nothing when the preempted request's prompt was served again: nothing "
                     "shows whether a store still read its blocks after they were free (a connector that stores "
                     "only as requests finish has no store in flight at a preemption)")  # fmt: skip
    return tap, None


def serve_once(target: ConnectorUnderTest, prompts: list[list[int]]) -> weakref.ref:
    """create -> serve twice -> shutdown; a weak reference to the engine's KV cache."""
    llm = target.engine()
    try:
        first = generate(llm, prompts, target.first_params)
        llm.reset_prefix_cache()
        generate(llm, prompts, [o.kv_transfer_params for o in first])
        return weakref.ref(llm.engine.runner.kv_cache)
    finally:
        llm.shutdown()


def memory_cycles(one_cycle: Callable[[], weakref.ref]) -> list[str]:
    """`one_cycle` (create -> serve -> shutdown) twice after one warm-up; what the cycles did not give back."""
    one_cycle()  # warm-up: lazy torch state, thread pools, imports
    gc.collect()
    before, rss_before = Census.take(), rss_bytes()
    refs = [one_cycle()]
    mid = Census.take(since=before)
    refs.append(one_cycle())
    leaked: dict[str, list[str]] = {}

    def settled() -> bool:  # a thread told to stop at shutdown may take a moment to be gone from /proc
        nonlocal leaked
        leaked = Census.take().leaked(before, mid)
        return not leaked

    drive_until(settled, time.monotonic() + 1.0, first_wait_s=0.01, max_wait_s=0.1)
    found = []
    if alive := sum(r() is not None for r in refs):
        found.append(f"{alive} of 2 engines' KV cache tensors are still alive after shutdown (a reference kept "
                     "past shutdown())")  # fmt: skip
    for kind, what in (("tensors", "tensors"), ("threads", "threads"), ("fds", "file descriptors")):
        if items := leaked.get(kind):
            shown = sorted(set(items))[:5]
            found.append(f"{len(items)} more {what} after the second of two identical create -> serve -> shutdown "
                         f"cycles than after the first, e.g. {', '.join(shown)}")  # fmt: skip
    if (grown := rss_bytes() - rss_before) > 64 * MiB:
        found.append(f"resident memory grew by {grown / MiB:.0f} MiB over two create -> serve -> shutdown cycles")
    return found
