"""Ranks 1..N-1 of a tensor-parallel engine, as rank 0 sees them: started with its model runner,
fed one broadcast per step, stopped with it.

Each worker is `python -m kvbridge.engine.tp_worker_main`, a plain subprocess (not multiprocessing:
nothing re-imports the user's `__main__`, and nothing is pickled). Its `WorkerSpec` travels as
msgspec JSON on its stdin, a pipe only rank 0 writes. Rank 0 hosts the rendezvous `TCPStore` on
loopback, port chosen by the kernel.

A worker never outlives rank 0: it exits when rank 0 sends SHUTDOWN, when a collective fails
because rank 0's sockets closed, and, whatever it is doing (loading weights, blocked in NCCL), when
its watchdog sees its parent process gone (tp_worker_main.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import msgspec
import torch.distributed as dist

from kvbridge.config import CacheConfig, KVTransferConfig, ModelConfig
from kvbridge.engine.faults import EngineFaultError
from kvbridge.engine.step_inputs import StepInputs
from kvbridge.engine.tp_group import STORE_HOST, ControlOp, TPGroup, encode_step, rank_device
from kvbridge.errors import TensorParallelError

logger = logging.getLogger(__name__)
T = TypeVar("T")

JOIN_TIMEOUT_S = 300.0  # for every worker to start Python, import torch and reach the rendezvous
STOP_TIMEOUT_S = 10.0  # for the workers to exit after SHUTDOWN before they are killed
DEATH_GRACE_S = 1.0  # after a failed broadcast, for the worker that broke it to finish exiting
WORKER_MODULE = "kvbridge.engine.tp_worker_main"


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker rank is started with (rank 0 -> worker stdin, msgspec JSON)."""

    rank: int
    world_size: int
    store_port: int
    parent_pid: int
    model: ModelConfig
    cache: CacheConfig
    kv_transfer: KVTransferConfig | None = None  # the worker builds its own half of the connector from it


def joined_key(rank: int) -> str:
    """The store key a worker sets once it is about to join the process group."""
    return f"joined/{rank}"


class TPWorkers:
    """Rank 0's handle on the other ranks' processes and its own membership (`group`)."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, kv_transfer: KVTransferConfig | None = None
    ) -> None:
        """Start ranks 1..N-1 and join the group with them. Raises TensorParallelError when a worker
        exits or does not arrive within JOIN_TIMEOUT_S (its stderr, inherited, says why)."""
        world_size = model_config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        self._store = dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        self._procs: list[subprocess.Popen] = []
        # An engine dropped without shutdown() (or one whose construction failed above this runner)
        # must not leave its workers running until this process exits: they are killed when this
        # handle is collected. stop() detaches it.
        self._finalizer = weakref.finalize(self, _kill, self._procs)
        self.group: TPGroup | None = None
        self._is_out_of_step = False  # a step failed midway: the workers cannot be told anything more
        try:
            for rank in range(1, world_size):
                spec = WorkerSpec(rank, world_size, self._store.port, os.getpid(), model_config, cache_config, kv_transfer)
                self._procs.append(_spawn(spec))
            self._wait_joined(world_size)
            self.group = TPGroup(self._store, 0, world_size, rank_device(model_config.device, 0))
        except BaseException:
            self.stop(kill=True)
            raise
        logger.info("tensor parallel: %d ranks, worker pids %s", world_size, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _wait_joined(self, world_size: int) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        keys = [joined_key(rank) for rank in range(1, world_size)]
        while not self._store.check(keys):
            if (dead := self.dead_worker()) is not None:
                raise TensorParallelError(f"{dead} while starting; see its log lines above")
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not start within {JOIN_TIMEOUT_S:g} s; see their log lines above"
                )
            time.sleep(0.02)

    def dead_worker(self) -> str | None:
        """Which worker rank's process has exited, with its exit code; None while all run (a waitpid each)."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    def run_step(self, inputs: StepInputs, forward: Callable[[], T]) -> T:
        """Hand the step's inputs to every worker, then run rank 0's part of it (`forward`, whose
        collectives the workers join) and return what it returns.

        Any failure is an EngineFaultError, since the ranks can no longer agree on a next step: a
        worker that has died (named, with its exit code), or rank 0 failing midway while the others
        wait inside the step's collectives. After one, every step raises and `stop` kills the workers.
        """
        if (dead := self.dead_worker()) is not None:  # at once, rather than from inside a collective
            raise EngineFaultError(f"{dead}; the engine cannot go on without it, restart it")
        if self._is_out_of_step:
            raise EngineFaultError("an earlier tensor-parallel step failed midway; restart the engine")
        try:
            self.group.send(ControlOp.STEP, encode_step(inputs))
            return forward()
        except EngineFaultError as exc:  # a collective failed: name the worker once it has exited
            self._is_out_of_step = True
            dead = self._wait_for_dead_worker(DEATH_GRACE_S) or "a tensor-parallel worker stopped answering"
            raise EngineFaultError(f"{dead}; the engine cannot go on without it, restart it") from exc
        except BaseException as exc:
            self._is_out_of_step = True
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are
            raise EngineFaultError(
                f"a tensor-parallel step failed on rank 0 after the other ranks had started it "
                f"({type(exc).__name__}: {exc}); the ranks are out of step, restart the engine"
            ) from exc

    def _wait_for_dead_worker(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while (dead := self.dead_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return dead

    def stop(self, kill: bool = False) -> None:
        """Tell the workers to exit, wait for them (killing any that outstay STOP_TIMEOUT_S), close
        the group and the store. Idempotent; safe after a worker died. With `kill`, or when no group
        was formed or a step failed midway, the workers are killed at once: they may be inside a
        collective (loading, agreeing on the cache size, a step) that will never complete."""
        if kill or self.group is None or self._is_out_of_step:
            _kill(self._procs)
        elif self.group is not None and all(p.poll() is None for p in self._procs):
            try:
                self.group.send(ControlOp.SHUTDOWN)
            except Exception:  # noqa: BLE001 - a worker died meanwhile: the waits below handle it
                logger.warning("tensor parallel: SHUTDOWN did not reach every worker", exc_info=True)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor parallel: worker pid %d outstayed %g s; killing it", proc.pid, STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()
        self._procs.clear()
        self._finalizer.detach()
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    # The workers import this very kvbridge, wherever this process found it.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": python_path}
    proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, env=env)
    proc.stdin.write(msgspec.json.encode(spec))
    proc.stdin.close()
    return proc
