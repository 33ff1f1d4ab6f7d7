"""Admin endpoints: the bearer token, and reset_prefix_cache waiting without stalling the engine.

Over a fake engine (fast, in-process) for the HTTP contract; over a real prefill node with a lease
nobody reads for the engine-level promise (the other requests keep being served while the reset
waits, and it returns when the lease expires, not at its timeout).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import tempfile
import threading
import urllib.error
import urllib.request

import pytest
from aiohttp.test_utils import TestClient, TestServer
from serve_fakes import FakeEngineCore

from kvbridge.transfer import nixl_build
from kvbridge import env
from kvbridge.cli import main as cli_main
from kvbridge.errors import ConfigError
from kvbridge.serve.admin import is_loopback, open_admin_warning, read_admin_token
from kvbridge.serve.api import create_app
from kvbridge.serve.async_engine import AsyncEngine
from kvbridge.serve.launcher import start_node, wait_healthy

TOKEN = "s3cret-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _serve(scenario, admin_token: str | None = None, fake: FakeEngineCore | None = None):
    """Run `scenario(client, fake)` against a node app over a fake engine."""
    fake = fake or FakeEngineCore()
    engine = AsyncEngine(lambda: fake)
    engine.start()

    async def main():
        await engine.wait_ready(10)
        app = create_app(engine, "tiny", "both", admin_token=admin_token)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            return await scenario(client, fake)

    try:
        return asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ the token


@pytest.mark.parametrize("path", ["/v1/kvbridge/state", "/v1/kvbridge/reset_prefix_cache"])
def test_admin_endpoints_need_the_token_when_one_is_set(path):
    async def scenario(client, fake):
        method = client.get if path.endswith("state") else client.post
        answers = {}
        for name, headers in {
            "none": {},
            "wrong": {"Authorization": "Bearer not-the-token"},
            "prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
            "scheme": {"Authorization": f"Basic {TOKEN}"},
            "right": ADMIN,
            "case": {"Authorization": f"bearer {TOKEN}"},
        }.items():
            resp = await method(path, headers=headers)
            answers[name] = (resp.status, await resp.json(), resp.headers.get("WWW-Authenticate"))
        health = await client.get("/health")
        completion = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        return answers, health.status, completion.status

    answers, health, completion = _serve(scenario, admin_token=TOKEN)
    for name in ("none", "wrong", "prefix", "scheme"):
        status, body, challenge = answers[name]
        assert status == 401 and challenge == "Bearer", name
        assert body["error"]["type"] == "authentication_error" and "Authorization: Bearer" in body["error"]["message"]
        assert TOKEN not in json.dumps(body)
    assert answers["right"][0] == 200 and answers["case"][0] == 200
    assert health == 200 and completion == 200  # only the admin endpoints are guarded


def test_admin_endpoints_are_open_without_a_token():
    async def scenario(client, fake):
        state = await client.get("/v1/kvbridge/state")
        reset = await client.post("/v1/kvbridge/reset_prefix_cache")
        return state.status, reset.status, await reset.json()

    assert _serve(scenario) == (200, 200, {"reset": True})


def test_the_token_comes_from_the_file_then_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert read_admin_token(str(token_file), "from-env") == TOKEN
    assert read_admin_token(None, "from-env") == "from-env"
    monkeypatch.setenv("KVBRIDGE_ADMIN_TOKEN", " from-env\n")
    assert env.admin_token() == "from-env"
    monkeypatch.setenv("KVBRIDGE_ADMIN_TOKEN", "")
    assert env.admin_token() is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_admin_token(str(tmp_path / "empty"), None)
    with pytest.raises(ConfigError, match="cannot read"):
        read_admin_token(str(tmp_path / "missing"), None)


def test_serve_refuses_an_unreadable_token_file(tmp_path, capsys):
    assert cli_main(["serve", "--admin-token-file", str(tmp_path / "missing")]) == 2
    assert "--admin-token-file" in capsys.readouterr().err


def test_an_open_admin_api_beyond_loopback_is_warned_about():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com"))
    assert open_admin_warning("127.0.0.1", 8000, None) is None
    assert open_admin_warning("0.0.0.0", 8000, TOKEN) is None
    warning = open_admin_warning("0.0.0.0", 8000, None)
    assert "0.0.0.0:8000" in warning and "--admin-token-file" in warning


# ------------------------------------------------------------------ reset_prefix_cache over the fake


def test_reset_waits_for_the_transfers_in_flight_when_asked_and_serves_meanwhile():
    async def scenario(client, fake):
        fake.transfers_in_flight = {"held-a"}
        reset = asyncio.ensure_future(client.post("/v1/kvbridge/reset_prefix_cache?timeout_s=30"))
        for _ in range(3):  # the engine keeps serving while the reset waits
            resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            assert resp.status == 200 and (await resp.json())["choices"][0]["token_ids"] == [98, 99, 100]
        await asyncio.sleep(0.1)
        assert not reset.done() and fake.num_resets == 0
        fake.transfers_in_flight = {"started-later"}  # held-a ended; a newer transfer does not delay it
        resp = await asyncio.wait_for(reset, 20)
        return resp.status, await resp.json(), fake.num_resets

    assert _serve(scenario) == (200, {"reset": True}, 1)


def test_a_reset_that_times_out_is_a_json_error_naming_what_is_in_flight():
    async def scenario(client, fake):
        fake.transfers_in_flight = {f"req-{i:02d}" for i in range(25)}
        resp = await client.post("/v1/kvbridge/reset_prefix_cache?timeout_s=0.2")
        return resp.status, await resp.json(), fake.num_resets

    status, body, num_resets = _serve(scenario)
    assert status == 409 and num_resets == 0
    error = body["error"]
    assert error["type"] == "transfers_in_flight" and error["code"] == 409
    assert "25 request(s)" in error["message"] and "req-00" in error["message"] and "5 more" in error["message"]


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "301", ""])
def test_a_bad_reset_timeout_is_a_400_naming_it(value):
    async def scenario(client, fake):
        resp = await client.post(f"/v1/kvbridge/reset_prefix_cache?timeout_s={value}")
        return resp.status, await resp.json(), fake.num_resets

    status, body, num_resets = _serve(scenario)
    assert status == 400 and body["error"]["param"] == "timeout_s" and num_resets == 0


# ------------------------------------------------------------------ a real prefill node


def _admin_request(url: str, method: str = "GET", headers: dict | None = None, timeout_s: float = 120.0):
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


LEASE_S = 8.0  # long next to a few tiny-model completions (well under a second each); the test waits for it once


@pytest.mark.nixl
@pytest.mark.skipif(not nixl_build.is_available(), reason="needs NIXL")
def test_reset_with_an_unread_lease_keeps_the_node_serving_and_returns_when_the_lease_expires(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    extra = ["--num-threads", "1", "--num-blocks", "64", "--max-model-len", "256",
             "--kv-connector-extra", json.dumps({"lease_s": LEASE_S}), "--admin-token-file", str(token_file)]  # fmt: skip
    with tempfile.TemporaryDirectory() as log_dir:
        node = start_node("prefill", "prefill", log_dir, extra_args=extra)
        try:
            wait_healthy([node], timeout_s=120)
            prompt = {"prompt": "A lease that nobody will read. " * 3, "max_tokens": 1, "temperature": 0}
            status, held = _post(f"{node.url}/v1/completions", {**prompt, "kv_transfer_params": {"do_remote_decode": True}})
            assert status == 200 and held["kv_transfer_params"]["remote_block_ids"], held
            state = f"{node.url}/v1/kvbridge/state"
            assert _admin_request(state)[0] == 401
            assert _admin_request(state, headers=ADMIN)[1]["stats"]["num_used_blocks"] > 0

            reset_url = f"{node.url}/v1/kvbridge/reset_prefix_cache"
            status, body = _admin_request(f"{reset_url}?timeout_s=0.5", "POST", ADMIN)
            assert status == 409 and held["kv_transfer_params"]["remote_request_id"] in body["error"]["message"], body

            answer: dict = {}
            waiter = threading.Thread(
                target=lambda: answer.update(zip(("status", "body"), _admin_request(f"{reset_url}?timeout_s=120", "POST", ADMIN)))
            )
            waiter.start()
            for i in range(3):  # served while the reset waits: the engine thread is not held
                status, out = _post(f"{node.url}/v1/completions", {"prompt": f"meanwhile {i}", "max_tokens": 4, "temperature": 0})
                assert status == 200 and len(out["choices"][0]["token_ids"]) == 4
            assert waiter.is_alive(), f"the reset returned {answer} while the lease of {LEASE_S} s was held"
            waiter.join(timeout=LEASE_S + 60)  # a hang detector; the reset ends with the lease
            assert not waiter.is_alive() and answer == {"status": 200, "body": {"reset": True}}, answer
            stats = _admin_request(state, headers=ADMIN)[1]["stats"]
            assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] == 0, stats
        finally:
            node.stop()
