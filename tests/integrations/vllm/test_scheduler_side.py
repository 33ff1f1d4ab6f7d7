"""KVBridgeConnector's scheduler half inside vLLM's real `Scheduler`: each test tries to break one promise.

No engine process, no worker, no NIXL agent: `sched_harness` drives vLLM 0.32's Scheduler step by
step and plays the worker's reports (finished_sending / finished_recving / invalid_block_ids).

    .venv-vllm/bin/python -m pytest -q tests/integrations/vllm/test_scheduler_side.py
"""

from __future__ import annotations

import glob
import os
import random

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from sched_harness import BLOCK_SIZE, NixlWorkerModel, OffloadWorkerModel, SchedulerHarness  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbridge.block_hash import hash_full_blocks  # noqa: E402
from kvbridge.connectors.nixl.scheduler import SIDE_CHANNEL_PORT_STAT  # noqa: E402
from kvbridge.engine.checkpoint_id import checkpoint_id  # noqa: E402
from kvbridge.transfer.messages import LeaseRef  # noqa: E402

pytestmark = pytest.mark.vllm

INCARNATION = "5eed" * 8  # what the worker reports in its start-up handshake metadata
PORT = 5601  # the side-channel port the worker bound, reported in its step stats
ADAPTER_STATE = ("_delayed", "_loading", "_sent_early", "_redeliver", "_drained", "_matched_async")


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_tokens)]


def model_id_of(model_dir: str) -> str:
    """The checkpoint's identity as kvbridge's own engine computes it (the block hashes' namespace)."""
    return checkpoint_id(os.path.join(model_dir, "config.json"), glob.glob(os.path.join(model_dir, "*.safetensors")))


def leftovers(h: SchedulerHarness) -> dict[str, object]:
    """The adapter's per-request bookkeeping that is not empty."""
    state = {name: getattr(h.adapter, name) for name in ADAPTER_STATE} | {"views": len(h.adapter.views)}
    return {name: value for name, value in state.items() if value}


def producer(model_dir: str, **config) -> SchedulerHarness:
    return SchedulerHarness.build(
        model_dir, role="kv_producer", engine_id="prefill-0", incarnation=INCARNATION,
        step_stats={SIDE_CHANNEL_PORT_STAT: PORT}, **config,
    )  # fmt: skip


def consumer(model_dir: str, **config) -> SchedulerHarness:
    return SchedulerHarness.build(model_dir, role="kv_consumer", engine_id="decode-0", **config)


def mint_params(model_dir: str, prompts: list[list[int]]) -> list[dict]:
    """What a prefill engine returns for each prompt (its leases are then reported as read)."""
    p = producer(model_dir)
    for i, prompt in enumerate(prompts):
        p.add_request(f"mint-{i}", prompt, kv_transfer_params={"do_remote_decode": True})
    finished: dict = {}
    for _ in range(10 * len(prompts)):
        if len(finished) == len(prompts):
            break
        read = set(p.adapter.held_requests())  # a decode node read these: their blocks go back to the pool
        finished.update(p.step(finished_sending=read).finished)
    return [dict(finished[f"mint-{i}"].kv_transfer_params) for i in range(len(prompts))]


# ---------------------------------------------------------------------- 1. producer


def test_producer_holds_the_prompt_blocks_under_a_lease_until_finished_sending(tiny_checkpoint):
    p = producer(tiny_checkpoint)
    prompt = prompt_of(1, 2 * BLOCK_SIZE + 8)  # two full blocks and a partial one
    p.add_request("p0", prompt, kv_transfer_params={"do_remote_decode": True})

    params = p.step().finished["p0"].kv_transfer_params
    held = p.block_ids("p0")
    block_hash = hash_full_blocks(prompt, BLOCK_SIZE, namespace=model_id_of(tiny_checkpoint))[1].hex()
    assert p.finishes["p0"] == [(True, params)]
    assert params["remote_block_ids"] == held[:2]
    assert params["remote_block_hash"] == block_hash
    assert len(params["remote_lease_token"]) == 64
    assert params["remote_incarnation"] == INCARNATION  # the worker's, not one the scheduler half made up
    assert params["remote_port"] == PORT
    assert p.num_used_blocks == len(held) == 3

    lease = LeaseRef(req_id="p0", token=params["remote_lease_token"], block_ids=held[:2], block_hash=block_hash)
    assert p.step().metadata.leases == {"p0": lease}  # the worker grants it in the step after the finish
    for _ in range(3):
        assert p.step().metadata.leases == {}
        assert p.num_used_blocks == 3 and "p0" in p.scheduler.requests

    p.step(finished_sending={"p0"})
    assert p.num_used_blocks == 0
    assert "p0" not in p.scheduler.requests
    assert leftovers(p) == {}
    assert not p.adapter.has_pending_transfers()


