"""PeerControls: verdicts from the prefill's answers, one lease per id and batch, bounded peers."""

from __future__ import annotations

import threading

from kvbridge.connectors.nixl.metadata import RemoteEngine
from kvbridge.connectors.nixl.peer_control import MAX_COURTESY, PeerControls, Reading, Verdict
from kvbridge.errors import PeerUnreachableError
from kvbridge.transfer import messages as m

PREFILL = RemoteEngine("prefill", "127.0.0.1", 5555, "inc-1")


def lease(req_id: str, token: str = "t") -> m.LeaseRef:
    return m.LeaseRef(req_id=req_id, token=token, block_ids=[1, 2], block_hash="h")


class FakePrefill:
    """Answers like a LeaseTable holding `held` (exact leases) and not yet granting `pending` ids."""

    def __init__(self, held: list[m.LeaseRef], pending: set[str] = frozenset(), down: bool = False) -> None:
        self.held, self.pending, self.down = list(held), set(pending), down
        self.sent: list[m.Message] = []
        self.lock = threading.Lock()

    def __call__(self, remote: RemoteEngine, msg: m.Message) -> m.Message:
        with self.lock:
            self.sent.append(msg)
        if self.down:
            raise PeerUnreachableError("no reply")
        if isinstance(msg, m.LeaseRenew):
            return m.LeaseRenewReply(held=[x.req_id for x in msg.leases if x in self.held])
        reply = m.TransferDoneReply()
        for x in msg.leases + msg.failed_leases:
            if x.req_id in self.pending:
                reply.pending.append(x.req_id)
            elif x in self.held and msg.incarnation == remote.incarnation:
                self.held.remove(x)
                reply.released.append(x.req_id)
            else:
                reply.unknown.append(x.req_id)
        return reply


def run(controls: PeerControls, now: list[float], reading=None, steps: int = 200) -> dict[str, Verdict]:
    verdicts = {}
    for _ in range(steps):
        for outcome in controls.progress(reading or {}):
            verdicts[outcome.req_id] = outcome.verdict
        now[0] += 0.01
        threading.Event().wait(0.002)  # let the pool answer
    return verdicts


def make(send, now, **kw) -> PeerControls:
    options = dict(max_peers=2, idle_s=5.0, renew_interval_s=1.0)
    options.update(kw)
    return PeerControls(send, "decode", clock=lambda: now[0], **options)


def test_only_an_exact_release_confirms_a_read():
    now = [0.0]
    prefill = FakePrefill(held=[lease("real")])
    controls = make(prefill, now)
    controls.confirm(PREFILL, "local-real", lease("real"), deadline=100)
    controls.confirm(PREFILL, "local-forged", lease("real", token="guess"), deadline=100)  # same remote id
    controls.confirm(PREFILL, "local-made-up", lease("nobody"), deadline=100)
    verdicts = run(controls, now)
    assert verdicts == {"local-real": Verdict.CONFIRMED, "local-forged": Verdict.REFUSED, "local-made-up": Verdict.REFUSED}
    batches = [[x.req_id for x in msg.leases] for msg in prefill.sent]
    assert all(len(ids) == len(set(ids)) for ids in batches)  # never two leases of one id in a batch
    controls.close()


def test_pending_is_asked_again_until_granted_or_the_deadline():
    now = [0.0]
    prefill = FakePrefill(held=[lease("late")], pending={"late", "never", "made-up"})
    controls = make(prefill, now)
    controls.confirm(PREFILL, "a", lease("late"), deadline=100)
    controls.confirm(PREFILL, "b", lease("never"), deadline=0.5)
    controls.confirm(PREFILL, "c", lease("made-up"), deadline=100)  # never handed out: pending for ever
    verdicts = run(controls, now, steps=20)
    assert verdicts == {}  # asked again, nothing decided before the deadline
    prefill.pending.discard("late")  # the prefill's next step granted it
    verdicts = run(controls, now, steps=100)
    assert verdicts == {"a": Verdict.CONFIRMED, "b": Verdict.REFUSED}
    verdicts = run(controls, now, steps=600)  # 6 s: past the grace, far before the deadline
    assert verdicts == {"c": Verdict.REFUSED}
    controls.close()


def test_the_answer_to_a_confirmation_rings_the_engine():
    now, rung = [0.0], threading.Event()
    controls = make(FakePrefill(held=[lease("x")]), now, wake=rung.set)
    controls.confirm(PREFILL, "x", lease("x"), deadline=100)
    assert controls.progress({}) == []  # sent, not answered yet
    assert rung.wait(5.0)  # the pool thread rang once the answer was in: no poll needed to notice
    assert [o.verdict for o in controls.progress({})] == [Verdict.CONFIRMED]
    controls.close()


