"""A worker rank of a tensor-parallel engine: `python -m kvbridge.engine.tp_worker_main`, started by
rank 0 (tp_workers.py) with a `WorkerSpec` on stdin.

It builds a `ModelRunner` for its rank (its shard of the weights, its KV heads' cache), then runs the
forward of every step rank 0 broadcasts until SHUTDOWN. It exits with rank 0, whichever way rank 0
goes: SHUTDOWN, a failed collective (rank 0's sockets closed), or the watchdog below.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

import msgspec
import torch.distributed as dist

from kvbridge.connectors.base import ConnectorContext, KVConnectorBase, KVConnectorRole
from kvbridge.connectors.factory import create_connector
from kvbridge.engine.faults import EngineFaultError
from kvbridge.engine.tp_connector import RankFollower
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.tp_group import STORE_HOST, ControlOp, TPGroup, decode_step, rank_device
from kvbridge.engine.tp_workers import JOIN_TIMEOUT_S, WorkerSpec, joined_key

logger = logging.getLogger("kvbridge.engine.tp_worker_main")  # also when run as __main__

WATCHDOG_PERIOD_S = 0.2
EXIT_ORPHANED = 3  # exit code of a worker whose rank 0 vanished


def exit_when_orphaned(parent_pid: int) -> None:
    """A daemon thread that ends this process as soon as `parent_pid` is no longer its parent (rank 0
    died and the process was re-parented), whatever the main thread is blocked in."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        os._exit(EXIT_ORPHANED)  # no cleanup to wait for: the memory goes with the process

    threading.Thread(target=watch, name="kvbridge-tp-watchdog", daemon=True).start()


def run(spec: WorkerSpec) -> None:
    exit_when_orphaned(spec.parent_pid)
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    store = dist.TCPStore(STORE_HOST, spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    store.set(joined_key(spec.rank), "1")
    group = TPGroup(store, spec.rank, spec.world_size, rank_device(spec.model.device, spec.rank))
    runner = ModelRunner(spec.model, spec.cache, rank=spec.rank, group=group)
    connector = None
    try:
        follower = None
        if spec.kv_transfer is not None:
            connector = build_connector(spec, runner)
            runner.attach_connector(connector)  # registers this rank's KV and joins rank 0 (tp_connector.join)
            follower = RankFollower(group, connector)
        while True:
            op, payload = group.receive()
            match op:
                case ControlOp.STEP:
                    runner.run_shard_step(decode_step(payload))
                case ControlOp.KV_BEGIN:
                    follower.begin(payload)
                case ControlOp.KV_END:
                    follower.end()
                case ControlOp.SHUTDOWN:
                    break
    finally:
        if connector is not None:
            connector.shutdown()  # deregisters this rank's KV from NIXL before the runner drops it
        runner.shutdown()
        group.close()


def build_connector(spec: WorkerSpec, runner: ModelRunner) -> KVConnectorBase:
    """This rank's worker half of the connector, over its own KV heads."""
    context = ConnectorContext(
        model_id=runner.model_id, block_size=runner.layout.block_size, device=str(runner.device),
        hash_namespace=runner.model_id, layout=runner.layout, tp_rank=spec.rank, tp_size=spec.world_size,
        kv_head_start=runner.kv_head_start, num_total_kv_heads=runner.num_total_kv_heads,
    )  # fmt: skip
    return create_connector(spec.kv_transfer, KVConnectorRole.WORKER, context)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    try:
        run(spec)
    except EngineFaultError as exc:  # rank 0 (or another rank) went away: expected, no traceback
        logger.warning("%s; rank %d exits", exc, spec.rank)
        return 1
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
