"""AsyncEngine: one `EngineCore` driven by one background thread, used from an asyncio server.

`EngineCore` is not thread-safe, so exactly one thread (the *engine thread*) ever touches it: it
builds the engine, runs `step()` while there is work, and executes everything else (adds, aborts,
stats, admin calls) as commands queued from other threads between steps. Outputs go back to
per-request `asyncio.Queue`s through `loop.call_soon_threadsafe`.

The engine thread never busy-spins: with nothing to do it waits on a condition variable that
`generate`/`abort`/`call` notify; with requests parked (waiting for remote KV, blocks held for a
peer) it polls so the connector's timers and notifications keep running, waiting between two
steps that computed nothing for a backoff that doubles from 50 us up to `poll_interval_s`, or
until a connector rings the engine's `wakeup` (an answer came in on one of its threads).

Callers (serve/api.py) use, from the event loop thread:
    engine = AsyncEngine(lambda: EngineCore(config)); engine.start()
    await engine.wait_ready(timeout)             # raises the engine's start-up error, if any
    async for out in engine.generate(rid, ids, params, kv_params): ...   # cumulative RequestOutput
    await engine.call(lambda core: core.get_stats())
    engine.shutdown()                            # joins the thread, then EngineCore.shutdown()
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import KVBridgeError
from kvbridge.serve.lease_quota import Occupancy
from kvbridge.transfer.progress import FIRST_WAIT_S, Backoff

logger = logging.getLogger(__name__)


class EngineDeadError(KVBridgeError):
    """The engine thread stopped (start-up failed, a step raised an engine fault, or the server is
    shutting down)."""


class RequestFailedError(KVBridgeError):
    """One request failed inside the engine for a reason other than its input; the engine serves on."""


class _Stream:
    """Where one request's outputs go: a queue owned by the event loop that awaits it."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _snapshot(output: RequestOutput) -> RequestOutput:
    """Copy the lists the engine may keep mutating after handing the output over."""
    return replace(
        output,
        prompt_token_ids=list(output.prompt_token_ids),
        outputs=[replace(c, token_ids=list(c.token_ids)) for c in output.outputs],
    )


