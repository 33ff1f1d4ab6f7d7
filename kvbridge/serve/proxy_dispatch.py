"""How the proxy sends a disaggregated request's two legs: in turn, or at once (transfer/offers.py).

In turn: the prefill leg, then the decode leg with the kv_transfer_params the prefill answered. At
once: the proxy draws a hand-off key and sends both legs together, the prefill leg naming the key
and the chosen decode node's inbox, the decode leg the key only; the prefill offers its params
straight to that inbox, so the prefill's answer no longer gates the decode leg.

`--dispatch auto` (the default) sends at once whenever it knows a fresh inbox of the decode node
the routing picked, and in turn otherwise (which teaches it the inbox); `--dispatch in-turn` never
sends at once. A decode node started with NixlConnector option `handoff_inbox` names its inbox in
every answer to a remote-prefill request; `InboxBook` keeps the latest per node, and uses it while
its proof (`expires_at`) has more than INBOX_MARGIN_S left and the node has not left the rotation
since it was learned (a restarted node binds another inbox).

At once, what the prefill leg does and what follows (serve/proxy.py applies it):

    answers with params ---------------> its offer reached the inbox: the decode reads the KV
    a retry on another prefill node ----> the same key and inbox: the decode takes the first offer only
    answers no params, or no prefill
    node answers (failed, 4xx, deadline) -> the proxy offers nothing ({}) under the key: the decode
                                            computes the prompt now instead of after handoff_wait_s
    still running when the decode leg ends -> it runs on; its params are released when it answers

A decode attempt on another node than the inbox's (a decode retry) waits for the prefill's answer
and gets its params, as in turn. The params the prefill answered are released unless the decode
node took them (`PrefillLeg.was_taken`): a decode node that takes params reads or releases them
itself, but an offer that came after its handoff_wait_s, or a retry's offer after another attempt's,
is never taken. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from kvbridge.errors import AuthenticationError, ConfigError
from kvbridge.kv_transfer_params import HandoffRequest, InboxAddress
from kvbridge.serve.node_pool import NodePool
from kvbridge.serve.proxy_legs import Answer, LegFailed, Upstream
from kvbridge.serve.proxy_release import LeaseReleaser
from kvbridge.serve.proxy_report import recompute_reason
from kvbridge.serve.routing import PromptKey
from kvbridge.transfer.offers import OfferOutbox

logger = logging.getLogger(__name__)

DISPATCHES = ("auto", "in-turn")
INBOX_MARGIN_S = 30.0  # an inbox whose proof ends sooner is not used: the prefill leg may start late


class InboxBook:
    """The latest hand-off inbox each decode node named, and whether it may be used now."""

    def __init__(self, margin_s: float = INBOX_MARGIN_S, wall_clock: Callable[[], float] = time.time) -> None:
        self._margin_s, self._wall_clock = margin_s, wall_clock
        self._inboxes: dict[str, tuple[dict[str, Any], int]] = {}  # decode URL -> (inbox, its ejections then)

    def learn(self, url: str, kv_transfer_params: Any, num_ejections: int) -> None:
        """Keep the inbox a decode answer's `kv_transfer_params` names, if any."""
        inbox = kv_transfer_params.get("handoff_inbox") if isinstance(kv_transfer_params, dict) else None
        if isinstance(inbox, dict) and isinstance(inbox.get("expires_at"), int | float):
            self._inboxes[url] = (inbox, num_ejections)

    def fresh(self, url: str, num_ejections: int) -> dict[str, Any] | None:
        """The inbox of `url` to send at once with, None when none is known or it may not be used."""
        inbox, ejections_then = self._inboxes.get(url, (None, None))
        if inbox is None or ejections_then != num_ejections:
            return None
        # a node without a side-channel secret vouches for nothing, and its inbox names no end
        if inbox.get("mac") and inbox["expires_at"] - self._wall_clock() <= self._margin_s:
            return None
        return inbox

    def has_any(self) -> bool:
        return bool(self._inboxes)


class Handoff(NamedTuple):
    """A request sent at once: its key, and the inbox of the decode node it was sent to."""

    key: str
    inbox: dict[str, Any]
    decode_url: str

    @classmethod
    def draw(cls, inbox: dict[str, Any], decode_url: str) -> Handoff:
        return cls(secrets.token_hex(32), inbox, decode_url)  # a fresh key per request: nobody else can name it

    def prefill_params(self) -> dict[str, Any]:
        return {"key": self.key, "inbox": self.inbox}

    def decode_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "handoff_key": self.key, "handoff_inbox": self.inbox}


