"""The /v1/completions body parser and response builders (pure)."""

from __future__ import annotations

import pytest

from kvbridge.engine.outputs import CompletionOutput, RequestOutput
from kvbridge.errors import InvalidRequestError
from kvbridge.serve import protocol


def test_defaults_and_text_prompt():
    req = protocol.parse_completion_request({"prompt": "hi"})
    assert req.prompt_text == "hi" and req.prompt_token_ids is None
    fields = req.fields
    assert fields.sampling_params.max_tokens == protocol.DEFAULT_MAX_TOKENS
    assert fields.sampling_params.temperature == 1.0
    assert not fields.stream and fields.kv_transfer_params is None and fields.model is None
    assert fields.stop == () and not fields.include_usage


@pytest.mark.parametrize(
    "prompt, text, ids",
    [(["hi"], "hi", None), ([1, 2, 3], None, [1, 2, 3]), ([[4, 5]], None, [4, 5])],
)
def test_prompt_forms(prompt, text, ids):
    req = protocol.parse_completion_request({"prompt": prompt})
    assert (req.prompt_text, req.prompt_token_ids) == (text, ids) and len(req.prompts) == 1


def test_several_prompts():
    req = protocol.parse_completion_request({"prompt": ["hi", [4, 5], "ho"], "n": 5})
    assert req.prompts == [protocol.Prompt("hi", None), protocol.Prompt(None, [4, 5]), protocol.Prompt("ho", None)]
    assert req.prompt_text == "hi"  # the first: what the proxy routes by


def test_all_fields():
    req = protocol.parse_completion_request(
        {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 7,
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "stream": True,
            "n": 3,
            "stream_options": {"include_usage": True},
            "stop": ["\n", "END"],
            "user": "ignored-openai-field",
            "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_tokens": 2,
            # what clients send by default: asks for nothing, accepted
            "logprobs": None, "best_of": 1, "logit_bias": {}, "echo": False,
        }
    )  # fmt: skip
    fields = req.fields
    assert fields.n == 3
    p = fields.sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (5, 0.0, 0.5, 0, 7)
    assert p.stop_token_ids == (2, 3) and p.ignore_eos and p.is_greedy
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -1.0, 1.2, 2)
    assert fields.stream and fields.kv_transfer_params is None and fields.model == "tiny"
    assert fields.stop == ("\n", "END") and fields.include_usage


def test_a_stop_string_may_be_a_bare_string():
    assert protocol.parse_completion_request({"prompt": "a", "stop": "###"}).fields.stop == ("###",)


@pytest.mark.parametrize(
    "body, param",
    [
        ([1, 2], None),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", [1, -2]]}, "prompt"),
        ({"prompt": ["a"] * 17}, "prompt"),
        ({"prompt": ["a", "b"], "n": 9}, "n"),  # 18 choices
        ({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "stop_token_ids": [1, "x"]}, "stop_token_ids"),
        ({"prompt": "a", "kv_transfer_params": [1]}, "kv_transfer_params"),
        ({"prompt": "a", "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}}, "kv_transfer_params"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "stop": ["a", 1]}, "stop"),
        ({"prompt": "a", "stop": ["x"] * 17}, "stop"),
        ({"prompt": "a", "stop": ["x" * 1001]}, "stop"),
        ({"prompt": "a", "stop": {"s": 1}}, "stop"),
        ({"prompt": "a", "stream_options": []}, "stream_options"),
        ({"prompt": "a", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "logprobs": True}, "logprobs"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "presence_penalty": "high"}, "presence_penalty"),
        ({"prompt": "a", "min_tokens": 1.5}, "min_tokens"),
        ({"prompt": "a", "logit_bias": {"5": 100}}, "logit_bias"),
    ],
)
def test_bad_fields_name_the_param(body, param):
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_completion_request(body)
    assert info.value.param == param
    if param:
        assert param in str(info.value)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 10**400}, "top_p"),  # an int past float range: not an OverflowError
        ({"prompt": "a", "temperature": 1e-300}, "temperature"),
        ({"prompt": "a", "temperature": 10**400}, "temperature"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),  # json.loads accepts NaN
        ({"prompt": "a", "top_k": -2}, "top_k"),
        ({"prompt": "a", "seed": 2**64}, "seed"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"prompt": "a", "stop_token_ids": [1] * 4_000_000}, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": [1, 2**63]}, "prompt"),
        ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "a", "frequency_penalty": -10**400}, "frequency_penalty"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "a", "repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "a", "min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
    ],
)
def test_out_of_range_values_are_invalid_requests_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_completion_request(body)
    assert info.value.param == param and param in str(info.value)
    assert len(str(info.value)) < 500  # a client's 4M-entry list is not quoted back in full


