"""The official `openai` client against `kvbridge proxy` in front of a prefill node and a decode node
(NixlConnector) over the tiny chat checkpoint: chat, plain and streamed, goes through the prefill
node then the decode node as completions do; requests with n > 1 and lists of prompts are answered;
log-probabilities come from the decode node. Greedy answers equal those of one in-process engine
over the same checkpoint (what a colocated node answers)."""

from __future__ import annotations

import os
import tempfile

import pytest
from chat_checkpoint import MAX_MODEL_LEN, SERVED_NAME, write_chat_checkpoint

from kvbridge import LLM, SamplingParams
from kvbridge.serve.chat import load_chat_template
from kvbridge.serve.launcher import PDCluster

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.nixl

MAX_TOKENS = 6
NUM_TOP = 2
PROMPT = "hello world how are you " * 5  # 25 tokens: one full KV block moves from prefill to decode
OTHER_PROMPT = "the cat is fine thanks"
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world how are you " * 5}]
# Other conversations for the later tests: the decode node's own prefix cache holds MESSAGES' prompt by
# then, and each test must see the prompt's KV pulled from the prefill node.
STREAMED_MESSAGES = [{"role": "system", "content": "the dog"}, MESSAGES[1]]
LOGPROBS_MESSAGES = [{"role": "system", "content": "a dog"}, MESSAGES[1]]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
NODE_ARGS = ["--served-model-name", SERVED_NAME, "--num-threads", "1", "--num-blocks", "64",
             "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip


class Expected:
    """Greedy answers of one in-process engine over the checkpoint, with logprobs."""

    def __init__(self, checkpoint: str) -> None:
        template = load_chat_template(checkpoint)
        chats = [{"prompt_token_ids": template.encode(template.render(m, add_generation_prompt=True))}
                 for m in (MESSAGES, STREAMED_MESSAGES, LOGPROBS_MESSAGES)]  # fmt: skip
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
        with LLM(model=checkpoint, max_model_len=MAX_MODEL_LEN) as llm:
            prompt, other, chat, streamed, logprobs = llm.generate([PROMPT, OTHER_PROMPT, *chats], params)
        self.text, self.other_text = prompt.outputs[0].text, other.outputs[0].text
        self.chat, self.streamed_chat = chat.outputs[0].text, streamed.outputs[0].text
        self.chat_logprobs = [e.logprob for e in logprobs.outputs[0].logprobs]


@pytest.fixture(scope="module")
def proxy():
    """(openai client of the proxy, the expected answers)."""
    with tempfile.TemporaryDirectory(prefix="kvbridge-proxy-openai-") as tmp:
        checkpoint = write_chat_checkpoint(os.path.join(tmp, "model"))
        cluster = PDCluster(checkpoint, node_args=NODE_ARGS, startup_timeout_s=120, log_dir=tmp).start()
        try:
            expected = Expected(checkpoint)  # while the nodes boot
            cluster.wait()
            client = openai.OpenAI(base_url=f"{cluster.proxy_url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield client, expected
        finally:
            cluster.stop()


def _proxy_stats(answer) -> dict:
    return answer.model_extra["kvbridge"]


def test_chat_goes_through_prefill_then_decode(proxy):
    client, expected = proxy
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == expected.chat
    stats = _proxy_stats(chat)
    assert stats["proxy"]["prefill_url"] is not None and not stats["proxy"]["recomputed"]
    assert stats["num_external_tokens"] >= 16  # the prompt's full block came from the prefill node


def test_streamed_chat_goes_through_prefill_then_decode(proxy):
    client, expected = proxy
    stream = client.chat.completions.create(model=SERVED_NAME, messages=STREAMED_MESSAGES, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.streamed_chat
    assert chunks[-1].model_extra["kvbridge"]["num_external_tokens"] >= 16


def test_chat_logprobs_come_from_the_decode_node(proxy):
    client, expected = proxy
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=LOGPROBS_MESSAGES, logprobs=True, top_logprobs=NUM_TOP, **GREEDY
    )
    assert _proxy_stats(chat)["num_external_tokens"] >= 16  # the decode node computed from pulled KV
    content = chat.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(expected.chat_logprobs, abs=1e-4)
    assert all(len(e.top_logprobs) == NUM_TOP for e in content)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(proxy, stream):
    client, expected = proxy
    answer = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=2, stream=stream, **GREEDY)
    chunks = list(answer) if stream else [answer]
    texts = ["".join(choice.text for c in chunks for choice in c.choices if choice.index == i) for i in range(2)]
    assert texts == [expected.text, expected.text]


def test_n_chat_choices(proxy):
    client, expected = proxy
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, n=2, **GREEDY)
    assert [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)] == [expected.chat] * 2


def test_a_list_of_prompts(proxy):
    client, expected = proxy
    completion = client.completions.create(model=SERVED_NAME, prompt=[PROMPT, OTHER_PROMPT], **GREEDY)
    texts = [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
    assert texts == [expected.text, expected.other_text]
    assert completion.usage.completion_tokens == 2 * MAX_TOKENS
    assert not _proxy_stats(completion)["proxy"]["disaggregated"]  # the decode node computed both prompts