class AsyncEngine:
    """Thread-safe, asyncio-facing wrapper around one EngineCore (built on the engine thread)."""

    def __init__(self, engine_factory: Callable[[], Any], poll_interval_s: float = 0.002) -> None:
        self._factory = engine_factory
        self._backoff = Backoff(min(FIRST_WAIT_S, poll_interval_s), poll_interval_s)  # while requests are parked
        self._cond = threading.Condition()
        # (command to run on the engine thread, the future it resolves or None)
        self._commands: collections.deque[tuple[Callable[[], None], concurrent.futures.Future | None]] = (
            collections.deque()
        )
        self._streams: dict[str, _Stream] = {}  # guarded by _cond
        self._stopping = False
        self._rung = False  # a connector finished something off-thread: end the idle wait (guarded by _cond)
        self._ready = threading.Event()
        self._error: BaseException | None = None  # start-up or step failure; set once
        self._thread = threading.Thread(target=self._run, name="kvbridge-engine", daemon=True)
        self.engine: Any = None  # the EngineCore; touch it only through call()
        self.occupancy: Occupancy | None = None  # its blocks and live requests, published after each step

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._stopping

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the engine is built. Raises its start-up error, or TimeoutError."""
        ok = await asyncio.get_running_loop().run_in_executor(None, self._ready.wait, timeout_s)
        if not ok:
            raise TimeoutError(f"the engine was not ready after {timeout_s:.0f}s")
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error}") from self._error

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the thread (in-flight requests end with EngineDeadError), then shut the engine down."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0fs; shutting the engine down anyway", timeout_s)
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()

    # ---------------------------------------------------------------- requests (event loop thread)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until one is `finished`.

        Raises ValueError (e.g. a duplicate id or an input the engine rejects), RequestFailedError
        (add_request failed otherwise) or EngineDeadError. A request that fails later ends with an
        output whose `error` says why (`EngineCore.step` isolates per-request faults).
        Closing the generator early (client gone, task cancelled) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            if self._error is not None or self._stopping:
                raise EngineDeadError("the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
            add = lambda: self._add(request_id, prompt_token_ids, sampling_params, kv_transfer_params)  # noqa: E731
            self._commands.append((add, None))
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine dropped it already (rejected or dead)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream gets nothing more."""
        with self._cond:
            if self._streams.pop(request_id, None) is None:
                return
            self._commands.append((lambda: self._abort(request_id), None))
            self._cond.notify()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine_core)` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Thread-safe: queue `fn(engine_core)` for the engine thread; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        with self._cond:
            if self._error is not None or self._stopping:
                future.set_exception(EngineDeadError("the engine is not running"))
                return future
            self._commands.append((command, future))
            self._cond.notify()
        return future

    @property
    def num_running(self) -> int:
        return len(self._streams)

    # ---------------------------------------------------------------- engine thread

    def _add(self, request_id: str, prompt_token_ids, sampling_params, kv_transfer_params) -> None:
        try:
            self.engine.add_request(request_id, prompt_token_ids, sampling_params, kv_transfer_params)
        except Exception as exc:  # noqa: BLE001 - the request is rejected, the engine lives on
            with self._cond:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                failed = RequestFailedError(f"request {request_id} failed in add_request: {type(exc).__name__}: {exc}")
                stream.put(exc if isinstance(exc, ValueError) else failed)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - e.g. it finished in the same step; nothing to undo
            logger.debug("abort of %s ignored", request_id, exc_info=True)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.has_pending_transfers()

    def _on_wakeup(self) -> None:
        """A connector's thread finished something (engine.wakeup rang): poll now, not at the backoff's end."""
        with self._cond:
            self._rung = True
            self._cond.notify_all()

    def _next_commands(self, idle_wait_s: float | None) -> tuple[list[Callable[[], None]], bool]:
        with self._cond:
            if not self._commands and not self._stopping and not self._rung and idle_wait_s != 0.0:
                self._cond.wait(idle_wait_s)
            self._rung = False
            commands = [command for command, _ in self._commands]
            self._commands.clear()
            return commands, self._stopping

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._cond:
                stream = self._streams.get(output.request_id)
                if stream is not None and output.finished:
                    del self._streams[output.request_id]
            if stream is not None:
                stream.put(_snapshot(output))

    def _publish(self) -> None:
        """Replace `occupancy` (one attribute store: readers on other threads see one snapshot or the next).
        Engine thread; engines without a block pool (tests' fakes) publish none."""
        scheduler = getattr(self.engine, "scheduler", None)
        pool = getattr(getattr(scheduler, "kv", None), "pool", None)
        if pool is None:
            return
        live = frozenset(scheduler.requests) | scheduler.pending_transfer_req_ids()
        held = sum(len(scheduler.kv.block_ids(r)) for r in scheduler.transfers.block_owners())
        self.occupancy = Occupancy(time.monotonic(), pool.num_blocks, pool.num_free_blocks, held, live)

    def _fail_all(self, exc: BaseException) -> None:
        """End every waiting request and every queued call with `exc` (engine thread, at exit)."""
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
            futures = [future for _, future in self._commands if future is not None]
            self._commands.clear()
        for stream in streams:
            stream.put(exc)
        for future in futures:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready and /health
            # A named error (a bad model, a busy port, UCX) says what to do: its traceback, only at
            # DEBUG, would bury that. Anything else is a bug: loud, with its traceback.
            named = isinstance(exc, KVBridgeError)
            (logger.debug if named else logger.error)("engine start-up failed", exc_info=True)
            self._error = exc
            self._ready.set()
            return
        wakeup = getattr(self.engine, "wakeup", None)
        if wakeup is not None:
            wakeup.subscribe(self._on_wakeup)
        self._publish()
        self._ready.set()
        idle_wait: float | None = None  # None: sleep until notified
        try:
            while True:
                commands, stopping = self._next_commands(idle_wait)
                for command in commands:
                    command()
                if stopping:
                    break
                if not self._has_work():
                    idle_wait = None
                    continue
                outputs = self.engine.step()
                self._publish()  # before the outputs: a client that saw its request end finds it counted
                self._dispatch(outputs)
                if not self._has_work():
                    idle_wait = None
                elif outputs or not getattr(self.engine, "is_idle", False):
                    self._backoff.reset()
                    idle_wait = 0.0
                else:  # no output: requests are parked (remote KV, held blocks); poll, backing off
                    idle_wait = self._backoff.next_s()
        except BaseException as exc:  # noqa: BLE001 - step() raises only engine faults: they end it, loudly
            logger.exception("engine step failed; the engine is stopped")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc}"))
            return
        self._fail_all(EngineDeadError("the server is shutting down"))
