"""The official `openai` client against a real `kvbridge serve` process over a tiny chat checkpoint:
completions and chat, plain and streamed, the models list, stop strings and errors. Answers are
checked against an in-process `LLM` over the same checkpoint (greedy)."""

from __future__ import annotations

import pytest
from chat_checkpoint import MAX_MODEL_LEN, SERVED_NAME, chat_node

from kvbridge import LLM, SamplingParams
from kvbridge.serve.chat import load_chat_template

openai = pytest.importorskip("openai")

MODEL = SERVED_NAME
MAX_TOKENS = 8
PROMPT = "hello world how are you"
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}]
NUM_TOP = 3
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


class Node:
    """An openai client of the node, and the reference answers."""

    def __init__(self, url: str, checkpoint: str) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        template = load_chat_template(checkpoint)
        chat_ids = template.encode(template.render(MESSAGES, add_generation_prompt=True))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
        with LLM(model=checkpoint, max_model_len=MAX_MODEL_LEN) as llm:  # the reference
            prompt_out, chat_out = llm.generate([PROMPT, {"prompt_token_ids": chat_ids}], params)
        self.expected_text = prompt_out.outputs[0].text
        self.expected_chat = chat_out.outputs[0].text
        self.expected_logprobs = prompt_out.outputs[0].logprobs
        self.expected_chat_logprobs = chat_out.outputs[0].logprobs


@pytest.fixture(scope="module")
def node():
    references = []
    with chat_node(lambda url, path: references.append(Node(url, path))):  # computed while the node boots
        yield references[0]


def test_models_list(node):
    assert [m.id for m in node.client.models.list()] == [MODEL]


def test_completion(node):
    completion = node.client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert completion.choices[0].text == node.expected_text and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_a_list_of_prompts(node):
    completion = node.client.completions.create(model=MODEL, prompt=[PROMPT, "the cat", PROMPT], **GREEDY)
    texts = [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
    assert texts[0] == texts[2] == node.expected_text and len(texts) == 3
    assert completion.usage.completion_tokens == 3 * MAX_TOKENS


def test_streamed_completion_with_usage(node):
    stream = node.client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == node.expected_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat(node):
    chat = node.client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == node.expected_chat
    assert chat.usage.completion_tokens == MAX_TOKENS


def test_streamed_chat_with_usage(node):
    stream = node.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == node.expected_chat
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_n_seeded_choices_differ_and_repeat(node):
    def ask():
        chat = node.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, seed=7, temperature=1.0, max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) == 3, first  # each choice draws from its own seed (seed + index)
    assert ask() == first


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(node, stream):
    words = node.expected_text.split()
    if len(words) < 2:
        pytest.skip(f"the random model's greedy text {node.expected_text!r} has fewer than two words")
    stop = " " + words[1]
    cut = node.expected_text[: node.expected_text.index(stop)]
    answer = node.client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], stream=stream, **GREEDY)
    chunks = list(answer) if stream else [answer]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors(node):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        node.client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        node.client.completions.create(model=MODEL, prompt=PROMPT, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="'n'"):
        node.client.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
    with pytest.raises(openai.BadRequestError, match="tokens") as info:  # the engine's limit, about the messages
        node.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 200}])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError, match="not served"):
        node.client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        node.client.embeddings.create(model=MODEL, input="x")  # a route the node does not have


def _assert_logprobs(expected, tokens, logprobs, tops, text):
    """Against the in-process engine's TokenLogprobs: values, greedy's max, texts that join into the answer."""
    assert logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
    for entry, top in zip(expected, tops):
        assert sorted(top.values(), reverse=True) == pytest.approx([lp for _, lp in entry.top], abs=1e-4)
        assert entry.logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy took the most likely
    assert "".join(tokens) == text


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(node, stream):
    answer = node.client.completions.create(model=MODEL, prompt=PROMPT, logprobs=NUM_TOP, stream=stream, **GREEDY)
    parts = [c.choices[0].logprobs for c in answer if c.choices] if stream else [answer.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    tops = [t for p in parts for t in p.top_logprobs]
    _assert_logprobs(node.expected_logprobs, tokens, [lp for p in parts for lp in p.token_logprobs], tops,
                     node.expected_text)  # fmt: skip
    offsets = [o for p in parts for o in p.text_offset]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(node, stream):
    answer = node.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=NUM_TOP, stream=stream, **GREEDY
    )
    chunks = [c for c in answer if c.choices and c.choices[0].logprobs] if stream else [answer]
    content = [entry for c in chunks for entry in c.choices[0].logprobs.content]
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    tops = [{alt.token: alt.logprob for alt in e.top_logprobs} for e in content]
    _assert_logprobs(node.expected_chat_logprobs, [e.token for e in content], [e.logprob for e in content], tops,
                     node.expected_chat)  # fmt: skip


def test_no_logprobs_unless_asked(node):
    completion = node.client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    chat = node.client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=False, **GREEDY)
    assert completion.choices[0].logprobs is None and chat.choices[0].logprobs is None
