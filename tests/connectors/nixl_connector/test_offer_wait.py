"""A decode sent at once waits on its inbox after an empty step (NixlConnector option idle_step_wait_s), attacked
with real sockets: the decode's scheduler half and its bound ZMQ inbox here, the prefill's offers and a
stranger's junk frames from other threads over loopback TCP.

vLLM sleeps ~1 ms after a step that ran no model and then schedules again, so a request waiting for its
prefill's offer sees it at that poll at the earliest. After such a step (`SchedulerOutput.runs_model` False)
the next schedule waits on the inbox itself, once, up to the bound: an offer that lands then is taken as it
lands; frames that are not the offer neither end the wait early nor stretch it past its bound.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import zmq

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import SchedulerOutput
from kvbridge.connectors.nixl.peer_policy import PeerPolicy
from kvbridge.connectors.nixl.scheduler import NixlScheduler
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer_params import HandoffRequest
from kvbridge.transfer.offers import OfferInbox, OfferOutbox

BS = 16
OFFER_AFTER_S = 0.15


@pytest.fixture
def decode():
    """A decode's scheduler half with its inbox bound on loopback (no secret: the proofs are another test's)."""
    schedulers: list[tuple[NixlScheduler, OfferInbox]] = []

    def make(idle_step_wait_s: float) -> tuple[NixlScheduler, OfferInbox]:
        config = KVTransferConfig("NixlConnector", role="kv_consumer", engine_id="dec", side_channel_port=0)
        inbox = OfferInbox("127.0.0.1", 0, "dec", "inc-dec", None)
        sched = NixlScheduler(config, BS, 30.0, "inc-dec", PeerPolicy(("127.0.0.0/8",)), inbox=inbox,
                              handoff_wait_s=30.0, idle_step_wait_s=idle_step_wait_s)  # fmt: skip
        schedulers.append((sched, inbox))
        return sched, inbox

    yield make
    for _, inbox in schedulers:
        inbox.close()


def waiting_request(req_id: str, inbox: OfferInbox) -> tuple[Request, HandoffRequest]:
    """A decode request sent at once under a fresh key, and the hand-off its prefill leg was given."""
    key = secrets.token_hex(32)
    address = inbox.address()
    params = {"do_remote_prefill": True, "handoff_key": key, "handoff_inbox": address}
    prompt = list(range(3, 3 + 4 * BS + 3))
    return Request(req_id, prompt, SamplingParams(max_tokens=4), BS, params), HandoffRequest(key=key, inbox=address)


def offer_later(handoff: HandoffRequest, after_s: float) -> threading.Thread:
    """The prefill's offer (params naming no blocks: the prompt was too short to lease), sent after `after_s`."""

    def send() -> None:
        time.sleep(after_s)
        outbox = OfferOutbox(None)
        outbox.offer(handoff, {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "pre"})
        time.sleep(0.2)  # LINGER 0 would drop a frame still queued when the socket closes
        outbox.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def junk_until(port: int, stop: threading.Event) -> threading.Thread:
    """A stranger pushing frames that are not offers into the inbox, one every millisecond."""

    def push() -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        while not stop.is_set():
            try:
                sock.send(b"\x00not a frame" * 8, zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.001)
        sock.close(0)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    return thread


def step(sched: NixlScheduler, runs_model: bool | None) -> None:
    """The end of a schedule: the engine says whether the step it built runs a model."""
    sched.build_connector_meta(SchedulerOutput(runs_model=runs_model))


def timed_match(sched: NixlScheduler, req: Request):
    start = time.monotonic()
    result = sched.get_num_new_matched_tokens(req, 0)
    return result, time.monotonic() - start


def test_after_an_empty_step_the_offer_is_taken_as_it_lands(decode):
    sched, inbox = decode(idle_step_wait_s=1.0)
    req, handoff = waiting_request("r1", inbox)
    first, first_s = timed_match(sched, req)  # no step seen yet: a plain look at the inbox
    assert first.num_external_tokens is None and first_s < 0.1

    step(sched, runs_model=False)
    sender = offer_later(handoff, OFFER_AFTER_S)
    matched, waited_s = timed_match(sched, req)

    assert matched.num_external_tokens == 0  # the offer came: no blocks to read, the prompt is computed here
    assert OFFER_AFTER_S * 0.8 <= waited_s < 0.8, waited_s  # woken by the offer, well before the 1 s bound
    stats = sched.get_stats()
    assert stats["num_offers_taken"] == 1 and stats["num_offer_waits_ended"] == 1, stats
    assert stats["num_offer_waits_timed_out"] == 0, stats
    sender.join(2)


def test_the_wait_is_bounded_once_per_schedule_and_junk_neither_ends_nor_stretches_it(decode):
    bound_s = 0.1
    sched, inbox = decode(idle_step_wait_s=bound_s)
    r1, _ = waiting_request("r1", inbox)
    r2, _ = waiting_request("r2", inbox)
    stop = threading.Event()
    stranger = junk_until(inbox.port, stop)
    try:
        for _ in range(3):
            step(sched, runs_model=False)
            m1, waited_s = timed_match(sched, r1)
            m2, second_s = timed_match(sched, r2)  # the schedule's one wait is spent: a plain look
            assert m1.num_external_tokens is None and m2.num_external_tokens is None
            assert bound_s <= waited_s < bound_s + 0.1, waited_s
            assert second_s < 0.05, second_s
    finally:
        stop.set()
        stranger.join(2)
    stats = sched.get_stats()
    assert stats["num_offer_waits_timed_out"] == 3 and stats["num_offer_waits_ended"] == 0, stats
    assert inbox.num_rejected > 0  # the junk arrived during the waits, and was refused
    assert stats["offer_wait_ms_total"] < 3 * (bound_s + 0.1) * 1e3, stats


@pytest.mark.parametrize("runs_model", [True, None], ids=["step-ran-a-model", "engine-says-nothing"])
def test_steps_that_run_a_model_or_say_nothing_never_wait(decode, runs_model):
    sched, inbox = decode(idle_step_wait_s=1.0)
    req, _ = waiting_request("r1", inbox)
    step(sched, runs_model=runs_model)
    matched, waited_s = timed_match(sched, req)
    assert matched.num_external_tokens is None and waited_s < 0.1, waited_s
    assert sched.get_stats()["num_offer_waits_timed_out"] == 0


def test_no_wait_with_the_option_at_zero(decode):
    sched, inbox = decode(idle_step_wait_s=0.0)
    req, _ = waiting_request("r1", inbox)
    step(sched, runs_model=False)
    matched, waited_s = timed_match(sched, req)
    assert matched.num_external_tokens is None and waited_s < 0.05, waited_s
