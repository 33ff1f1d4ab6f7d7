"""A prefill engine in its own OS process, driven over a multiprocessing pipe (test helper).

The process keeps stepping its engine between commands, as a server would, so leases are
granted, renewed, released and expired while the test process (the decode side) works; `pause`
stops that after a prefill, until `resume` (a prefill engine slow to reach its next step, the one
that grants the lease: its side channel still answers meanwhile).
Commands are plain tuples; the pipe is private to the test, between two of its own processes.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from contextlib import contextmanager

BLOCK_SIZE = 16


def engine_kwargs(engine_id: str, role: str, **extra) -> dict:
    kv = dict(connector="NixlConnector", role=role, engine_id=engine_id, side_channel_host="127.0.0.1")
    kv.update(extra.pop("kv", {}))
    return dict(num_blocks=extra.pop("num_blocks", 96), block_size=extra.pop("block_size", BLOCK_SIZE),
                kv_transfer_config=kv, **extra)


def _serve(conn, kwargs: dict) -> None:
    from kvbridge import LLM, SamplingParams

    llm = LLM(**kwargs)
    engine = llm.engine
    conn.send(("ready", None))
    paused = False
    while True:
        if conn.poll(0.001):
            cmd, arg = conn.recv()
            if cmd == "prefill":
                prompts, max_tokens, paused = arg
                outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                                    kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
                conn.send(("ok", [o.kv_transfer_params for o in outs]))
            elif cmd == "resume":
                paused = False
                conn.send(("ok", None))
            elif cmd == "state":
                engine.check_integrity()
                conn.send(("ok", engine.get_stats()))
            elif cmd == "stop":
                llm.shutdown()
                conn.send(("ok", None))
                return
        elif not paused and (engine.has_unfinished_requests() or engine.has_pending_transfers()):
            engine.step()


class PrefillNode:
    def __init__(self, **llm_kwargs) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, llm_kwargs), daemon=True)
        self.process.start()
        self._expect("ready", timeout_s=120)

    def _expect(self, status: str, timeout_s: float = 60):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"prefill node gave no answer within {timeout_s}s")
        got, value = self._conn.recv()
        assert got == status, (got, value)
        return value

    def call(self, cmd: str, arg=None, timeout_s: float = 60):
        self._conn.send((cmd, arg))
        return self._expect("ok", timeout_s)

    def prefill(self, prompts: list[str], max_tokens: int = 1, pause: bool = False) -> list[dict]:
        """The prompts' kv_transfer_params; `pause`: step no more (no lease granted) until `resume()`."""
        return [dict(p, do_remote_prefill=True) for p in self.call("prefill", (prompts, max_tokens, pause))]

    def resume(self) -> None:
        self.call("resume")

    def state(self) -> dict:
        return self.call("state")

    def wait_until(self, predicate, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if predicate(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.call("stop", timeout_s=30)
        finally:
            self.kill()


@contextmanager
def prefill_node(**llm_kwargs):
    node = PrefillNode(**llm_kwargs)
    try:
        yield node
    finally:
        node.stop()
