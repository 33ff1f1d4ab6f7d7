"""Token sampling: greedy at temperature 0; otherwise temperature, top-k, top-p.

A request with `SamplingParams.seed` draws from its own `torch.Generator`, owned by the model
runner for the request's lifetime, so its completion does not depend on what it was batched
with. Requests without a seed draw from torch's global generator.

A row whose sampling fails yields its exception instead of a token: one request's bad luck (logits
that are not finite) ends that request only. Probabilities are checked before `multinomial`,
which on a GPU answers NaN with a device-side assert that ends the whole process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.engine.faults import is_engine_fault
from kvbridge.engine.sampling_params import SamplingParams


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits [V]: everything below the k-th largest set to -inf (0 or >= V: unchanged)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [V]: keep the smallest set of most likely tokens whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token when the tokens before it already reach top_p; the most likely always stays
    # (explicitly: a top_p below float32's range, e.g. 1e-300, compares as 0 and would drop it too).
    drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] float32 -> one token id."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    scaled = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"the probabilities at temperature {params.temperature} are not finite (NaN or inf logits)")
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int | Exception]:
    """logits [N, V] -> N token ids, row i sampled with params[i] and generators[i]; a row whose
    sampling raised holds the exception instead (an engine fault is raised).

    Greedy rows are taken in one argmax; the others one row at a time (each may own a generator).
    """
    logits = logits.float()
    tokens: list[int | Exception] = torch.argmax(logits, dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            try:
                tokens[i] = sample_one(logits[i], p, gen)
            except Exception as exc:  # noqa: BLE001 - this row's request fails, the others keep their tokens
                if is_engine_fault(exc):
                    raise
                tokens[i] = exc
    return tokens


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
