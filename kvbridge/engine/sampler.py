"""Token sampling: penalties and min_tokens first; then greedy at temperature 0, otherwise
temperature, top-k, top-p.

A request with `SamplingParams.seed` draws from its own `torch.Generator`, owned by the model
runner for the request's lifetime, so its completion does not depend on what it was batched
with. Requests without a seed draw from torch's global generator.

Log-probabilities (`token_logprobs`) are computed only for requests whose `SamplingParams.logprobs`
is set, from the model's raw logits: before penalties, min_tokens, temperature, top-k and top-p, as
vLLM returns them by default. They describe the model's distribution, whatever the sampling settings.

A row whose sampling fails yields its exception instead of a token: one request's bad luck (logits
that are not finite) ends that request only. Probabilities that are not finite are never drawn
from: on a GPU, NaN would end in a device-side assert that ends the whole process.

Sampling is split at the host's wait: `sample_on_device` and `token_logprobs` leave their results
on the device (nothing waits for the GPU), `to_host` and `logprobs_to_host` read them back. The
engine's asynchronous scheduling feeds a step's device tokens to the next step before reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvbridge.engine.faults import is_engine_fault
from kvbridge.engine.outputs import TokenLogprobs
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


class TokenHistory(NamedTuple):
    """A request's tokens so far, for the parameters that depend on them."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """logits [V] -> logits [V] with the repetition, presence and frequency penalties applied (as vLLM does:
    repetition over prompt and output tokens, presence and frequency over output tokens)."""
    vocab_size = logits.shape[-1]
    output = torch.tensor(history.output_token_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(output, minlength=vocab_size).to(logits.dtype)  # [V]
    if params.repetition_penalty != 1.0:
        prompt = torch.tensor(history.prompt_token_ids, dtype=torch.long, device=logits.device)
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
        seen[prompt] = True
        seen |= counts > 0
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)


def suppress_stop_tokens(logits: torch.Tensor, params: SamplingParams, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """logits [V] with EOS (unless ignore_eos) and stop_token_ids at -inf: for a request short of min_tokens."""
    ids = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
    ids = torch.tensor([t for t in ids if t < logits.shape[-1]], dtype=torch.long, device=logits.device)
    return logits.index_fill(0, ids, float("-inf"))


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """logits [V] as the request's parameters that depend on its tokens change them."""
    if params.has_penalties:
        logits = apply_penalties(logits, params, history)
    if len(history.output_token_ids) < params.min_tokens:
        logits = suppress_stop_tokens(logits, params, eos_token_ids)
    return logits


class SampledRow(NamedTuple):
    token_id: torch.Tensor  # [] int64
    is_finite: torch.Tensor  # [] bool: False when the token is void (the probabilities were not finite)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> SampledRow:
    """logits [V] float32 -> one token id, drawn on the device without waiting for it.

    The draw is `torch.multinomial(probs, 1)`'s own one-sample path (argmax of probs / Exp(1) noise:
    the same token for the same generator state) without its check of `probs`, which waits for the
    device. Probabilities that are not finite are replaced by uniform ones instead (on a GPU NaN
    would end in a device-side assert that ends the process); `is_finite` says the token is void.
    """
    scaled = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    probs = scaled.softmax(-1)
    is_finite = torch.isfinite(probs).all()
    probs = torch.where(is_finite, probs, torch.ones_like(probs))
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return SampledRow(torch.argmax(probs / noise), is_finite)


class DeviceSamples(NamedTuple):
    """A step's sampled tokens, still on the device: `to_host` is where the host waits for them."""

    token_ids: torch.Tensor  # [N] int64
    errors: dict[int, Exception]  # rows whose sampling raised
    drawn_rows: list[int]  # rows drawn at a temperature: void unless their probabilities were finite
    is_finite: torch.Tensor | None  # [len(drawn_rows)] bool; None when no row was drawn
    not_finite_errors: list[ValueError]  # each drawn row's error, should it be void

    def start_host_copy(self) -> DeviceSamples:
        """These samples, their tensors being copied to pinned host memory (CUDA; on the CPU, as they
        are). Read them once the device passed the copies (an event recorded after this call)."""
        return self._replace(token_ids=_host_copy(self.token_ids), is_finite=_host_copy(self.is_finite))


