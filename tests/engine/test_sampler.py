"""Greedy, temperature, top-k, top-p and seeded generators."""

from __future__ import annotations

import math

import pytest
import torch

from kvbridge.engine import sampler
from kvbridge.engine.sampling_params import SamplingParams


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sampler.sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    out = sampler.apply_top_k(logits, 2)
    assert torch.isinf(out[[0, 3]]).all() and torch.equal(out[[1, 2]], logits[[1, 2]])
    assert torch.equal(sampler.apply_top_k(logits, 0), logits)
    assert torch.equal(sampler.apply_top_k(logits, 10), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = ~torch.isinf(sampler.apply_top_p(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    kept = ~torch.isinf(sampler.apply_top_p(logits, 0.5))
    assert kept.tolist() == [True, False, False, False]
    kept = ~torch.isinf(sampler.apply_top_p(logits[[3, 1, 0, 2]], 0.7))  # order does not matter
    assert kept.tolist() == [False, True, True, False]
    assert not torch.isinf(sampler.apply_top_p(logits, 1.0)).any()


def test_top_k_one_is_greedy_at_any_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=gen)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    assert sampler.sample(logits, params, [None] * 8) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure generator output
    params = [SamplingParams(temperature=1.0, seed=42)]

    def draws(seed: int) -> list[int]:
        gen = sampler.make_generator(seed, torch.device("cpu"))
        return [sampler.sample(logits, params, [gen])[0] for _ in range(10)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


def test_temperature_sampling_follows_the_distribution():
    seed = 123
    print("seed", seed)
    gen = sampler.make_generator(seed, torch.device("cpu"))
    probs = torch.tensor([0.6, 0.3, 0.1])
    params = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    n = 3000
    for _ in range(n):
        counts[sampler.sample(probs.log()[None], [params], [gen])[0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n), counts
    # A low temperature sharpens the distribution towards the most likely token.
    cold = SamplingParams(temperature=0.1)
    assert all(sampler.sample(probs.log()[None], [cold], [gen]) == [0] for _ in range(50))


def test_top_p_below_float32_range_keeps_the_most_likely_token():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    params = SamplingParams(temperature=1.0, top_p=1e-300)
    assert all(sampler.sample(logits[None], [params], [None]) == [1] for _ in range(20))


def test_a_row_that_cannot_be_sampled_yields_its_error_and_the_others_their_tokens():
    logits = torch.tensor([[0.1, 3.0, -1.0], [math.nan, math.nan, math.nan], [5.0, 4.9, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1)]
    first, bad, last = sampler.sample(logits, params, [None] * 3)
    assert first == 1 and last == 0
    assert isinstance(bad, ValueError) and "not finite" in str(bad)


def test_a_device_fault_while_sampling_is_raised(monkeypatch):
    def lost_device(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sampler, "sample_row", lost_device)
    with pytest.raises(RuntimeError, match="CUDA error"):
        sampler.sample(torch.zeros(1, 4), [SamplingParams(temperature=1.0)], [None])


def test_the_largest_seed_is_accepted_by_torch():
    generator = sampler.make_generator(2**64 - 1, torch.device("cpu"))
    assert generator.initial_seed() == 2**64 - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draw_is_the_token_torch_multinomial_draws(seed):
    """sample_row skips multinomial's check that waits for the device, not its draw: the same token
    from the same generator state, whatever the temperature, top-k and top-p."""
    print("seed", seed)
    logits = torch.randn(384, generator=torch.Generator().manual_seed(seed)) * 3
    ours, theirs = (sampler.make_generator(seed, torch.device("cpu")) for _ in range(2))
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)) * 20:
        token, is_finite = sampler.sample_row(logits, params, ours)
        probs = sampler.apply_top_p(sampler.apply_top_k(logits / params.temperature, params.top_k), params.top_p).softmax(-1)
        assert bool(is_finite) and int(token) == int(torch.multinomial(probs, 1, generator=theirs))