class PrefillLeg:
    """One request's prefill leg, as the decode leg and the answer see it: awaited before the decode
    leg (in turn), or running beside it (at once: `handoff` set)."""

    def __init__(self, task: asyncio.Task[Answer | LegFailed], handoff: Handoff | None) -> None:
        self.task, self.handoff = task, handoff
        self.t0 = time.monotonic()
        self.seconds: float | None = None  # until it ended
        self.is_settled = False  # the decode leg ended
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self.seconds = time.monotonic() - self.t0

    @property
    def is_done(self) -> bool:
        return self.task.done()

    def answer(self) -> Answer | None:
        """The prefill node's answer; None while the leg runs, or when it ended without one (no node
        answered, a 4xx, the deadline)."""
        outcome = self._outcome()
        return outcome if isinstance(outcome, Answer) else None

    def _outcome(self) -> Answer | LegFailed | None:
        task = self.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    def kv_params(self) -> dict[str, Any] | None:
        answer = self.answer()
        params = answer.value.get("kv_transfer_params") if answer else None
        return params if isinstance(params, dict) else None

    async def wait_params(self) -> dict[str, Any] | None:
        """The params, once the leg ended. A client that hangs up meanwhile leaves the leg running (its
        params are then released)."""
        with contextlib.suppress(Exception):
            await asyncio.shield(self.task)
        return self.kv_params()

    def recompute_reason(self, decode_kvbridge: dict[str, Any]) -> str | None:
        """Why the decode node computed the prompt (proxy_report.RECOMPUTE_REASONS), None when it read it."""
        if self.handoff is None:
            reason = recompute_reason(True, self.answer() is not None, self.kv_params(), decode_kvbridge)
        else:  # at once, the params came in the prefill's offer, whether or not its answer has come yet
            reason = recompute_reason(True, True, self.handoff.decode_params(), decode_kvbridge)
            if reason is not None and self.is_done and self.kv_params() is None:
                reason = "no_prefill_node" if self.answer() is None else "no_kv_params"
        if reason == "no_prefill_node" and isinstance(failed := self._outcome(), LegFailed) and failed.is_busy:
            return "prefill_busy"
        return reason

    def was_taken(self, decode_url: str, recompute_reason: str | None) -> bool:
        """Whether the whole answer of `decode_url` (with its proxy_report recompute reason) came from a
        request that held this leg's params; the decode node then read or released them. In turn, they
        were in its body. At once, its inbox took the first offer under the key in time (its reason is
        not "handoff_missed", nor "handoff_misdirected"), and that offer is this answer's for sure only when
        the leg made one attempt."""
        answer = self.answer()
        if answer is None:
            return False
        if self.handoff is None or self.handoff.decode_url != decode_url:
            return True
        return answer.num_attempts == 1 and recompute_reason not in ("handoff_missed", "handoff_misdirected")


class NoOffers:
    """Offers nothing ({}) under the key of a request sent at once whose prefill leg gave no params, so
    that the decode waiting on it computes the prompt now. Signed with the proxy's side-channel secret,
    as its releases are; an inbox that refuses it (another secret) leaves the decode to its wait."""

    def __init__(self, secret: bytes | None) -> None:
        self._outbox = OfferOutbox(secret)
        self.num_sent = 0

    def send(self, handoff: Handoff) -> None:
        try:
            self._outbox.offer(HandoffRequest(key=handoff.key, inbox=msgspec.convert(handoff.inbox, InboxAddress)), {})
            self.num_sent += 1
        except (AuthenticationError, msgspec.ValidationError) as exc:
            logger.warning("could not tell decode node %s that no prefill will offer its KV (%s): it computes the "
                           "prompt after its handoff_wait_s", handoff.decode_url, exc)  # fmt: skip

    def close(self) -> None:
        self._outbox.close()


class Dispatcher:
    """Whether a request's legs go at once (`plan`), and what follows one that did: the decode nodes'
    inboxes, the offers of nothing, the prefill legs that outlive their request, and the releases of
    the params no decode node took."""

    def __init__(self, mode: str, upstream: Upstream, decode_pool: NodePool, releaser: LeaseReleaser,
                 secret: bytes | None) -> None:  # fmt: skip
        if mode not in DISPATCHES:
            raise ConfigError(f"--dispatch must be one of {', '.join(DISPATCHES)}, got {mode!r}")
        self.mode, self._upstream, self._decode_pool, self._releaser = mode, upstream, decode_pool, releaser
        self.inboxes = InboxBook()
        self._no_offers = NoOffers(secret)
        self._running: set[asyncio.Task] = set()  # prefill legs sent at once that outlived their request

    def plan(self, prompt: PromptKey) -> tuple[str | None, Handoff | None]:
        """For a disaggregated request: (the decode node chosen ahead, the hand-off when its legs go at
        once). Until some decode node named an inbox, nothing is chosen ahead: the decode leg picks
        its node as it starts, as in turn it always did."""
        if self.mode == "in-turn" or not self.inboxes.has_any():
            return None, None
        url = self._upstream.choose_decode(prompt)
        inbox = self.inboxes.fresh(url, self._decode_pool.num_ejections(url)) if url else None
        return url, Handoff.draw(inbox, url) if inbox else None

    def learn(self, decode_url: str, kv_transfer_params: Any) -> None:
        """A decode answer's params: the inbox they name, if any, is the node's latest."""
        self.inboxes.learn(decode_url, kv_transfer_params, self._decode_pool.num_ejections(decode_url))

    def prefill_leg(self, task: asyncio.Task[Answer | LegFailed], handoff: Handoff | None) -> PrefillLeg:
        prefill = PrefillLeg(task, handoff)
        if handoff is not None:
            task.add_done_callback(lambda _: self._offer_nothing_without_params(prefill))
        return prefill

    def _offer_nothing_without_params(self, prefill: PrefillLeg) -> None:
        """A prefill leg sent at once ended without params while its decode leg waits: it need not wait."""
        if prefill.kv_params() is None and not prefill.is_settled:
            self._no_offers.send(prefill.handoff)

    def settle(self, prefill: PrefillLeg, decode_url: str | None, reason: str | None) -> None:
        """The decode leg ended, with the whole answer of `decode_url` (None: without one) and its
        recompute `reason`: release the prefill's params unless that decode node took them. Sent at
        once, the prefill leg may still run: its params are then released, if they must be, when it
        answers."""
        prefill.is_settled = True

        def release_unless_taken(_: asyncio.Task) -> None:
            self._running.discard(prefill.task)
            if decode_url is None or not prefill.was_taken(decode_url, reason):
                self._releaser.release_soon(prefill.kv_params())  # nobody will read what the prefill node holds

        if not prefill.is_done:
            self._running.add(prefill.task)
        prefill.task.add_done_callback(release_unless_taken)

    def close(self) -> None:
        """At the proxy's cleanup: prefill legs still running are dropped (their leases expire)."""
        for task in list(self._running):
            task.cancel()
        self._no_offers.close()