def _host_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> DeviceSamples:
    """logits [N, V] -> N token ids on the device, row i sampled with params[i] and generators[i];
    an engine fault is raised. `histories[i]` holds row i's tokens; it may be None only when no
    row's params need them (`needs_token_history`).

    Greedy rows without penalties are taken in one argmax; the others one row at a time (each may
    own a generator and a history), written into the same tensor.
    """
    logits = logits.float()
    token_ids = torch.argmax(logits, dim=-1)  # [N]
    errors: dict[int, Exception] = {}
    drawn_rows: list[int] = []
    finite_flags: list[torch.Tensor] = []
    not_finite_errors: list[ValueError] = []
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.is_greedy and not p.needs_token_history:
            continue
        try:
            row = logits[i]
            if p.needs_token_history:
                if histories is None:
                    raise ValueError("penalties and min_tokens need the request's tokens; pass `histories`")
                row = adjust_logits(row, p, histories[i], eos_token_ids)
            if p.is_greedy:
                token_ids[i] = torch.argmax(row)
            else:
                token_ids[i], is_finite = sample_row(row, p, gen)
                drawn_rows.append(i)
                finite_flags.append(is_finite)
                error = ValueError(f"the probabilities at temperature {p.temperature} are not finite (NaN or inf logits)")
                not_finite_errors.append(error)
        except Exception as exc:  # noqa: BLE001 - this row's request fails, the others keep their tokens
            if is_engine_fault(exc):
                raise
            errors[i] = exc
    is_finite = torch.stack(finite_flags) if finite_flags else None
    return DeviceSamples(token_ids, errors, drawn_rows, is_finite, not_finite_errors)


def to_host(samples: DeviceSamples) -> list[int | Exception]:
    """The token id of each row, or the exception of a row whose sampling failed. Waits for the device."""
    tokens: list[int | Exception] = samples.token_ids.tolist()
    if samples.is_finite is not None:
        for i, is_finite, error in zip(samples.drawn_rows, samples.is_finite.tolist(), samples.not_finite_errors):
            if not is_finite:
                tokens[i] = error
    for i, exc in samples.errors.items():
        tokens[i] = exc
    return tokens


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> list[int | Exception]:
    """`sample_on_device`, then `to_host`: N token ids, or a row's exception instead of its token."""
    return to_host(sample_on_device(logits, params, generators, histories, eos_token_ids))


class DeviceLogprobs(NamedTuple):
    """`token_logprobs` of a step, still on the device."""

    chosen: torch.Tensor  # [R] the sampled token's logprob per row
    top_values: torch.Tensor  # [R, K] the K = max(num_top) largest logprobs per row
    top_ids: torch.Tensor  # [R, K]
    num_top: list[int]  # how many of them each row wants

    def start_host_copy(self) -> DeviceLogprobs:
        """As `DeviceSamples.start_host_copy`."""
        return self._replace(
            chosen=_host_copy(self.chosen), top_values=_host_copy(self.top_values), top_ids=_host_copy(self.top_ids)
        )


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> DeviceLogprobs:
    """logits [R, V] (the model's raw output), the token sampled from each row ([R], on the device) and
    how many of the most likely tokens each row wants. One log_softmax and one topk for all rows."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, token_ids.view(-1, 1)).view(-1)
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)
    return DeviceLogprobs(chosen, top_values, top_ids, list(num_top))


def logprobs_to_host(logprobs: DeviceLogprobs, token_ids: Sequence[int]) -> list[TokenLogprobs]:
    """Each row's TokenLogprobs (`token_ids`: the rows' sampled tokens, on the host). Waits for the device."""
    chosen, top_values, top_ids = logprobs.chosen.tolist(), logprobs.top_values.tolist(), logprobs.top_ids.tolist()
    return [
        TokenLogprobs(token_id, logprob, list(zip(top_ids[i][:k], top_values[i][:k])))
        for i, (token_id, logprob, k) in enumerate(zip(token_ids, chosen, logprobs.num_top))
    ]


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
