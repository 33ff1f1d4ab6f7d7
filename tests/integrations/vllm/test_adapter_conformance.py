"""The conformance kit's rules (kvbridge.testing, docs/connector-api.md "The conformance kit") where
they apply to vLLM's V1 connector shape: `KVBridgeConnector` inside vLLM's real `Scheduler` (0.32, CPU).

* `plain-metadata`: every step's `KVBridgeMetadata` survives the pickling vLLM's executors do between
  the scheduler and its workers, and the kvbridge plan inside it the kit's own round trip
  (`kvbridge.testing.metadata_trip`), for the OffloadingConnector (loads, stores, a preemption) and the
  NixlConnector (a prefill's leases, a decode's reads);
* `config-refused-at-construction`: an option the kvbridge connector does not know is a ConfigError
  naming it when vLLM builds `KVBridgeConnector`, not later.

The other rules are checked in vLLM's shape where the adapter keeps them: a preempted request's stores
finished before its blocks are reused (test_scheduler_contract.py), a reset that waits for stores
(test_adapter_lifecycle.py), held blocks freed once per finished_sending (test_scheduler_side.py),
create -> generate -> shutdown cycles (test_adapter_lifecycle.py), a failed load recomputed
(test_adapter_load_failures.py).

    .venv-vllm/bin/python -m pytest -q tests/integrations/vllm/test_adapter_conformance.py
"""

from __future__ import annotations

import pickle
import random
import threading

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from sched_harness import NixlWorkerModel, OffloadWorkerModel, SchedulerHarness  # noqa: E402
from test_scheduler_side import Driver, consumer, mint_params, producer, prompt_of  # noqa: E402

from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.testing.metadata_trip import round_trip  # noqa: E402
from kvbridge.testing.rules import Rule, failure_message  # noqa: E402

pytestmark = pytest.mark.vllm


def metadata_findings(h: SchedulerHarness) -> tuple[list[str], int]:
    """What broke `plain-metadata` in the steps `h` ran, and how many steps planned something."""
    connector = h.adapter.inner  # the kvbridge connector: its codec, or msgspec's
    findings, num_planned = [], 0
    for i, step in enumerate(h.steps):
        meta = step.scheduler_output.kv_connector_metadata
        if meta is None:
            continue
        try:
            if pickle.loads(pickle.dumps(meta)) != meta:
                findings.append(f"step {i}: KVBridgeMetadata unpickled differs from what was pickled")
        except Exception as exc:  # noqa: BLE001 - what vLLM's executor would raise is the finding
            findings.append(f"step {i}: KVBridgeMetadata cannot be pickled for vLLM's workers: {exc}")
        if meta.inner is None:
            continue
        num_planned += any(getattr(meta.inner, name, None) for name in ("loads", "stores", "recvs", "leases"))
        if (finding := round_trip(meta.inner, connector, connector).finding) is not None:
            findings.append(f"step {i}: {finding}")
    return findings, num_planned


def _check(rule: Rule, findings: list[str]) -> None:
    assert not findings, failure_message(rule, findings)


def test_the_metadata_check_fails_a_plan_that_holds_a_lock(tiny_checkpoint, monkeypatch):
    """The check can fail: a kvbridge plan with a lock in it (planted) is found."""
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_both", connector="OffloadingConnector",
                               options={"host_num_blocks": 64})  # fmt: skip
    build = h.inner.build_connector_meta

    def with_a_lock(scheduler_output):
        meta = build(scheduler_output)
        meta.lock = threading.Lock()
        return meta

    monkeypatch.setattr(h.inner, "build_connector_meta", with_a_lock)
    h.add_request("r0", prompt_of(80, 40))
    h.step()
    findings, _ = metadata_findings(h)
    assert findings and "cannot be pickled" in findings[0], findings


def test_offload_metadata_is_plain_data_through_loads_stores_and_a_preemption(tiny_checkpoint):
    # 7 usable blocks, two requests that each grow to 6: vLLM preempts one while its stores are in flight
    h = SchedulerHarness.build(tiny_checkpoint, role="kv_both", connector="OffloadingConnector",
                               options={"host_num_blocks": 64}, num_blocks=8, max_num_seqs=4)  # fmt: skip
    run = Driver(h, OffloadWorkerModel(random.Random(36), max_delay=5))
    for i in range(2):
        h.add_request(f"r{i}", prompt_of(60 + i, 40), max_tokens=50)
    run.drain()
    h.add_request("again", prompt_of(60, 40), max_tokens=2)  # loads what r0 stored
    run.drain()
    findings, num_planned = metadata_findings(h)
    assert any(s.scheduler_output.preempted_req_ids for s in h.steps), "no request was preempted"
    assert any(s.metadata is not None and s.metadata.loads for s in h.steps), "nothing was loaded"
    assert num_planned
    _check(Rule.PLAIN_METADATA, findings)


def test_nixl_metadata_is_plain_data_on_both_sides_of_a_pair(tiny_checkpoint):
    prompts = [prompt_of(70 + i, 40 + 16 * i) for i in range(3)]
    p = producer(tiny_checkpoint)
    for i, prompt in enumerate(prompts):
        p.add_request(f"p{i}", prompt, kv_transfer_params={"do_remote_decode": True})
    Driver(p, NixlWorkerModel(random.Random(36))).drain()
    d = consumer(tiny_checkpoint)
    for i, (prompt, params) in enumerate(zip(prompts, mint_params(tiny_checkpoint, prompts))):
        d.add_request(f"d{i}", prompt, kv_transfer_params=params, max_tokens=2)
    Driver(d, NixlWorkerModel(random.Random(37))).drain()
    for h, what in ((p, "leases"), (d, "recvs")):
        findings, num_planned = metadata_findings(h)
        assert any(s.metadata is not None and getattr(s.metadata, what) for s in h.steps), f"no {what} planned"
        assert num_planned
        _check(Rule.PLAIN_METADATA, findings)


@pytest.mark.parametrize("connector", ["OffloadingConnector", "NixlConnector"])
def test_an_unknown_option_is_a_named_error_when_vllm_builds_the_connector(tiny_checkpoint, connector):
    key = "kvbridge_kit_no_such_option"
    findings = []
    try:
        SchedulerHarness.build(tiny_checkpoint, role="kv_both", connector=connector, options={key: 1})
    except ConfigError as exc:
        if key not in str(exc):
            findings.append(f"the ConfigError does not name the unknown option {key!r}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
        findings.append(f"an unknown option {key!r} raised {type(exc).__name__}, not ConfigError: {exc}")
    else:
        findings.append(f"vLLM built KVBridgeConnector({connector}) with the unknown option {key!r}")
    _check(Rule.CONFIG_REFUSED_AT_CONSTRUCTION, findings)
