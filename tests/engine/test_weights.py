"""Loading local Hugging Face checkpoints written to tmp_path with safetensors."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from dense_reference import dense_greedy, dense_logits
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvbridge import LLM, SamplingParams
from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine import checkpoint_id as checkpoint_id_module
from kvbridge.engine.checkpoint_id import checkpoint_id
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.presets import ModelArgs, get_preset, with_overrides
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.weights import random_model, read_hf_config, read_rope_config
from kvbridge.errors import ConfigError, ModelLoadError

LLAMA = ModelArgs(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=96, max_position=512, rope_theta=5000.0, rms_norm_eps=1e-6)  # fmt: skip


def hf_names(num_layers: int, qkv_bias: bool, tied: bool) -> set[str]:
    """The tensor names of a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM checkpoint."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if qkv_bias:
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def write_word_tokenizer(path) -> None:
    """A tokenizer.json: a checkpoint without one is refused."""
    words = ["<unk>", "<s>", "</s>", "hello", "world"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.save(str(path / "tokenizer.json"))


def write_checkpoint(path, args: ModelArgs, arch: str, seed: int = 0, num_shards: int = 1, **config_extra):
    """A random model saved the way transformers < 5 saved it; returns the model (float32, CPU).

    test_hf_parity.py checks checkpoints that transformers itself writes.
    """
    model = random_model(args, seed)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        del tensors["lm_head.weight"]  # transformers stores a tied head once
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(args.head_dim // 2)  # old exports
    assert set(tensors) - {"model.layers.0.self_attn.rotary_emb.inv_freq"} == hf_names(
        args.num_layers, args.qkv_bias, args.tie_word_embeddings
    )
    names = sorted(tensors)
    shards = [names[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" if num_shards > 1 else "model.safetensors"
        save_file({n: tensors[n] for n in shard}, os.path.join(path, file))
        weight_map.update({n: file for n in shard})
    if num_shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = {
        "architectures": [arch], "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "intermediate_size": args.intermediate_size,
        "max_position_embeddings": args.max_position, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.rms_norm_eps, "tie_word_embeddings": args.tie_word_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **config_extra,
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_word_tokenizer(path)
    return model


def assert_loads_like(path, reference_model, max_model_len=128):
    runner = ModelRunner(ModelConfig(model=str(path), max_model_len=max_model_len), CacheConfig(num_blocks=16))
    reference_model.attach_rotary(max_model_len)
    prompt = [1, 17, 250, 3, 99, 42, 7]
    torch.testing.assert_close(dense_logits(runner.model, prompt), dense_logits(reference_model, prompt), atol=1e-5, rtol=1e-5)
    # And through the paged path: one prefill step samples the dense greedy token.
    req = Request("r", prompt, SamplingParams(temperature=0.0), 16)
    out = runner.execute(SchedulerOutput([ScheduledRequest(req, 0, len(prompt), [5])]))
    assert out.sampled_token_ids["r"] == dense_greedy(reference_model, prompt, 1)[0]
    return runner


def test_llama_sharded(tmp_path):
    ref = write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM", seed=1, num_shards=3)
    runner = assert_loads_like(tmp_path, ref)
    files = [str(tmp_path / f"model-{i:05d}-of-00003.safetensors") for i in (1, 2, 3)]
    assert runner.model_id == checkpoint_id(str(tmp_path / "config.json"), files)
    assert runner.model_id.startswith("LlamaForCausalLM:") and len(runner.model_id.split(":")[1]) == 32
    assert runner.layout.num_kv_heads == 2 and runner.layout.head_dim == 16
    assert runner.tokenizer.eos_token_id == 2  # from config.json
    runner.shutdown()


def test_qwen2_biases_tied_embeddings_and_tokenizer_json(tmp_path):
    args = ModelArgs(**{**LLAMA.__dict__, "qkv_bias": True, "tie_word_embeddings": True})
    ref = write_checkpoint(tmp_path, args, "Qwen2ForCausalLM", seed=2, sliding_window=64, use_sliding_window=False)
    words = ["<unk>", "<|endoftext|>", "<|im_end|>", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    runner = assert_loads_like(tmp_path, ref)
    assert runner.tokenizer.encode("hello world") == [3, 4]  # Qwen2 adds no BOS
    assert runner.tokenizer.decode([3, 4]) == "hello world"
    assert runner.tokenizer.eos_token_ids == (2, 1)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert runner.max_model_len == 128  # sliding window unused by Qwen2 unless use_sliding_window
    runner.shutdown()


def test_mistral_explicit_head_dim_and_sliding_window_cap(tmp_path):
    args = ModelArgs(**{**LLAMA.__dict__, "head_dim": 32})  # != hidden_size / num_heads
    ref = write_checkpoint(tmp_path, args, "MistralForCausalLM", seed=3, head_dim=32, sliding_window=96)
    runner = assert_loads_like(tmp_path, ref, max_model_len=96)
    assert runner.layout.head_dim == 32
    runner.shutdown()
    with pytest.raises(ConfigError, match="exceeds the model's limit of 96"):
        ModelRunner(ModelConfig(model=str(tmp_path), max_model_len=128), CacheConfig(num_blocks=16))


def test_not_a_preset_nor_a_directory():
    with pytest.raises(ModelLoadError, match="fetches nothing"):
        ModelRunner(ModelConfig(model="meta-llama/Llama-3-8B"), CacheConfig(num_blocks=4))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_unsupported_architecture(tmp_path):
    write_checkpoint(tmp_path, LLAMA, "GPT2LMHeadModel")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_missing_shard(tmp_path):
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM", num_shards=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match="missing"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_missing_tensor_and_wrong_shape(tmp_path):
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ModelLoadError, match="has shape"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="lacks .* tensors"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_no_safetensors(tmp_path):
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM")
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_sentencepiece_only_tokenizer_is_refused_with_the_fix(tmp_path):
    """No silent byte-level tokenizer: the error names what is missing and how to write it."""
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM")
    os.remove(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(ModelLoadError, match=r"no tokenizer.json \(it has tokenizer.model\).*sentencepiece.*save_"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))
    os.remove(tmp_path / "tokenizer.model")
    with pytest.raises(ModelLoadError, match="no tokenizer.json; .*copy in the tokenizer.json"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


def test_tensors_the_model_cannot_hold_are_refused(tmp_path):
    """Llama's attention_bias also biases o_proj, which kvbridge's model lacks: never dropped silently."""
    write_checkpoint(tmp_path, with_overrides(LLAMA, qkv_bias=True), "LlamaForCausalLM", attention_bias=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="1 tensors kvbridge's model has no place for.*o_proj.bias"):
        ModelRunner(ModelConfig(model=str(tmp_path)), CacheConfig(num_blocks=4))


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "'linear' needs numbers for \\['factor'\\]"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"max_position_embeddings": None}, "lacks 'max_position_embeddings'"),
    ],
)
def test_config_forms_kvbridge_cannot_run_are_refused(tmp_path, config, error):
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM", **config)
    if config.get("max_position_embeddings", 0) is None:
        cfg = json.loads((tmp_path / "config.json").read_text())
        del cfg["max_position_embeddings"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=error):
        read_hf_config(str(tmp_path))


BASE = {"max_position_embeddings": 1024}


@pytest.mark.parametrize(
    ("config", "theta", "scaling", "max_position"),
    [
        ({}, 10000.0, None, 1024),  # transformers' default theta
        ({"rope_theta": 5e5}, 5e5, None, 1024),  # transformers < 5
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 5e5, None, 1024),  # >= 5
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, 5e5, None, 1024),  # inside wins
        ({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
         5e5, {"rope_type": "linear", "factor": 2.0}, 1024),
        # rope_scaling wins over rope_parameters, as in transformers
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
         1e4, {"rope_type": "dynamic", "factor": 2.0}, 1024),
        # llama3 and yarn: original_max_position_embeddings defaults to max_position_embeddings ...
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
         1e4, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}, 1024),
        # ... and yarn's context is factor x original, its factor derived from the two lengths when null
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
         1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),
        ({"rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}},
         1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
        # a top-level original length wins, as transformers does for it
        ({"original_max_position_embeddings": 128, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                                     "original_max_position_embeddings": 512}},
         1e4, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}, 1024),
    ],
)  # fmt: skip
def test_rope_config_forms(config, theta, scaling, max_position):
    assert read_rope_config({**BASE, **config}) == (theta, scaling, max_position)