def test_a_pending_lease_is_asked_again_soon_then_less_often():
    now, answered = [0.0], threading.Event()
    prefill = FakePrefill(held=[], pending={"late"})
    controls = make(prefill, now, wake=answered.set)
    controls.confirm(PREFILL, "a", lease("late"), deadline=100)
    asked_at = []
    while now[0] < 0.4:  # fake time, in 0.1 ms steps, frozen while a question is out
        controls.progress({})  # collects an answer, or asks again when due
        if controls._peers[PREFILL].in_flight is not None:
            asked_at.append(now[0])
            assert answered.wait(5.0)
            answered.clear()
        else:
            now[0] += 0.0001
    gaps = [round(b - a, 4) for a, b in zip(asked_at, asked_at[1:])]
    assert gaps[0] <= 0.002  # the first retry comes after about a millisecond, not a poll period
    assert max(gaps) <= 0.021 and gaps[-1] >= 0.015  # backing off to 20 ms for an id never granted
    controls.close()


def test_an_unreachable_prefill_confirms_nothing():
    now = [0.0]
    controls = make(FakePrefill(held=[lease("x")], down=True), now)
    controls.confirm(PREFILL, "x", lease("x"), deadline=100)
    assert run(controls, now, steps=50) == {"x": Verdict.REFUSED}
    controls.close()


def test_peers_are_capped_by_address_and_idle_ones_make_room():
    now = [0.0]
    controls = make(FakePrefill(held=[]), now, max_peers=2, idle_s=5.0)
    others = [RemoteEngine("e", "127.0.0.1", 6000 + i, "i") for i in range(3)]
    made_up = [RemoteEngine(f"fake-{i}", "127.0.0.1", 6000, f"inc-{i}") for i in range(50)]
    for remote in made_up:  # many incarnations at one address take one place
        assert controls.admits(remote, busy=set())
        controls.abandon(remote, lease("a"))
    assert controls.addresses() == {others[0].address}
    controls.abandon(others[1], lease("b"))
    # Full, and every peer busy: no room.
    assert not controls.admits(others[2], busy=set(made_up) | {others[1]})
    run(controls, now, steps=10)  # the releases were answered: nothing in flight any more
    now[0] += 1
    controls.abandon(others[1], lease("c"))
    run(controls, now, steps=10)
    # Full, but the least recently active address is idle: it makes room at once.
    assert controls.admits(others[2], busy=set())
    assert controls.addresses() == {others[1].address}
    assert controls.drop_idle(busy=set()) == []  # not idle long enough
    now[0] += 10
    assert controls.drop_idle(busy=set()) == [others[1]]
    controls.close()


def test_leases_being_read_are_renewed_every_interval():
    now = [0.0]
    prefill = FakePrefill(held=[lease("r")])
    controls = make(prefill, now, renew_interval_s=0.5)
    run(controls, now, reading={PREFILL: [Reading(lease("r"), 0.0, float("inf"))]}, steps=120)  # 1.2 s of a read in flight
    renewals = [msg for msg in prefill.sent if isinstance(msg, m.LeaseRenew)]
    assert 1 <= len(renewals) <= 3 and renewals[0].incarnation == "inc-1" and renewals[0].leases == [lease("r")]
    controls.close()


def test_releases_to_silent_addresses_neither_delay_confirmations_nor_pile_up():
    """Requests naming addresses that never answer queue best-effort releases: bounded, on their own
    threads, and a real prefill's confirmation goes through meanwhile."""
    now = [0.0]
    prefill = FakePrefill(held=[lease("real")])
    release_started = threading.Event()
    stop = threading.Event()

    def send(remote: RemoteEngine, msg: m.Message) -> m.Message:
        if remote.port != PREFILL.port:  # a made-up address: hangs until the test ends
            release_started.set()
            stop.wait(10)
            raise PeerUnreachableError("no reply")
        return prefill(remote, msg)

    controls = make(send, now, max_peers=500)
    silent = [RemoteEngine("e", "127.0.0.1", 7000 + i, "i") for i in range(200)]
    for remote in silent:
        controls.abandon(remote, lease("gone"))
    try:
        run(controls, now, steps=5)
        assert release_started.wait(5)
        assert controls.num_courtesy_dropped == len(silent) - MAX_COURTESY
        assert not any(controls.admits(r, busy=set()) is False for r in silent[:3])  # best-effort: never busy
        controls.confirm(PREFILL, "local-real", lease("real"), deadline=100)
        assert run(controls, now, steps=100) == {"local-real": Verdict.CONFIRMED}
    finally:
        stop.set()
        controls.close()
