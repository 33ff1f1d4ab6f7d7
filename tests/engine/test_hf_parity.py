"""Checkpoints that transformers writes load into kvbridge and compute what transformers computes.

Each case saves a tiny random Llama, Qwen2 or Mistral with `save_pretrained` (transformers >= 5 writes
`rope_parameters`; the "v4" cases rewrite config.json into the older top-level `rope_theta` and
`rope_scaling`, and check that transformers reads it back the same), loads it with kvbridge, and
compares, on a prompt reaching past the original context of the scaled types, the logits of every
position with transformers' forward and the paged engine's greedy tokens with transformers' greedy
loop. Every case also checks that its ablation (the scaling dropped, or the default theta) moves the
logits far beyond the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from dense_reference import dense_logits
from test_weights import write_word_tokenizer

from kvbridge import LLM, SamplingParams
from kvbridge.engine.model import RotaryEmbedding
from kvbridge.engine.presets import with_overrides
from kvbridge.errors import ConfigError

VOCAB = 300
PROMPT_LEN, MAX_TOKENS = 100, 6  # positions up to 105: past every case's original context of 32
ATOL = RTOL = 1e-4
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
NO_SCALING = {"rope_scaling": None}
DEFAULT_THETA = {"rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


class Case:
    def __init__(self, family: str, rope: dict, form: str = "v5", ablate: dict = NO_SCALING, **config) -> None:
        self.family, self.rope, self.form, self.ablate, self.config = family, rope, form, ablate, config


CASES = {
    # The user's bug: theta 500000 inside rope_parameters was read as 10000.
    "llama-rope_parameters-theta": Case("llama", {"rope_type": "default", "rope_theta": 500000.0},
                                        ablate=DEFAULT_THETA),
    "llama-v4-theta-tied": Case("llama", {"rope_type": "default", "rope_theta": 500000.0}, "v4", DEFAULT_THETA,
                                tie_word_embeddings=True),
    "llama-llama3": Case("llama", {**LLAMA3, "rope_theta": 10000.0}),  # theta 1e4: every band of llama3 is hit
    "llama-v4-llama3": Case("llama", {**LLAMA3, "rope_theta": 10000.0}, "v4"),
    "llama-v4-linear-legacy-type-key": Case("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                            "v4-type"),
    # Plain RoPE below max_position_embeddings, where kvbridge caps the context (see test below).
    "llama-dynamic": Case("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500000.0},
                          ablate=DEFAULT_THETA),
    "qwen2-biases-tied": Case("qwen2", {"rope_type": "default", "rope_theta": 1e6}, ablate=DEFAULT_THETA,
                              tie_word_embeddings=True),
    # Qwen2.5's long-context form: max_position_embeddings is the original length, yarn stretches it 4x.
    "qwen2-yarn": Case("qwen2", {**YARN, "rope_theta": 1e6}, max_position_embeddings=32),
    "qwen2-v4-yarn-attention-factor": Case("qwen2", {**YARN, "rope_theta": 1e6, "attention_factor": 1.3,
                                                     "beta_fast": 16.0, "beta_slow": 2.0}, "v4"),
    "mistral-untied": Case("mistral", {"rope_type": "default", "rope_theta": 1e6}, ablate=DEFAULT_THETA),
    "mistral-yarn-mscale-untruncated": Case("mistral", {**YARN, "rope_theta": 1e4, "mscale": 1.0,
                                                        "mscale_all_dim": 0.5, "truncate": False}),
    "mistral-linear": Case("mistral", {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}),
}  # fmt: skip


def hf_model(case: Case, seed: int):
    """A transformers model of `case`, every parameter drawn from `seed` (biases and norms included)."""
    config_cls, model_cls = FAMILIES[case.family]
    config = config_cls(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, bos_token_id=1, eos_token_id=2, rope_parameters=dict(case.rope),
        **{"max_position_embeddings": 128, **case.config},
    )  # fmt: skip
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:  # unit-scale activations: attention is sharp enough for positions to matter
                param.copy_(noise / math.sqrt(param.shape[1]))
    return model


def save_checkpoint(model, case: Case, path) -> None:
    """`save_pretrained`, a word-level tokenizer.json, and config.json in the case's form."""
    model.save_pretrained(path)
    write_word_tokenizer(path)
    config = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in config and "rope_theta" not in config  # the form transformers >= 5 writes
    if case.form.startswith("v4"):  # what transformers < 5 wrote
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope} if case.form == "v4-type" else rope
        (path / "config.json").write_text(json.dumps(config))
        read_back = transformers.AutoConfig.from_pretrained(path).rope_parameters
        read_back.pop("type", None)  # transformers keeps the legacy key next to "rope_type"
        assert read_back == model.config.rope_parameters


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(name, tmp_path):
    case, seed = CASES[name], sorted(CASES).index(name)
    print(f"seed={seed}")
    hf = hf_model(case, seed)
    save_checkpoint(hf, case, tmp_path)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    expected_tokens = hf_greedy(hf, prompt, MAX_TOKENS)

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path), num_blocks=16) as llm:
        model = llm.engine.runner.model
        torch.testing.assert_close(dense_logits(model, prompt), expected, atol=ATOL, rtol=RTOL)
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected_tokens
        if case.config.get("tie_word_embeddings"):
            assert model.lm_head.weight is model.model.embed_tokens.weight
        model.rotary = RotaryEmbedding(with_overrides(model.args, **case.ablate), PROMPT_LEN, "cpu")
        assert (dense_logits(model, prompt) - expected).abs().max() > 100 * ATOL  # the comparison can fail


def test_yarn_stretches_the_context_and_dynamic_stays_within_it(tmp_path):
    """YaRN's context is factor x original; dynamic NTK is exact only up to max_position_embeddings."""
    for name, limit in (("qwen2-yarn", 4 * 32), ("llama-dynamic", 128)):
        path = tmp_path / name
        save_checkpoint(hf_model(CASES[name], 0), CASES[name], path)
        with LLM(str(path), num_blocks=64) as llm:
            assert llm.engine.runner.max_model_len == limit, name
        with pytest.raises(ConfigError, match=f"exceeds the model's limit of {limit}"):
            LLM(str(path), num_blocks=64, max_model_len=limit + 1)