# ---------------------------------------------------------------------- 2. reports vLLM must not see yet


def test_an_early_finished_sending_is_held_until_the_request_finishes(tiny_checkpoint):
    p = producer(tiny_checkpoint)
    p.add_request("p0", prompt_of(2, 40), max_tokens=4, kv_transfer_params={"do_remote_decode": True})
    p.step()
    held = p.block_ids("p0")

    step = p.step(finished_sending={"p0"})  # a worker reporting a send while the request still runs
    assert "p0" not in step.finished
    assert p.scheduler.requests["p0"].status == RequestStatus.RUNNING
    assert p.block_ids("p0") == held and p.num_used_blocks == len(held)

    step = p.step()
    assert step.num_scheduled_tokens == {"p0": 1}  # it keeps decoding on its own blocks
    step = p.step()
    assert step.finished["p0"].new_token_ids and p.scheduler.requests.get("p0") is None
    assert p.finishes["p0"][0][0] is True  # delayed, and the held-back report then freed the blocks
    assert p.num_used_blocks == 0
    assert leftovers(p) == {}


def test_reports_naming_no_transfer_are_dropped(tiny_checkpoint):
    p = producer(tiny_checkpoint)
    p.add_request("p0", prompt_of(3, 40), max_tokens=3)
    p.step()
    used = p.num_used_blocks

    # made-up ids, and a running request that loads nothing (vLLM asserts on both)
    p.step(finished_sending={"nobody"}, finished_recving={"nobody-either", "p0"})
    assert p.scheduler.requests["p0"].status == RequestStatus.RUNNING and p.num_used_blocks == used
    assert "p0" in p.step(finished_sending={"ghost"}).finished
    assert p.num_used_blocks == 0 and leftovers(p) == {}


# ---------------------------------------------------------------------- 3. consumer


