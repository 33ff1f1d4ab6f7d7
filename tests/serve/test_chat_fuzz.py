"""Property-based fuzzing of POST /v1/chat/completions against one real node over a chat checkpoint.

Generated bodies put JSON of every shape in `messages` (roles the template refuses, null and list
contents, image parts, extra keys a template may read) and in every other field. Each must be
answered with a 200 or an OpenAI-shaped 4xx: never a 5xx, never a hang. Afterwards the node still
answers a plain chat request. `--hypothesis-seed=N` draws another set than CI's fixed one.
"""

from __future__ import annotations

import collections
import json

from chat_checkpoint import chat_node
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from test_api_fuzz import MAX_CHEAP_TOKENS, Client, fields, junk

from kvbridge.serve.launcher import http_json

MAX_EXAMPLES = 400

roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "robot", ""]), junk)
contents = st.one_of(
    st.text(max_size=16),
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
             max_size=3),
    junk,
)  # fmt: skip
message = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": contents}, optional={"name": junk, "tool_calls": junk}),
    junk,
)
messages = st.one_of(st.lists(message, max_size=5), junk)


def check_chat_answer(status: int, content_type: str, raw: bytes, payload: bytes) -> None:
    """200 (a chat completion, or an SSE stream that ends with [DONE]) or an OpenAI-shaped 4xx JSON error."""
    sent = payload[:300]
    assert status < 500, f"{status} for {sent!r}: {raw[:500]!r}"
    if status >= 400:
        body = json.loads(raw)
        assert body["error"]["code"] == status and body["error"]["message"], (sent, body)
    elif content_type.startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, (sent, raw[-500:])
    else:
        body = json.loads(raw)
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"], (sent, body)


@st.composite
def chat_bodies(draw) -> bytes:
    """Mostly a valid body with a field or two gone wrong (none in a fifth of the draws)."""
    wild = fields(side_channel_port=1)
    del wild["prompt"]
    wild |= {"messages": messages, "add_generation_prompt": junk}
    valid_message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=16)}
    )
    body = {"messages": draw(st.lists(valid_message, min_size=1, max_size=3)),
            "max_tokens": draw(st.integers(1, MAX_CHEAP_TOKENS))}  # fmt: skip
    num_wild = draw(st.sampled_from([0, 1, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from(sorted(wild)), min_size=num_wild, max_size=num_wild, unique=True)):
        body[name] = draw(wild[name])
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_CHEAP_TOKENS  # generation is not what is tested
    return json.dumps(body).encode()


def test_no_chat_body_gets_a_5xx_or_takes_the_node_down(request):
    chosen = request.config.getoption("hypothesis_seed", default=None)
    print(f"hypothesis: {MAX_EXAMPLES} examples, " + (f"seed {chosen}" if chosen else "derandomized (fixed) set"))
    with chat_node() as (url, _):
        client = Client(url)
        statuses: collections.Counter[int] = collections.Counter()

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=chosen is None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(payload=chat_bodies())
        def answers_every_payload(payload: bytes) -> None:
            answer = client.post("/v1/chat/completions", payload)
            statuses[answer[0]] += 1
            check_chat_answer(*answer, payload)

        if chosen is not None:
            answers_every_payload = seed(int(chosen))(answers_every_payload)
        try:
            answers_every_payload()
        finally:
            client.close()
        print(f"answers by status: {dict(sorted(statuses.items()))}")
        assert statuses[200] >= MAX_EXAMPLES // 20, statuses  # some bodies get past the template to the engine
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        status, answer = http_json(f"{url}/v1/chat/completions", body, timeout_s=60)
        assert status == 200 and answer["usage"]["completion_tokens"] <= 2, answer
