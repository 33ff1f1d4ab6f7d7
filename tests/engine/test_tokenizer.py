"""Byte-level tokenizer, tokenizer.json through the `tokenizers` library, special token ids."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvbridge.engine.presets import BYTE_VOCAB_BOS, BYTE_VOCAB_EOS
from kvbridge.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, special_token_ids
from kvbridge.errors import ModelLoadError

WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "kv", "bridge", "!"]


def write_tokenizer_json(path) -> None:
    """A word-level tokenizer that adds <s> in front, as Llama's post-processor does."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == BYTE_VOCAB_BOS and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([*ids, BYTE_VOCAB_EOS, 300]) == "héllo ✓"  # specials and reserved ids skipped
    assert tok.eos_token_id == BYTE_VOCAB_EOS and tok.vocab_size == 384


def test_byte_tokenizer_without_bos():
    tok = ByteTokenizer(bos_token_id=None, eos_token_ids=())
    assert tok.encode("ab") == [97, 98] and tok.eos_token_id is None
    with pytest.raises(ModelLoadError, match="at least 256"):
        ByteTokenizer(vocab_size=100)


def test_tokenizer_json_is_used_when_present(tmp_path):
    write_tokenizer_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello kv bridge !") == [1, 3, 5, 6, 7]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_generation_config_eos_wins_and_may_list_several(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert special_token_ids(str(tmp_path)) == (1, (7, 2))
    write_tokenizer_json(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_id == 7 and tok.eos_token_ids == (7, 2)


def test_no_tokenizer_json_is_refused_naming_the_files_found(tmp_path):
    """No byte-level fallback: a real model's ids would be garbage. The error says how to convert."""
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    missing = r"no tokenizer.json \(it has vocab.json, merges.txt\); .*AutoTokenizer"
    with pytest.raises(ModelLoadError, match=missing) as err:
        load_tokenizer(str(tmp_path))
    assert "sentencepiece" not in str(err.value)  # only a tokenizer.model needs it


def test_malformed_files_raise_model_load_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        special_token_ids(str(tmp_path))


def feed(stream, token_ids, chunk_sizes):
    """Add `token_ids` in chunks of the given sizes (cycled); the texts seen after each add."""
    seen, i, k = [], 0, 0
    while i < len(token_ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        stream.add(token_ids[i : i + n])
        seen.append(stream.text)
        i, k = i + n, k + 1
    return seen


def test_byte_stream_decodes_only_new_tokens_and_ends_like_decode():
    tok = ByteTokenizer()
    ids = tok.encode("héllo → wörld 🙂 ok")[1:] + [tok.eos_token_id]  # multi-byte characters, an id >= 256
    for chunks in ([1], [2, 3], [len(ids)]):
        stream = tok.stream()
        seen = feed(stream, ids, chunks)
        full = tok.decode(ids)
        assert all(full.startswith(text) for text in seen), "a stream's text is always a prefix of the whole"
        assert stream.text == full and stream.finish(ids) == full
    cut = tok.encode("a🙂")[1:-1]  # the emoji's last byte never comes
    stream = tok.stream()
    stream.add(cut)
    assert stream.text == "a" and stream.finish(cut) == tok.decode(cut) == "a\ufffd"


def test_tokenizer_json_stream_ends_like_decode(tmp_path):
    write_tokenizer_json(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("hello world hello")
    stream = tok.stream()
    seen, full = feed(stream, ids, [1]), tok.decode(ids)
    assert all(full.startswith(text) for text in seen) and stream.text == full and stream.finish(ids) == full
    assert stream.num_tokens == len(ids)