def test_per_layer_rope_parameters_are_refused():
    nested = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    with pytest.raises(ConfigError, match="per-layer-type"):
        read_rope_config({**BASE, "rope_parameters": nested})


# ---------------------------------------------------------------- checkpoint identity


def _id(path) -> str:
    return checkpoint_id(str(path / "config.json"), [str(path / "model.safetensors")])


def _tensor_offset(file, name: str) -> tuple[int, int]:
    """(absolute byte offset, size in bytes) of tensor `name`'s data in a safetensors file."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(length))[name]["data_offsets"]
    return 8 + length + begin, end - begin


def _poke(file, name: str, at: float, value: float = 0.5) -> None:
    """Overwrite one float32 of tensor `name`, at fraction `at` of its data, in place: same shapes."""
    offset, size = _tensor_offset(file, name)
    with open(file, "r+b") as f:
        f.seek(offset + int(size * at) // 4 * 4)
        old = struct.unpack("<f", f.read(4))[0]
        f.seek(-4, os.SEEK_CUR)
        f.write(struct.pack("<f", value if old != value else -value))


MIDDLE = "model.layers.1.self_attn.v_proj.weight"  # neither the first nor the last tensor of the file


def test_checkpoint_id_changes_with_one_weight_value(tmp_path):
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM", seed=1)
    before = _id(tmp_path)
    assert _id(tmp_path) == before  # deterministic
    _poke(tmp_path / "model.safetensors", MIDDLE, at=0.37)
    assert _id(tmp_path) != before  # a small file is hashed whole: one value anywhere counts


def test_checkpoint_id_does_not_depend_on_the_directory(tmp_path):
    """The same files at another path (another host, a copy) share KV; new files at the old path do not."""
    (tmp_path / "a").mkdir()
    write_checkpoint(tmp_path / "a", LLAMA, "LlamaForCausalLM", seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert _id(tmp_path / "a") == _id(tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    (tmp_path / "b" / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    assert _id(tmp_path / "a") != _id(tmp_path / "b")  # config.json is part of it


def test_sampled_identity_of_large_files(tmp_path, monkeypatch):
    """Above FULL_HASH_MAX_BYTES a file is sampled per tensor: a tensor whose values change broadly
    always changes the id; KVBRIDGE_CHECKPOINT_FULL_HASH=1 makes any one value count again."""
    monkeypatch.setattr(checkpoint_id_module, "FULL_HASH_MAX_BYTES", 0)  # every file counts as large
    monkeypatch.setattr(checkpoint_id_module, "SAMPLE_BYTES", 256)  # windows small next to this model's tensors
    monkeypatch.delenv("KVBRIDGE_CHECKPOINT_FULL_HASH", raising=False)
    write_checkpoint(tmp_path, LLAMA, "LlamaForCausalLM", seed=1)
    file = tmp_path / "model.safetensors"
    _, size = _tensor_offset(file, MIDDLE)
    assert size > 3 * checkpoint_id_module.SAMPLE_BYTES  # the test samples, rather than hashes, this tensor
    sampled = _id(tmp_path)
    for at in (0.0, 0.5, 0.999):  # each window of the tensor
        _poke(file, MIDDLE, at=at, value=float(at) + 1.0)
        assert _id(tmp_path) != sampled, at
        sampled = _id(tmp_path)
    monkeypatch.setenv("KVBRIDGE_CHECKPOINT_FULL_HASH", "1")
    full = _id(tmp_path)
    assert full != sampled  # the mode is part of the identity: nodes must agree on it
    _poke(file, MIDDLE, at=0.3)  # outside every window: only the full hash sees it
    assert _id(tmp_path) != full


def test_new_weights_at_the_same_path_do_not_hit_the_old_disk_tier(tmp_path):
    """The bug this identity fixes: a checkpoint replaced in place was served its predecessor's KV."""
    ckpt, disk = tmp_path / "ckpt", tmp_path / "disk"
    ckpt.mkdir()
    prompt = {"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(48)]}  # three full blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    offload = {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 16, "disk_dir": str(disk)}}

    def run(**kwargs):
        with LLM(str(ckpt), num_blocks=16, max_model_len=128, **kwargs) as llm:
            out = llm.generate(prompt, params)[0]
            stats = llm.get_stats()
        return out, stats

    write_checkpoint(ckpt, LLAMA, "LlamaForCausalLM", seed=1)
    first, _ = run(kv_transfer_config=offload)
    assert len(os.listdir(disk)) == 3
    write_checkpoint(ckpt, LLAMA, "LlamaForCausalLM", seed=2)  # new weights, same shapes, same path
    expected, _ = run()
    assert expected.outputs[0].token_ids != first.outputs[0].token_ids  # the weights do matter here
    second, stats = run(kv_transfer_config=offload)
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert second.num_external_tokens == 0 and stats["connector"]["scheduler"]["disk_hit_blocks"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_model_is_drawn_once_whatever_the_dtype(dtype):
    """Drawing straight into `dtype` gives the float32 weights cast, the byte-level head shaped."""
    args = get_preset("tiny")
    direct, reference = random_model(args, 3, dtype=dtype), random_model(args, 3).to(dtype=dtype)
    for (name, a), (_, b) in zip(direct.named_parameters(), reference.named_parameters(), strict=True):
        assert a.dtype == dtype and torch.equal(a, b), name
    head = direct.lm_head.weight
    assert not head[256:].any() and head[:256].abs().sum() > 0


def test_tied_random_model_keeps_one_table():
    args = with_overrides(get_preset("tiny"), tie_word_embeddings=True)
    model = random_model(args, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
