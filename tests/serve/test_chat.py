"""Chat templates read from a checkpoint and rendered as transformers renders them (serve/chat.py)."""

from __future__ import annotations

import json
import os

import pytest
from chat_checkpoint import BOS_ID, write_chat_checkpoint

from kvbridge.engine.presets import BYTE_VOCAB_BOS
from kvbridge.serve.chat import ChatTemplateError, load_chat_template

MESSAGES = [
    {"role": "system", "content": "the cat"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "how are you"},
]


def _tokenizer_only(path, **config) -> str:
    """A checkpoint directory with the tokenizer files only (what chat templates need)."""
    write_chat_checkpoint(path)
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config.update(config)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in tokenizer_config.items() if v is not None}, f)
    return str(path)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_prompt_ids_equal_transformers_apply_chat_template(tmp_path, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    path = _tokenizer_only(tmp_path)
    template = load_chat_template(path)
    ids = template.encode(template.render(MESSAGES, add_generation_prompt))
    reference = transformers.AutoTokenizer.from_pretrained(path)
    expected = reference.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert ids.count(BOS_ID) == 1  # the template writes BOS; encoding adds none


def test_special_tokens_reach_the_template(tmp_path):
    path = _tokenizer_only(tmp_path, chat_template="{{ bos_token }}|{{ eos_token }}|{{ unk_token }}")
    assert load_chat_template(path).render(MESSAGES) == "<s>|</s>|<unk>"  # eos_token is an AddedToken dict


def test_transformers_conventions(tmp_path):
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    path = _tokenizer_only(tmp_path, chat_template=source)
    rendered = load_chat_template(path).render([{"role": "user", "content": "caf\u00e9 <b>"}, *MESSAGES])
    assert rendered == '{"role": "user", "content": "caf\u00e9 <b>"}4'  # loopcontrols; tojson keeps é and <b>


def test_named_templates_use_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert load_chat_template(_tokenizer_only(tmp_path, chat_template=named)).render(MESSAGES) == "plain"


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    path = _tokenizer_only(tmp_path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("from the file")
    assert load_chat_template(path).render(MESSAGES) == "from the file"


def test_raise_exception_is_a_chat_template_error_naming_messages(tmp_path):
    template = load_chat_template(_tokenizer_only(tmp_path))
    with pytest.raises(ChatTemplateError, match="Unknown role: robot") as info:
        template.render([{"role": "robot", "content": "beep"}])
    assert info.value.param == "messages"


def test_the_sandbox_refuses_python_internals(tmp_path):
    path = _tokenizer_only(tmp_path, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        load_chat_template(path).render(MESSAGES)
    path = _tokenizer_only(tmp_path, chat_template="{% set _ = messages.append(1) %}x")
    with pytest.raises(ChatTemplateError):  # immutable: a template cannot change what it is given
        load_chat_template(path).render(MESSAGES)


def test_a_checkpoint_without_a_template_or_a_preset_is_a_clear_error(tmp_path):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(_tokenizer_only(tmp_path / "plain", chat_template=None))
    with pytest.raises(ChatTemplateError, match="neither a built-in preset nor a checkpoint directory"):
        load_chat_template(str(tmp_path / "nowhere"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(_tokenizer_only(tmp_path / "broken", chat_template="{% for %}"))



def test_the_presets_have_a_chat_template_over_their_byte_tokenizer():
    template = load_chat_template("tiny")
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    ids = template.encode(text)
    assert ids[0] == BYTE_VOCAB_BOS and bytes(ids[1:]).decode() == text
