"""The Llama-style model's parts: RMSNorm, RoPE, random presets, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from dense_reference import dense_greedy, dense_logits

from kvbridge.engine.model import RMSNorm, RotaryEmbedding, rope_inv_freq
from kvbridge.engine.presets import PRESETS, get_preset, with_overrides
from kvbridge.engine.weights import random_model
from kvbridge.errors import ConfigError, ModelLoadError

TINY = get_preset("tiny")


def tiny_model(seed: int = 0, dtype=torch.float32):
    model = random_model(TINY, seed).to(dtype=dtype).eval()
    model.attach_rotary(256)
    return model


def test_rmsnorm_matches_formula():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[3.0, -4.0, 0.0, 0.0]])
    rms = (25 / 4) ** 0.5
    expected = x / rms * norm.weight
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(TINY, 64, "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)

    def score(m: int, n: int) -> float:
        qm = rope.apply(q, torch.tensor([m]))
        kn = rope.apply(k, torch.tensor([n]))
        return float((qm * kn).sum())

    assert score(10, 7) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(10, 7) != pytest.approx(score(10, 9), abs=1e-3)
    torch.testing.assert_close(rope.apply(q, torch.tensor([0])), q)  # position 0 is the identity


def test_llama3_rope_scaling_divides_only_low_frequencies():
    plain = rope_inv_freq(TINY)
    scaled_args = with_overrides(
        TINY,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )  # fmt: skip
    scaled = rope_inv_freq(scaled_args)
    assert scaled[0] == plain[0]  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)  # lowest frequency divided by factor


def test_unsupported_or_incomplete_rope_scaling_is_refused():
    with pytest.raises(ConfigError, match="'longrope' is not supported"):
        with_overrides(TINY, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ConfigError, match="needs numbers for \\['original_max_position_embeddings'\\]"):
        with_overrides(TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_yarn_keeps_high_frequencies_and_scales_attention():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = RotaryEmbedding(TINY, 64, "cpu")
    scaled = RotaryEmbedding(with_overrides(TINY, rope_scaling=yarn), 64, "cpu")
    inv_plain, inv_scaled = rope_inv_freq(TINY), rope_inv_freq(with_overrides(TINY, rope_scaling=yarn))
    assert inv_scaled[0] == inv_plain[0] and torch.isclose(inv_scaled[-1], inv_plain[-1] / 4)
    mscale = 0.1 * math.log(4.0) + 1.0
    torch.testing.assert_close(scaled.cos[0], plain.cos[0] * mscale)  # position 0: cos 1 times the temperature


def test_dynamic_rope_refuses_tables_past_max_position():
    dynamic = with_overrides(TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.testing.assert_close(RotaryEmbedding(dynamic, 64, "cpu").cos, RotaryEmbedding(TINY, 64, "cpu").cos)
    with pytest.raises(ModelLoadError, match="exact only up to 4096"):
        RotaryEmbedding(dynamic, 4097, "cpu")


def test_random_weights_depend_on_seed_only():
    a, b, c = random_model(TINY, 0), random_model(TINY, 0), random_model(TINY, 1)
    wa, wb, wc = (m.model.layers[2].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_gqa_geometries(name):
    args = PRESETS[name]
    assert args.num_heads % args.num_kv_heads == 0 and args.num_queries_per_kv >= 1
    assert args.bos_token_id is not None and args.eos_token_id is not None


def test_model_args_reject_bad_geometry():
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        with_overrides(TINY, num_heads=3)
    with pytest.raises(ConfigError, match="even"):
        with_overrides(TINY, head_dim=31)


def test_tiny_greedy_output_is_not_degenerate():
    tokens = dense_greedy(tiny_model(), [256, *b"Hello, world"], 32)
    assert len(set(tokens)) >= 8, tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precisions_run_on_cpu_close_to_float32(dtype):
    prompt = [256, *b"The quick brown fox"]
    ref = dense_logits(tiny_model(), prompt)
    got = dense_logits(tiny_model(dtype=dtype), prompt)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # Low-precision weights move the logits a little, not a lot.
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_forward_after_release_fails_clearly():
    model = tiny_model()
    model.release()
    with pytest.raises(RuntimeError, match="attach_rotary"):
        dense_logits(model, [1, 2, 3])
