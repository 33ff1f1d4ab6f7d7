"""A read whose bytes land late: fault injection for tests (env.fault_delay_read_s).

A peer that stalls mid-read (stopped, overloaded, behind a partition) leaves a NIXL read in flight
past the reader's deadline, and its bytes land whenever the peer resumes: measured over UCX's TCP
transport, after the reader released the transfer and removed the peer's agent. The reader must hold
the read's destination blocks (quarantine) until the transfer is over, whatever its clock says.

`DelayedPost` plays such a peer on demand. It posts the read at once, and once NIXL has delivered
the bytes it keeps a copy of them and reports the read in flight until `delay_s` after the post;
then a timer thread writes that copy into the destination pages again, whether or not the reader
still polls or holds the transfer, and only after that write does the read end. With `delay_s` past
`transfer_timeout_s`, the read expires first and is quarantined, and a test checks that nobody else
owned those blocks when the late bytes landed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.transfer.agent import XferState
from kvbridge.transfer.nixl_post import NixlPost, poll_post

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)


class DelayedPost:
    """`post` (a NIXL read into `region` at `page_offsets`), delivered again `delay_s` after it was
    posted; polled as in flight until then. Polled on the endpoint's thread; the late write runs on a
    timer thread of its own."""

    def __init__(
        self,
        post: NixlPost | None,
        region: torch.Tensor,  # [region_nbytes] uint8: the reader's KV
        page_offsets: np.ndarray,  # byte offsets of the destination pages
        page_nbytes: int,
        delay_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.posted = post
        self._region, self._offsets, self._page_nbytes = region, page_offsets.reshape(-1).tolist(), page_nbytes
        self._land_at = clock() + delay_s
        self._clock = clock
        self._timer: threading.Timer | None = None
        self._landed = threading.Event()
        self._failed = False

    def poll(self, agent) -> XferState:
        if self._landed.is_set():
            return XferState.FAILED if self._failed else XferState.DONE
        if self._timer is None:
            state = poll_post(agent, self.posted) if self.posted is not None else XferState.DONE
            if state is XferState.IN_PROGRESS:
                return state
            self._failed = state is XferState.FAILED
            copy = [self._region[o : o + self._page_nbytes].clone() for o in self._offsets]  # the bytes the peer sent
            self._timer = threading.Timer(max(0.0, self._land_at - self._clock()), self._land, (copy,))
            self._timer.daemon = True
            self._timer.start()
        return XferState.IN_PROGRESS

    def _land(self, copy) -> None:
        for o, page in zip(self._offsets, copy):
            self._region[o : o + self._page_nbytes].copy_(page)
        logger.warning("a read delayed by fault injection landed its bytes now, past its deadline")
        self._landed.set()