def test_largest_values_in_range_are_accepted():
    body = {"prompt": [0, 2**63 - 1], "temperature": 100, "seed": 2**64 - 1, "stop_token_ids": [0] * 1024, "n": None}
    params = protocol.parse_completion_request(body).fields.sampling_params
    assert params.seed == 2**64 - 1 and len(params.stop_token_ids) == 1024


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b'{"prompt": "\xff"}', "not valid JSON"),  # not UTF-8
        (b'{"prompt": "a", "seed": ' + b"7" * 10_000 + b"}", "not valid JSON"),  # Python's int digit limit
        (b"[" * 100_000 + b"]" * 100_000, "levels deep"),  # RecursionError in json.loads
        (b"[" * 40 + b"]" * 40, "levels deep"),  # parses, but deeper than MAX_JSON_DEPTH
        (b'{"prompt": "a", "kv_transfer_params": ' + b'{"x": ' * 40 + b"1" + b"}" * 40 + b"}", "levels deep"),
    ],
)
def test_bodies_that_are_not_acceptable_json_are_invalid_requests(raw, words):
    with pytest.raises(InvalidRequestError, match=words):
        protocol.decode_body(raw)


def test_json_within_the_depth_limit_decodes():
    nested = b'{"prompt": "a", "kv_transfer_params": ' + b'{"x": ' * 20 + b"1" + b"}" * 20 + b"}"
    assert protocol.decode_body(nested)["prompt"] == "a"
    assert protocol.decode_body('{"prompt": "é"}'.encode("utf-16")) == {"prompt": "é"}


def _output(**kw) -> RequestOutput:
    base = dict(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, [7, 8], "ab", "length")],
        finished=True,
        kv_transfer_params={"remote_block_ids": [1]},
        num_cached_tokens=2,
        num_external_tokens=1,
    )
    return RequestOutput(**{**base, **kw})


def test_completion_response_shape():
    out = _output()
    choice = protocol.Choice(0, "ab", [7, 8], "length")
    stats = protocol.kvbridge_stats(out, {"e2e_s": 0.5})
    usage = protocol.usage(3, 2)
    body = protocol.completion_response("cmpl-1", 123, "tiny", [choice], usage, out.kv_transfer_params, stats)
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "ab", "token_ids": [7, 8], "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert body["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert body["kvbridge"]["num_cached_tokens"] == 2 and body["kvbridge"]["num_external_tokens"] == 1
    assert body["kvbridge"]["e2e_s"] == 0.5


def test_error_body_is_openai_shaped():
    assert protocol.error_body("bad", param="prompt") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "prompt", "code": 400}
    }


def test_usage_chunk_has_no_choices():
    chunk = protocol.usage_chunk("cmpl-1", 123, "tiny", "text_completion", protocol.usage(3, 2))
    assert chunk["choices"] == [] and chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_external_kv_bytes_counts_whole_blocks():
    assert protocol.external_kv_bytes(0, 16, 100) == 0
    assert protocol.external_kv_bytes(16, 16, 100) == 100
    assert protocol.external_kv_bytes(17, 16, 100) == 200