@pytest.mark.parametrize("num_tokens, num_remote, num_computed_after", [(40, 32, 8), (48, 48, 1)])
def test_a_remote_prefill_parks_until_finished_recving_then_computes_the_rest(
    tiny_checkpoint, num_tokens, num_remote, num_computed_after
):
    prompt = prompt_of(4, num_tokens)
    (params,) = mint_params(tiny_checkpoint, [prompt])
    d = consumer(tiny_checkpoint)
    d.add_request("d0", prompt, kv_transfer_params=params)

    step = d.step()
    assert d.matches["d0"] == [(num_remote, True)]
    assert d.scheduler.requests["d0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert step.num_scheduled_tokens == {}
    (job,) = step.metadata.recvs.values()
    assert job.request_id == "d0"
    assert job.local_block_ids == tuple(d.block_ids("d0")[: num_remote // BLOCK_SIZE])
    assert job.remote_block_ids == tuple(params["remote_block_ids"])
    assert job.lease.token == params["remote_lease_token"] and job.remote.incarnation == INCARNATION
    assert job.remote.port == PORT

    assert d.step().num_scheduled_tokens == {}  # still reading
    d.step(finished_recving={"d0"})
    step = d.step()
    assert step.num_scheduled_tokens == {"d0": num_computed_after}
    assert "d0" in step.finished
    assert d.num_used_blocks == 0 and leftovers(d) == {}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_remote_load_follows_vllms_load_failure_policy(tiny_checkpoint, policy):
    prompt = prompt_of(5, 40)
    (params,) = mint_params(tiny_checkpoint, [prompt])
    d = consumer(tiny_checkpoint, load_failure_policy=policy)
    d.add_request("d0", prompt, kv_transfer_params=params)
    (job,) = d.step().metadata.recvs.values()

    step = d.step(finished_recving={"d0"}, invalid_block_ids={job.local_block_ids[1]})
    if policy == "fail":
        assert step.finished["d0"].finish_reason == FinishReason.ERROR
        assert "d0" not in d.scheduler.requests
    else:
        assert "d0" not in step.finished
        assert d.step().num_scheduled_tokens == {"d0": 40 - BLOCK_SIZE}  # from the first bad block on
    assert d.num_used_blocks == 0 and leftovers(d) == {}


# ---------------------------------------------------------------------- 4. forged params


def _forge(params: dict, other: dict, forgery: str) -> dict:
    forged = dict(params)
    match forgery:
        case "another_prompts_hash":
            forged["remote_block_hash"] = other["remote_block_hash"]
        case "another_prompts_params":
            forged = dict(other)
        case "negative_block_id":
            forged["remote_block_ids"] = [-1, params["remote_block_ids"][1]]
        case "block_id_past_int64":
            forged["remote_block_ids"] = [2**63, 2**64 - 1]  # vLLM itself refuses 2**64 and above
        case "two_million_block_ids":
            forged["remote_block_ids"] = list(range(2**21))
        case "more_blocks_than_the_prompt":
            forged["remote_block_ids"] = params["remote_block_ids"] * 2
        case "no_lease_token":
            del forged["remote_lease_token"]
        case "empty_lease_token":
            forged["remote_lease_token"] = ""
        case "no_incarnation":
            del forged["remote_incarnation"]
        case "other_block_size":
            forged["remote_block_size"] = 2 * BLOCK_SIZE
        case "bad_port":
            forged["remote_port"] = 70000
        case "block_ids_not_a_list":
            forged["remote_block_ids"] = "1,2"
    return forged


FORGERIES = [
    "another_prompts_hash", "another_prompts_params", "negative_block_id", "block_id_past_int64",
    "two_million_block_ids", "more_blocks_than_the_prompt", "no_lease_token", "empty_lease_token",
    "no_incarnation", "other_block_size", "bad_port", "block_ids_not_a_list",
]  # fmt: skip


@pytest.fixture(scope="module")
def minted(tiny_checkpoint):
    prompts = [prompt_of(6, 40), prompt_of(7, 40)]
    return prompts, mint_params(tiny_checkpoint, prompts)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_remote_prefill_params_get_no_external_tokens(tiny_checkpoint, minted, forgery):
    (prompt, _), (params, other) = minted
    d = consumer(tiny_checkpoint)
    d.add_request("d0", prompt, max_tokens=2, kv_transfer_params=_forge(params, other, forgery))

    step = d.step()
    assert d.matches["d0"] == [(0, False)]
    assert step.num_scheduled_tokens == {"d0": 40}  # the whole prompt, computed here
    assert all(not job.local_block_ids for job in step.metadata.recvs.values())  # nothing is read
    recvs = set(step.metadata.recvs)  # an empty job may still tell the prefill to release its blocks
    assert "d0" in d.step(finished_recving=recvs).finished
    assert d.num_used_blocks == 0 and leftovers(d) == {}


# ---------------------------------------------------------------------- 5. offload


def offload(model_dir: str, **config) -> SchedulerHarness:
    return SchedulerHarness.build(
        model_dir, role="kv_both", connector="OffloadingConnector", options={"host_num_blocks": 8}, **config
    )


def test_offloaded_blocks_are_loaded_by_a_later_request(tiny_checkpoint):
    o = offload(tiny_checkpoint)
    prompt = prompt_of(8, 40)
    hashes = hash_full_blocks(prompt, BLOCK_SIZE, namespace=model_id_of(tiny_checkpoint))
    o.add_request("r0", prompt)
    step = o.step()
    (store,) = step.metadata.stores
    assert (store.req_id, store.gpu_block_ids, store.hashes) == ("r0", o.block_ids("r0")[:2], hashes[:2])
    assert o.finishes["r0"] == [(True, None)]  # held until the stores are done
    o.step()
    assert o.num_used_blocks == 3
    o.step(finished_sending={"r0"})
    assert o.num_used_blocks == 0
    assert o.scheduler.kv_cache_manager.reset_prefix_cache()  # only the host tier holds the prompt now

    o.add_request("r1", prompt)
    step = o.step()
    assert o.matches["r1"] == [(32, True)]
    assert o.scheduler.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step.metadata.loads
    assert (load.req_id, load.gpu_block_ids, load.hashes) == ("r1", o.block_ids("r1")[:2], hashes[:2])
    o.step(finished_recving={"r1"})
    assert o.step().num_scheduled_tokens == {"r1": 8}
    o.step(finished_sending={"r1"})
    assert o.num_used_blocks == 0 and leftovers(o) == {}
    o.inner.check_integrity()


def _offload_with_a_load_in_flight(model_dir: str, prompt: list[int], **config) -> SchedulerHarness:
    o = offload(model_dir, **config)
    o.add_request("r0", prompt)
    o.step()
    o.step(finished_sending={"r0"})
    assert o.scheduler.kv_cache_manager.reset_prefix_cache()
    o.add_request("r1", prompt)
    (load,) = o.step().metadata.loads
    assert load.req_id == "r1"
    return o


def test_a_failed_offload_load_cancels_the_hit(tiny_checkpoint):
    prompt = prompt_of(9, 40)
    hashes = hash_full_blocks(prompt, BLOCK_SIZE, namespace=model_id_of(tiny_checkpoint))
    o = _offload_with_a_load_in_flight(tiny_checkpoint, prompt)

    o.step(finished_recving={"r1"}, invalid_block_ids={o.block_ids("r1")[0]})
    assert hashes[0] not in o.inner.host  # the bad block's tier entry is gone
    step = o.step()
    # nothing of r1 is valid: vLLM frees its blocks and admits it again; the tier offers no hit now
    assert o.matches["r1"] == [(32, True), (0, False)]
    assert step.num_scheduled_tokens == {"r1": 40}
    assert "r1" in step.finished
    o.step(finished_sending={"r1"})
    assert o.num_used_blocks == 0 and leftovers(o) == {}
    o.inner.check_integrity()


@pytest.mark.parametrize("how", ["fail_policy", "abort_during_the_step"])
def test_a_request_that_finishes_during_its_offload_load_is_freed_once(tiny_checkpoint, how):
    policy = "fail" if how == "fail_policy" else "recompute"
    o = _offload_with_a_load_in_flight(tiny_checkpoint, prompt_of(10, 40), load_failure_policy=policy)
    # OffloadWorker.get_finished ran before the request finished: the load's end is in finished_recving
    scheduler_output = o.schedule()
    if how == "abort_during_the_step":
        o.abort("r1")  # EngineCore applies aborts that arrived during the forward before update_from_output
        o.run(scheduler_output, finished_recving={"r1"})
    else:  # a failed copy: its blocks and the load's end are reported in one step
        step = o.run(scheduler_output, finished_recving={"r1"}, invalid_block_ids={o.block_ids("r1")[0]})
        assert step.finished["r1"].finish_reason == FinishReason.ERROR
    # the next get_finished sees r1 among the finished requests it had a job for: finished_sending
    o.step(finished_sending={"r1"})
    assert o.num_used_blocks == 0 and "r1" not in o.scheduler.requests and leftovers(o) == {}


# ---------------------------------------------------------------------- 6. request views


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_request_views_hash_every_full_block_as_tokens_are_appended(tiny_checkpoint, seed):
    print(f"seed={seed}")
    rng = random.Random(seed)
    namespace = model_id_of(tiny_checkpoint)
    p = producer(tiny_checkpoint)  # its connector reads the hashes only when the request finishes
    tokens = prompt_of(seed, rng.randint(1, 3 * BLOCK_SIZE))
    max_tokens = 4 * BLOCK_SIZE
    request = p.add_request("r0", tokens, max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True})
    num_checked = 0
    while request.num_output_tokens < max_tokens - 1:  # the view lives while the request runs
        token = rng.randrange(3, 1000)
        p.step(sampled={"r0": token})
        tokens.append(token)
        assert list(request.all_token_ids) == tokens
        if rng.random() < 0.3:  # now and then: several new blocks are hashed at once
            assert p.adapter.views.get("r0").block_hashes == hash_full_blocks(tokens, BLOCK_SIZE, namespace=namespace)
            num_checked += 1
    assert p.adapter.views.get("r0").block_hashes == hash_full_blocks(tokens, BLOCK_SIZE, namespace=namespace)
    assert num_checked and len(tokens) // BLOCK_SIZE >= 4


# ---------------------------------------------------------------------- 7. bounded bookkeeping

NUM_REQUESTS = 500


class Driver:
    """Steps `h` with `worker`'s reports, aborting requests when their turn comes."""

    def __init__(self, h: SchedulerHarness, worker) -> None:
        self.h, self.worker = h, worker
        self.abort_at: dict[str, int] = {}  # req id -> abort after this many steps
        self.abort_when_parked: set[str] = set()  # abort once it waits for remote KV
        self.aborted: dict[str, RequestStatus] = {}  # req id -> its status when aborted (unfinished ones)

    def step(self) -> None:
        h = self.h
        h.step(self.worker)
        due = {r for r, at in self.abort_at.items() if at <= len(h.steps)}
        due |= {r for r in self.abort_when_parked if _status(h, r) == RequestStatus.WAITING_FOR_REMOTE_KVS}
        for req_id in due:
            self.abort_at.pop(req_id, None)
            self.abort_when_parked.discard(req_id)
            status = _status(h, req_id)
            if status is not None and not RequestStatus.is_finished(status):
                self.aborted[req_id] = status
            h.abort(req_id)

    def drain(self, max_steps: int = 300) -> None:
        for _ in range(max_steps):
            if not self.h.scheduler.requests and self.worker.is_idle:
                return
            self.step()
        requests = sorted(self.h.scheduler.requests)[:8]
        raise AssertionError(f"not drained after {max_steps} steps: requests {requests}, adapter {leftovers(self.h)}")

    def finished(self) -> set[str]:
        return {req_id for step in self.h.steps for req_id in step.finished}


def _status(h: SchedulerHarness, req_id: str):
    request = h.scheduler.requests.get(req_id)
    return request.status if request is not None else None


@pytest.mark.parametrize("seed", [0])
def test_p2p_bookkeeping_is_empty_after_every_way_of_finishing(tiny_checkpoint, seed):
    print(f"seed={seed}")
    rng = random.Random(seed)
    fates = rng.choices(
        ["plain", "produce", "produce_abort", "produce_early", "consume", "consume_abort", "consume_fail", "forged"],
        k=NUM_REQUESTS,
    )
    prompts = [prompt_of(rng.randrange(1 << 30), rng.randint(BLOCK_SIZE + 1, 4 * BLOCK_SIZE)) for _ in fates]
    consumed = [i for i, fate in enumerate(fates) if fate.startswith("consume") or fate == "forged"]
    minted = dict(zip(consumed, mint_params(tiny_checkpoint, [prompts[i] for i in consumed])))
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_both", engine_id="both-0", incarnation=INCARNATION)
    run = Driver(h, NixlWorkerModel(rng))
    for i, fate in enumerate(fates):
        req_id = f"r{i}"
        params = {"do_remote_decode": True} if fate.startswith("produce") else minted.get(i)
        if fate == "forged":
            params = dict(params, remote_block_hash="00" * 16)
        h.add_request(req_id, prompts[i], max_tokens=rng.randint(1, 4), kv_transfer_params=params)
        match fate:
            case "produce_abort":
                run.abort_at[req_id] = len(h.steps) + rng.randint(0, 2)
            case "produce_early":  # a send reported while the request (probably) still runs
                run.worker.later(run.worker.num_steps, "finished_sending", req_id, delay=1)
            case "consume_abort":
                run.abort_when_parked.add(req_id)
            case "consume_fail":
                run.worker.failing.add(req_id)
        if rng.random() < 0.05:
            kind = rng.choice(["finished_sending", "finished_recving"])
            run.worker.later(run.worker.num_steps, kind, f"made-up-{i}")
        if rng.random() < 0.4:  # a few arrivals per step
            run.step()
    run.drain()

    assert run.finished() | run.aborted.keys() == {f"r{i}" for i in range(NUM_REQUESTS)}
    assert {RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING} <= set(run.aborted.values())
    assert any(delay for answers in h.finishes.values() for delay, _ in answers)
    assert h.num_used_blocks == 0
    assert leftovers(h) == {}
    nixl = h.inner
    assert not (nixl._local_hits or nixl._handled or nixl._refused or nixl._new_recvs or nixl._new_leases or nixl._leased)


@pytest.mark.parametrize("seed", [0])
def test_offload_bookkeeping_is_empty_after_every_way_of_finishing(tiny_checkpoint, seed):
    print(f"seed={seed}")
    rng = random.Random(seed)
    # vLLM's pool is smaller than the host tier: prompts fall out of vLLM's cache and are loaded back
    h = SchedulerHarness.build(
        tiny_checkpoint, role="kv_both", connector="OffloadingConnector", options={"host_num_blocks": 512},
        num_blocks=48, max_num_seqs=8,
    )  # fmt: skip
    run = Driver(h, OffloadWorkerModel(rng))
    prompts: list[list[int]] = []
    for i in range(NUM_REQUESTS):
        is_repeat = prompts and rng.random() < 0.6
        prompts.append(rng.choice(prompts) if is_repeat else prompt_of(rng.randrange(1 << 30), rng.randint(17, 64)))
        req_id = f"r{i}"
        h.add_request(req_id, prompts[-1], max_tokens=rng.randint(1, 3))
        if rng.random() < 0.1:
            run.worker.failing.add(req_id)
        if rng.random() < 0.1:
            run.abort_at[req_id] = len(h.steps) + rng.randint(0, 2)  # waiting, running or finished by then
        if rng.random() < 0.1:
            run.abort_when_parked.add(req_id)  # if it loads from the tier
        run.step()
    run.drain()

    assert {RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING} <= set(run.aborted.values())
    assert h.num_used_blocks == 0
    assert leftovers(h) == {}
    assert not h.inner._reqs and not h.inner._matches and not h.inner._lookups
    h.inner.check_integrity()
