"""Which faults end one request, and which end the engine.

An exception raised while the engine works on a request ends that request (FINISHED_ERROR, the
reason in its output) and the engine serves on. Two kinds of fault concern the whole engine instead:

* the device failed: a CUDA error is sticky (every later kernel of the process fails too), and a
  lost device or a device-side assert leaves the KV cache in an unknown state;
* the engine's own bookkeeping broke: `check_integrity()` fails after the fault.

Both leave `EngineCore.step()` as exceptions (`fail_step` sorts a step's fault); the server then
marks the engine failed (`/health` 503) and a supervisor restarts the process. No torch import:
device faults are told by type name and message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbridge.engine.request import RequestStatus
from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    from kvbridge.connectors.base import SchedulerOutput
    from kvbridge.engine.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)

# Substrings of the messages torch and the CUDA/ROCm runtimes give to errors that poison the device.
DEVICE_FAULT_MARKERS = (
    "CUDA error",
    "CUDA driver error",
    "device-side assert",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "NCCL error",
    "HIP error",
    "no CUDA-capable device",
)
DEVICE_FAULT_TYPES = ("AcceleratorError", "CudaError")  # torch.AcceleratorError (2.8+), torch.cuda.CudaError


class EngineFaultError(KVBridgeError, RuntimeError):
    """The engine cannot go on: its device failed or its bookkeeping broke. Restart the process."""


def is_engine_fault(exc: BaseException) -> bool:
    """True when `exc` concerns the whole engine rather than the request it was raised for.

    Out-of-memory is not one: the allocation failed, the device is intact, and the step's
    requests are failed instead.
    """
    if isinstance(exc, EngineFaultError) or not isinstance(exc, Exception):
        return True  # ours, or KeyboardInterrupt / SystemExit: never swallowed
    if type(exc).__name__ in DEVICE_FAULT_TYPES:
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in message for marker in DEVICE_FAULT_MARKERS)


def fail_request(scheduler: Scheduler, update: RequestUpdate, reason: str) -> RequestUpdate:
    """End one request with `reason` (its output's `error`), whatever state it is in."""
    request = update.request
    reason = f"request {request.request_id} failed: {reason}"
    if not request.is_finished:
        return scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, reason)
    request.status, request.error = RequestStatus.FINISHED_ERROR, reason  # its blocks are already released
    return update


def fail_step(scheduler: Scheduler, output: SchedulerOutput, exc: Exception) -> list[RequestUpdate]:
    """A step raised `exc` outside any one request's hooks: end the requests it worked on.

    Those are the requests it scheduled and the ones parked on a KV load (the worker's loads run
    in every step): whichever of them caused the fault, it cannot cause it again. Raises `exc`
    itself when it is an engine fault, and EngineFaultError when the step worked on no request
    (the fault is in the engine's own transfer machinery) or the bookkeeping broke.
    """
    if is_engine_fault(exc):
        raise exc
    reason = f"{type(exc).__name__}: {exc}"
    victims = [s.request for s in output.scheduled] + scheduler.parked_requests()
    if not victims:
        raise EngineFaultError(f"an engine step that worked on no request failed: {reason}") from exc
    logger.error("a step failed; its %d request(s) end with the error", len(victims), exc_info=exc)
    updates = scheduler.take_failed()
    for request in victims:
        if not request.is_finished:
            why = f"request {request.request_id} failed: the engine step failed: {reason}"
            updates.append(scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, why))
    try:
        scheduler.check_integrity()
    except Exception as broken:  # noqa: BLE001 - any failure of the check means the same
        raise EngineFaultError(f"after a step failed ({reason}) the engine's bookkeeping is broken: {broken}") from exc
    return updates
