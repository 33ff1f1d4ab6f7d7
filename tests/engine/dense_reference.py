"""The dense (non-paged) reference the paged engine is tested against.

No KV cache: every step recomputes the whole sequence with full causal attention
(`DenseCausalAttention`). Slow by design and obviously correct; tests compare the paged
engine's greedy tokens and logits with it, token for token. It lives with the tests, not in the
package: nothing but a test runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.engine.model import LlamaForCausalLM


class DenseCausalAttention:
    """Reference attention without a cache: each sequence attends causally over its own tokens.

    `seq_lens` splits the flattened batch into sequences that start at position 0. Written with
    plain matmul + softmax (float32 accumulate) so it shares no code with `PagedAttention`.
    """

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        outs = []
        for qs, ks, vs in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            ks = ks.repeat_interleave(group, dim=1)  # [n, Hq, D]
            vs = vs.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) / qs.shape[-1] ** 0.5
            n = qs.shape[0]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vs.float()).to(q.dtype))
        return torch.cat(outs)


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
