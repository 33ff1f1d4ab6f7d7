"""Greedy, temperature, top-k, top-p and seeded generators."""

from __future__ import annotations

import math

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
        counts[sampler.sample_one(probs.log(), params, gen)] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n), counts
    # A low temperature sharpens the distribution towards the most likely token.
    cold = SamplingParams(temperature=0.1)
    assert all(sampler.sample_one(probs.log(), cold, gen) == 0 for _ in range(50))
