"""The node's OpenAI surface over a fake engine: chat, stop strings, include_usage, refusals, JSON 404/405."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from chat_checkpoint import write_chat_checkpoint
from serve_fakes import FakeEngineCore
from test_api import _serve, _sse_events

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = write_chat_checkpoint(tmp_path_factory.mktemp("chat"))
    os.remove(os.path.join(path, "model.safetensors"))  # the fake engine needs the tokenizer files only
    return path


def _post(body: dict, path: str = "/v1/chat/completions", model: str = "tiny", step_delay_s: float = 0.0):
    async def scenario(client, fake, engine):
        resp = await client.post(path, json=body)
        raw = await resp.text()
        for _ in range(200):  # an abort reaches the engine thread after the answer
            if not fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return resp.status, raw, fake

    return _serve(scenario, FakeEngineCore(model=model, step_delay_s=step_delay_s))


def test_chat_completion_renders_the_template(checkpoint):
    status, raw, fake = _post(CHAT, model=checkpoint)
    body = json.loads(raw)
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "tiny"
    choice = body["choices"][0]
    # <s> <|user|> hello world <|assistant|>: the fake engine counts on from the last id (5).
    assert choice["token_ids"] == [6, 7, 8] and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": bytes([6, 7, 8]).decode()}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_chat_stream_names_the_role_first_and_adds_up(checkpoint):
    status, raw, _ = _post({**CHAT, "stream": True}, model=checkpoint)
    chunks = _sse_events(raw)
    assert status == 200 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == bytes([6, 7, 8]).decode()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_without_max_tokens_runs_to_the_context_length(checkpoint):
    status, raw, _ = _post({"messages": CHAT["messages"], "ignore_eos": True}, model=checkpoint)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 64  # the fake's max_model_len


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_sends_a_last_chunk_without_choices(checkpoint, path):
    body = {**CHAT, "prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    status, raw, _ = _post(body, path, model=checkpoint)
    chunks = _sse_events(raw)
    assert status == 200 and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and "kvbridge" in chunks[-1]
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_cuts_the_text_and_aborts_the_request():
    body = {"prompt": "a", "max_tokens": 1000, "stop": ["ef", "de"]}
    status, raw, fake = _post(body, "/v1/completions", step_delay_s=0.002)
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and choice["text"] == "bc" and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [ord(c) for c in "bcde"]  # up to the token that completed "de"
    assert fake.num_aborted == 1 and not fake.has_unfinished_requests()


def test_a_streamed_stop_string_never_reaches_the_client():
    body = {"prompt": "a", "max_tokens": 1000, "stop": "def", "stream": True}
    status, raw, fake = _post(body, "/v1/completions", step_delay_s=0.002)
    chunks = _sse_events(raw)
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == "bc"
    assert [c["choices"][0]["text"] for c in chunks] == ["b", "c", "", "", ""]  # "d", "de" held, then cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and fake.num_aborted == 1


def test_a_chat_stop_string(checkpoint):
    status, raw, _ = _post({**CHAT, "max_tokens": 10, "stop": [bytes([8]).decode()]}, model=checkpoint)
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and choice["message"]["content"] == bytes([6, 7]).decode()
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "logprobs": 1}, "logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**CHAT, "presence_penalty": 3.0}, "presence_penalty"),
        ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"content": "no role"}]}, "messages"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "beep"}]}, "messages"),  # the template's raise_exception
        ({**CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"max_tokens": 3}, "messages"),
    ],
)
def test_chat_refusals_name_the_field(checkpoint, body, param):
    status, raw, _ = _post(body, model=checkpoint)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"] or param == "messages", error


def test_n_choices_are_n_engine_requests_of_the_same_prompt():
    status, raw, fake = _post({"prompt": "a", "max_tokens": 3, "n": 3}, "/v1/completions")
    body = json.loads(raw)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "bcd" and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}  # the prompt once
    assert fake.num_finished == 3


def test_several_prompts_times_n_choices_in_openai_order():
    status, raw, fake = _post({"prompt": ["a", "bb", [ord("x")]], "max_tokens": 2, "n": 2}, "/v1/completions")
    body = json.loads(raw)
    assert status == 200 and [c["text"] for c in body["choices"]] == ["bc", "bc", "cd", "cd", "yz", "yz"]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}  # each prompt once


def test_n_streamed_chat_choices_interleave_by_index(checkpoint):
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    status, raw, _ = _post(body, model=checkpoint)
    chunks = _sse_events(raw)
    assert status == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"]["content"] for c in mine) == bytes([6, 7, 8]).decode()
        assert [c["finish_reason"] for c in mine][-1] == "length" and mine[-1]["token_ids"] == [8]


def test_n_choices_each_stop_at_a_stop_string_and_abort():
    body = {"prompt": "a", "max_tokens": 1000, "stop": "de", "n": 2, "stream": True}
    status, raw, fake = _post(body, "/v1/completions", step_delay_s=0.002)
    chunks = _sse_events(raw)
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    assert status == 200 and texts == {0: "bc", 1: "bc"} and fake.num_aborted == 2
    assert chunks[-1]["usage"]["completion_tokens"] == 8  # "bcde" twice: up to the token that completed "de"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_aborts_every_choice(stream):
    async def scenario(client, fake, engine):
        body = {"prompt": "a", "max_tokens": 100_000, "stream": stream, "n": 2}
        if stream:
            resp = await client.post("/v1/completions", json=body)
            await resp.content.readline()  # the first chunk arrived: the requests run
            resp.close()
        else:
            task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            for _ in range(200):
                if len(fake.requests) == 2:
                    break
                await asyncio.sleep(0.01)
            task.cancel()  # the client gives up and closes the connection
        for _ in range(300):
            if not fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return fake.num_aborted, engine.num_running

    assert _serve(scenario, FakeEngineCore(step_delay_s=0.002)) == (2, 0)


def test_chat_accepts_text_parts_and_the_defaults_clients_send(checkpoint):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    body = {**CHAT, "messages": [{"role": "user", "content": parts}], "presence_penalty": 0, "frequency_penalty": 0,
            "logprobs": False, "tool_choice": "none", "response_format": {"type": "text"}, "n": 1}  # fmt: skip
    status, raw, _ = _post(body, model=checkpoint)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 5, raw


def test_a_model_without_a_chat_template_is_a_400(tmp_path):
    status, raw, _ = _post(CHAT, model=write_chat_checkpoint(tmp_path / "plain", chat_template=None))
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "messages" and "chat template" in error["message"]



@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/v1/chat/completions", 405),
     ("POST", "/health", 405)],
)  # fmt: skip
def test_unknown_routes_and_methods_are_openai_json_errors(method, path, status):
    async def scenario(client, fake, engine):
        resp = await client.request(method, path)
        return resp.status, resp.headers.get("Allow"), await resp.json()

    got, allow, body = _serve(scenario)
    assert got == status and body["error"]["code"] == status and body["error"]["message"]
    assert (allow is not None) == (status == 405)
