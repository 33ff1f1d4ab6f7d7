"""Prefill: grant a lease in the step its request finishes, when both halves share a process.

The scheduler half returns a finished request's kv_transfer_params at once; the worker half holds
the KV. Where they live in one process (the reference engine; vLLM with one GPU worker in its engine
core), the worker registers here under its engine instance's incarnation and the scheduler half
asks it to digest and grant the lease right away, so the params leave with the signed grant
(transfer/grants.py) and the decode needs no answer from this node before it uses what it read.
Elsewhere (a tensor-parallel node, a worker in another process) no granter is found: the lease is
granted in the worker's next step, and readers confirm their reads on the side channel as before.

Scheduler and worker halves call in on the engine thread only.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from kvbridge.transfer.messages import LeaseRef


class Granter(Protocol):
    def grant_now(self, lease: LeaseRef, lease_s: float) -> str | None:
        """Digest and grant `lease` now; its signed grant, or None when it could not be (granted later)."""


_GRANTERS: weakref.WeakValueDictionary[str, Granter] = weakref.WeakValueDictionary()


def register(incarnation: str, granter: Granter) -> None:
    _GRANTERS[incarnation] = granter


def unregister(incarnation: str) -> None:
    _GRANTERS.pop(incarnation, None)


def granter_for(incarnation: str) -> Granter | None:
    """The live worker half of engine instance `incarnation` in this process that grants on the spot."""
    return _GRANTERS.get(incarnation)
