"""The dense (non-paged) reference the paged engine is tested against.

No KV cache: every step recomputes the whole sequence with full causal attention
(`DenseCausalAttention`). Slow by design and obviously correct; tests compare the paged
engine's greedy tokens and logits with it, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.engine.attention import DenseCausalAttention
from kvbridge.engine.model import LlamaForCausalLM


@torch.inference_mode()
def dense_logits(model: LlamaForCausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of every position of one sequence starting at 0."""
    device = model.lm_head.weight.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    hidden = model(ids, positions, DenseCausalAttention([len(token_ids)]))
    return model.compute_logits(hidden)


def dense_greedy(
    model: LlamaForCausalLM, prompt_token_ids: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy completion of `prompt_token_ids`, recomputing the full sequence for every token."""
    tokens = list(prompt_token_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(dense_logits(model, tokens)[-1].argmax())
        out.append(token)
        tokens.append(token)
        if token in stop_token_ids:
            break
    return out
