"""`reset_prefix_cache` on a prefill node that holds a lease nobody will read.

The reset waits for the lease (it expires after `lease_s`), but other requests keep being served
meanwhile, and the reset answers JSON: success once the lease is gone, or a JSON error. Never an
empty body, never an engine stalled for the whole flush timeout.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from chaos_harness import NodeSet, assert_clean, assert_correct, complete, prefill, prompt, references

from kvbridge.serve.launcher import http_json

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

LEASE_S = 3.0
OTHER_REQUEST_TIMEOUT_S = 10.0  # far above a served request, far below the 30 s flush timeout
RESET_TIMEOUT_S = 90.0
ORPHAN, OTHER = prompt("reset-orphan-lease", 120), prompt("reset-other-request", 100)


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill", ["--kv-connector-extra", json.dumps({"lease_s": LEASE_S})])
        nodes.refs = references([OTHER])
        nodes.wait()
        yield nodes


def test_reset_with_an_unread_lease_neither_stalls_the_engine_nor_answers_empty(cluster):
    p = cluster.url("prefill")
    prefill(p, ORPHAN)  # nobody reads these params: the lease runs out after LEASE_S
    answer: dict[str, object] = {}

    def reset() -> None:
        try:
            answer["reset"] = http_json(f"{p}/v1/kvbridge/reset_prefix_cache", {}, timeout_s=RESET_TIMEOUT_S)
        except OSError as e:
            answer["reset"] = e

    thread = threading.Thread(target=reset, name="chaos-reset")
    thread.start()
    time.sleep(0.5)  # the reset is now waiting for the lease
    status, body = complete(p, OTHER, timeout_s=OTHER_REQUEST_TIMEOUT_S)
    assert_correct(status, body, cluster.refs[OTHER], allow_error=False)
    thread.join(RESET_TIMEOUT_S + 10)

    result = answer["reset"]
    print("reset_prefix_cache answered:", result)
    assert not isinstance(result, OSError), f"reset_prefix_cache gave no answer: {result!r}"
    status, body = result
    assert isinstance(body, dict), f"reset_prefix_cache answered {status} with a body that is not JSON: {body!r}"
    if status == 200:
        assert body == {"reset": True}, body
    else:
        assert status >= 400 and body["error"]["message"], body
    assert_clean(p)
