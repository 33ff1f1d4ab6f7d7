"""The node server over a real EngineCore (tiny model, no connector), in-process; and its CLI config."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvbridge import LLM, SamplingParams
from kvbridge.config import CacheConfig, EngineConfig, ModelConfig
from kvbridge.errors import ConfigError
from kvbridge.serve import server
from kvbridge.serve.api import create_app
from kvbridge.serve.async_engine import AsyncEngine

PROMPTS = ["Hi", "A medium prompt that spans a few KV blocks of sixteen tokens.", "x" * 200]
MAX_TOKENS = 8


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("both", "kv_both")])
def test_roles_map_to_nixl_connector_roles(role, kv_role):
    config = server.build_engine_config(_args("--role", role, "--side-channel-port", "5601", "--num-blocks", "32"))
    kv = config.kv_transfer
    assert (kv.connector, kv.role, kv.side_channel_port, kv.side_channel_host) == ("NixlConnector", kv_role, 5601, "127.0.0.1")
    assert config.cache.num_blocks == 32


def test_no_connector_and_other_connector_and_extra():
    assert server.build_engine_config(_args("--no-connector")).kv_transfer is None
    config = server.build_engine_config(
        _args("--kv-connector", "pkg.mod:Conn", "--kv-connector-extra", '{"lease_s": 5}', "--engine-id", "e1",
              "--load-failure-policy", "fail")
    )  # fmt: skip
    kv = config.kv_transfer
    assert (kv.connector, kv.extra, kv.engine_id, kv.load_failure_policy) == ("pkg.mod:Conn", {"lease_s": 5}, "e1", "fail")


def test_enforce_eager_reaches_the_model_config():
    assert server.build_engine_config(_args("--enforce-eager")).model.enforce_eager
    assert not server.build_engine_config(_args()).model.enforce_eager


def test_async_scheduling_reaches_the_scheduler_config():
    assert server.build_engine_config(_args("--no-connector", "--async-scheduling")).scheduler.async_scheduling is True
    assert server.build_engine_config(_args("--no-async-scheduling")).scheduler.async_scheduling is False
    assert server.build_engine_config(_args()).scheduler.async_scheduling is None  # on a CUDA device only


@pytest.mark.parametrize("extra", ["{bad", "[1]"])
def test_bad_connector_extra_is_a_config_error(extra):
    with pytest.raises(ConfigError, match="kv-connector-extra"):
        server.build_engine_config(_args("--kv-connector-extra", extra))


def test_run_reports_config_errors_with_exit_code_2(capsys):
    assert server.run(_args("--num-blocks", "1")) == 2
    assert "--num-blocks must be at least 2" in capsys.readouterr().err  # the flag, not the config field


CONFIG = EngineConfig(model=ModelConfig(max_model_len=256), cache=CacheConfig(num_blocks=64))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(max_model_len=256, num_blocks=64) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def test_real_engine_completions_match_llm_and_leave_no_blocks(reference):
    from kvbridge.engine.core import EngineCore

    engine = AsyncEngine(lambda: EngineCore(CONFIG))
    engine.start()

    async def main():
        await engine.wait_ready(60)
        async with TestClient(TestServer(create_app(engine, "tiny"), handler_cancellation=True)) as client:
            async def complete(prompt, stream=False):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
                resp = await client.post("/v1/completions", json=body)
                return resp.status, (await resp.text() if stream else await resp.json())

            results = await asyncio.gather(*(complete(p) for p in PROMPTS))  # batched in the engine
            streamed = await complete(PROMPTS[1], stream=True)
            too_long = await complete("y" * 300)
            state = await (await client.get("/v1/kvbridge/state")).json()
            return results, streamed, too_long, state

    try:
        results, streamed, too_long, state = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
    assert [status for status, _ in results] == [200, 200, 200]
    assert [body["choices"][0]["token_ids"] for _, body in results] == reference
    assert streamed[0] == 200 and streamed[1].rstrip().endswith("data: [DONE]")
    assert too_long[0] == 400 and too_long[1]["error"]["param"] == "prompt" and "256" in too_long[1]["error"]["message"]
    assert state["integrity"] == {"ok": True, "error": None}
    assert state["stats"]["num_used_blocks"] == 0 and state["stats"]["num_free_blocks"] == 64
    assert engine.engine is None  # shut down
