"""The conformance kit's scenarios for a P/D pair (`--kvbridge-pair`): a producer engine (role
`kv_producer`) and a consumer engine (role `kv_consumer`) built from one config in this process,
each watched by a tap of its own. The producer serves the prompts with `first_params` (default
`{"do_remote_decode": true}`); the consumer serves them with what the producer returned, plus
`{"do_remote_prefill": true}`, and loads the producer's KV through the connector (for the
NixlConnector: NIXL over UCX on loopback). While the consumer runs, a thread steps the producer,
as its server would. The checks read the same rules off both taps (`scenarios.Served`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvbridge.engine.request import RequestStatus
from kvbridge.errors import EngineStalledError
from kvbridge.testing.rules import Rule
from kvbridge.testing.scenarios import (
    ABORTED_REQUEST_ID,
    DeadlineOverrun,
    Served,
    check_flush_deadline,
    check_nothing_in_flight,
    check_outputs,
    drain,
    generate,
    call_with_deadline,
)
from kvbridge.testing.tap import Tap
from kvbridge.testing.target import GREEDY, ConnectorUnderTest, Reference

PRODUCE = {"do_remote_decode": True}
CONSUME = {"do_remote_prefill": True}


def consumer_params(outputs: list) -> list[dict[str, Any]]:
    """What the consumer's requests get: each producer output's kv_transfer_params, to be read."""
    return [{**(o.kv_transfer_params or {}), **CONSUME} for o in outputs]


@contextmanager
def stepping(llm) -> Iterator[None]:
    """Steps `llm` on a thread of its own while it has work, as a server would, until the block ends.
    A step that raised is raised again here."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        engine = llm.engine
        while not stop.is_set():
            try:
                if engine.has_unfinished_requests() or engine.has_pending_transfers():
                    engine.step()
            except BaseException as exc:  # noqa: BLE001 - handed to the block's owner
                errors.append(exc)
                return
            stop.wait(0.001)

    thread = threading.Thread(target=run, name="kvbridge-kit-producer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
    if errors:
        raise errors[0]


def build_pair(target: ConnectorUnderTest, reference: Reference, options: dict[str, Any] | None = None):
    """(producer, consumer, producer's tap, consumer's tap)."""
    producer = target.engine(options, role="kv_producer")
    try:
        consumer = target.engine(options, role="kv_consumer")
    except BaseException:
        producer.shutdown()
        raise
    return producer, consumer, Tap(producer, reference.kv), Tap(consumer, reference.kv)


def serve_pair(target: ConnectorUnderTest, reference: Reference, prompts: list[list[int]],
               options: dict[str, Any] | None = None) -> Served:  # fmt: skip
    """The producer serves every prompt (its transfers' blocks then wait for the consumer:
    `flush(0.001)` must return by its deadline); the consumer serves them with the producer's
    params; then both are drained and `reset_prefix_cache` must return True on each."""
    producer, consumer, ptap, ctap = build_pair(target, reference, options)
    served = Served([ptap, ctap], 0)
    grace = target.deadline_grace_s
    flush_timeout_s = consumer.config.kv_transfer.flush_timeout_s
    try:
        first = generate(producer, prompts, target.first_params or PRODUCE)
        check_outputs(ptap, "producer", first, reference)
        producer.engine.step()  # computes nothing: hands what the finished requests decided to the worker
        check_flush_deadline(ptap, grace)
        with stepping(producer):
            second = generate(consumer, prompts, consumer_params(first))
            served.num_external_tokens = sum(o.num_external_tokens for o in second)
            check_outputs(ctap, "consumer", second, reference)
            drain(consumer, ctap, flush_timeout_s + grace)
        drain(producer, ptap, flush_timeout_s + grace)
        for name, llm, tap in (("consumer", consumer, ctap), ("producer", producer, ptap)):
            reset = call_with_deadline(llm.reset_prefix_cache, flush_timeout_s + grace, f"{name} reset_prefix_cache()")
            if reset is not True:
                tap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"the {name}'s reset_prefix_cache() returned {reset!r}")
            check_nothing_in_flight(tap, llm, f"the {name}'s reset_prefix_cache() returned True", grace)
    except DeadlineOverrun as exc:  # a call still runs inside an engine: the pair is left to it
        ctap.violate(Rule.FLUSH_WAITS_WITH_DEADLINE, f"{exc}: a wait without a deadline (the pair was abandoned)")
        return served
    except EngineStalledError as exc:
        ctap.violate(Rule.FINISH_ONCE, f"a pass stalled: {exc} (started transfers never reported finished: "
                     f"producer {ptap.ledger.unfinished()}, consumer {ctap.ledger.unfinished()})")  # fmt: skip
    except BaseException:
        _shutdown(consumer, producer)
        raise
    _shutdown(consumer, producer)
    return served


def _shutdown(*engines) -> None:
    for llm in engines:
        if not llm.engine.is_shut_down:
            llm.shutdown()


def abort_pair_while_loading(target: ConnectorUnderTest, reference: Reference,
                             prompt: list[int]) -> tuple[Tap, str | None]:  # fmt: skip
    """The producer serves `prompt`; the consumer admits it with the producer's params and aborts it
    while its load is in flight (the producer is not stepped meanwhile). Returns the consumer's tap
    and, when no load was in flight to abort, why the check cannot run."""
    producer, consumer, ptap, tap = build_pair(target, reference)
    engine = consumer.engine
    grace = target.deadline_grace_s
    skip = None
    try:
        first = generate(producer, [prompt], target.first_params or PRODUCE)
        tap.watch_release(ABORTED_REQUEST_ID)
        engine.add_request(ABORTED_REQUEST_ID, list(prompt), GREEDY, consumer_params(first)[0])
        request = engine.scheduler.requests[ABORTED_REQUEST_ID]
        for _ in range(100):  # admission takes a step or two
            engine.step()
            if tap.ledger.recv_started[ABORTED_REQUEST_ID] or request.status.is_finished:
                break
        if not tap.ledger.recv_started[ABORTED_REQUEST_ID]:
            skip = ("the consumer started no asynchronous load from the producer's params (status "
                    f"{request.status.name})")
        elif request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            skip = "the consumer's load ended within its first step: nothing in flight to abort"
        engine.abort_request(ABORTED_REQUEST_ID)
        with stepping(producer):
            drain(consumer, tap, consumer.config.kv_transfer.flush_timeout_s + grace)
        drain(producer, ptap, producer.config.kv_transfer.flush_timeout_s + grace)
    finally:
        _shutdown(consumer, producer)  # stops the connectors' threads: a late write has landed by now
    tap.check_released()
    tap.violations += [v for v in ptap.violations if v.rule is Rule.FINISH_ONCE]
    return tap, skip


def serve_pair_once(target: ConnectorUnderTest, prompts: list[list[int]]) -> weakref.ref:
    """One create -> serve -> shutdown cycle of a pair (the memory check); a weak reference to the
    consumer's KV cache."""
    engines: list = []
    try:
        engines.append(target.engine(role="kv_producer"))
        engines.append(target.engine(role="kv_consumer"))
        producer, consumer = engines
        first = generate(producer, prompts, target.first_params or PRODUCE)
        with stepping(producer):
            generate(consumer, prompts, consumer_params(first))
        ref = weakref.ref(consumer.engine.runner.kv_cache)
    finally:
        _shutdown(*reversed(engines))
    return ref
